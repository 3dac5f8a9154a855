"""The syncer's math on flat fp32 vectors: token weights and the outer Nesterov step (the round's mean is
`yeto.sync.aggregate`'s)."""

from __future__ import annotations

from typing import Sequence

import numpy as np


def merge_weights(tokens: Sequence[int]) -> np.ndarray:
    """Weights proportional to each responder's loss-bearing tokens (sum 1)."""
    t = np.asarray(tokens, dtype=np.float64)
    if t.size == 0 or (t < 0).any() or t.sum() <= 0:
        raise ValueError(f"merge needs positive token counts, got {list(tokens)}")
    return t / t.sum()


def nesterov_step(params: np.ndarray, avg_delta: np.ndarray, momentum: np.ndarray, lr: float,
                  mu: float) -> tuple[np.ndarray, np.ndarray]:
    """DiLoCo's outer step: the pseudo-gradient is -avg_delta (global minus the mean
    local result); SGD with Nesterov momentum, as torch.optim.SGD(nesterov=True):
    m <- mu*m + g;  params <- params - lr*(g + mu*m)."""
    g = -avg_delta
    m = mu * momentum + g
    return (params - lr * (g + mu * m)).astype(np.float32), m.astype(np.float32)
