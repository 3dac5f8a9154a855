"""The syncer's outer step on flat fp32 vectors (the round's mean is `yeto.sync.merge.aggregate`'s, its weights and
rules `yeto.sync.merge.rules`'s)."""

from __future__ import annotations

import numpy as np


def nesterov_step(params: np.ndarray, avg_delta: np.ndarray, momentum: np.ndarray, lr: float,
                  mu: float) -> tuple[np.ndarray, np.ndarray]:
    """DiLoCo's outer step: the pseudo-gradient is -avg_delta (global minus the mean
    local result); SGD with Nesterov momentum, as torch.optim.SGD(nesterov=True):
    m <- mu*m + g;  params <- params - lr*(g + mu*m).
    In fp32, written with g = -avg_delta folded into subtractions (the same bits, two temporaries fewer)."""
    avg = np.asarray(avg_delta, dtype=np.float32)
    m = np.multiply(momentum, np.float32(mu), dtype=np.float32)
    m -= avg
    step = m * np.float32(mu)
    step -= avg
    step *= np.float32(lr)
    return np.subtract(params, step, out=step, dtype=np.float32), m


def nesterov_step_on(params: np.ndarray, avg_delta: np.ndarray, momentum: np.ndarray, lr: float, mu: float,
                     pieces: list[tuple[int, int]]) -> tuple[np.ndarray, np.ndarray]:
    """The outer step on the (start, numel) pieces of a streamed part only (Streaming DiLoCo: each part takes its
    own outer step when it syncs): inside them `nesterov_step`, elementwise, so each part's momentum is its own;
    outside them the parameters and the momentum stay as they are (a zero pseudo-gradient would still move them
    by lr * mu * m)."""
    new, m = params.astype(np.float32, copy=True), momentum.astype(np.float32, copy=True)
    for a, n in pieces:
        new[a : a + n], m[a : a + n] = nesterov_step(params[a : a + n], avg_delta[a : a + n], momentum[a : a + n],
                                                     lr, mu)
    return new, m
