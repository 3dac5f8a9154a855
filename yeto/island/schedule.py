"""The inner loop's schedule: the learning rate over steps and the order in which blocks are drawn."""

from __future__ import annotations

import math

import numpy as np

from yeto import YetoError


def lr_lambda(step: int, warmup: int, total: int, min_ratio: float) -> float:
    """Linear warmup, then cosine decay to `min_ratio` of the peak."""
    if step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


class BatchSampler:
    """Endless, deterministic batches of block indices: a fresh seeded permutation per epoch."""

    def __init__(self, n: int, batch_size: int, seed: int):
        self.n, self.batch_size, self.seed = n, batch_size, seed
        self.epoch, self.pos = 0, 0
        self.order = np.random.default_rng([seed, 0]).permutation(n)

    def next(self) -> np.ndarray:
        idx = []
        while len(idx) < self.batch_size:
            if self.pos == self.n:
                self.epoch += 1
                self.pos = 0
                self.order = np.random.default_rng([self.seed, self.epoch]).permutation(self.n)
            take = min(self.batch_size - len(idx), self.n - self.pos)
            idx.extend(self.order[self.pos : self.pos + take])
            self.pos += take
        return np.asarray(idx)

    def position(self) -> dict[str, int]:
        """Where the batches are: enough to draw the same next batch after a restart."""
        return {"n": self.n, "batch_size": self.batch_size, "seed": self.seed, "epoch": self.epoch, "pos": self.pos}

    def seek(self, position: dict[str, int]) -> None:
        """Continue from a saved `position` (of a sampler over the same blocks, batch size and seed)."""
        mine = {k: v for k, v in self.position().items() if k in ("n", "batch_size", "seed")}
        theirs = {k: position.get(k) for k in mine}
        if mine != theirs:
            raise YetoError(f"the saved batch position is for another sampler ({theirs}, here {mine}): pass --fresh "
                            "to start over")
        self.epoch, self.pos = int(position["epoch"]), int(position["pos"])
        self.order = np.random.default_rng([self.seed, self.epoch]).permutation(self.n)
