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
