"""The syncer's math on flat fp32 vectors: token-weighted merge and the outer Nesterov step."""

from __future__ import annotations

from typing import Sequence

import numpy as np


def merge_weights(tokens: Sequence[int]) -> np.ndarray:
    """Weights proportional to each responder's loss-bearing tokens (sum 1)."""
    t = np.asarray(tokens, dtype=np.float64)
    if t.size == 0 or (t < 0).any() or t.sum() <= 0:
        raise ValueError(f"merge needs positive token counts, got {list(tokens)}")
    return t / t.sum()


def merge_deltas(deltas: Sequence[np.ndarray], weights: np.ndarray) -> np.ndarray:
    """sum_i w_i * delta_i, accumulated in place (torch: one multi-threaded pass per delta)."""
    import torch

    out = torch.zeros(deltas[0].size, dtype=torch.float32)
    for d, w in zip(deltas, weights):
        out.add_(torch.from_numpy(np.ascontiguousarray(d, dtype=np.float32).reshape(-1)), alpha=float(w))
    return out.numpy().reshape(deltas[0].shape)


def outer_update(params: np.ndarray, momentum: np.ndarray, deltas: Sequence[np.ndarray], loss_tokens: Sequence[int],
                 lr: float, mu: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """One outer round: (new params, new momentum, merge weights) from the responders' deltas."""
    weights = merge_weights(loss_tokens)
    new_params, new_momentum = nesterov_step(params, merge_deltas(deltas, weights), momentum, lr, mu)
    return new_params, new_momentum, weights


def nesterov_step(params: np.ndarray, avg_delta: np.ndarray, momentum: np.ndarray, lr: float,
                  mu: float) -> tuple[np.ndarray, np.ndarray]:
    """DiLoCo's outer step: the pseudo-gradient is -avg_delta (global minus the mean
    local result); SGD with Nesterov momentum, as torch.optim.SGD(nesterov=True):
    m <- mu*m + g;  params <- params - lr*(g + mu*m)."""
    g = -avg_delta
    m = mu * momentum + g
    return (params - lr * (g + mu * m)).astype(np.float32), m.astype(np.float32)
