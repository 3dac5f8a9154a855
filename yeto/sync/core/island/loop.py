"""What an island core and its training loop say to each other: the task to do next (`Wait`, `Train`, `Done`), the
verdict after each inner step (`StepVerdict`), and what a finished round's training took (`RoundCounts`)."""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Any, Optional, Union

import numpy as np


@dataclass(frozen=True)
class Wait:
    pass


@dataclass(frozen=True)
class Train:
    round: int
    base_version: int
    adapter: np.ndarray  # the global adapter of base_version: load it, train, push local - it
    steps: int  # 0 in time-window rounds
    seconds: float


@dataclass(frozen=True)
class Done:
    reason: str
    complete: bool = False  # the syncer finished the run (not stopped early)
    error: bool = False  # refused, or gave up: the island exits non-zero
    code: str = ""  # why it was refused (a protocol.Code), if it was


Task = Union[Wait, Train, Done]


class StepVerdict(Enum):
    CONTINUE = "continue"
    PUSH = "push"  # the round's work is done: push it
    ABANDON = "abandon"  # the round closed without us (or our adapter is unusable): drop the work
    STOP = "stop"  # the run is over for this island
    # a time window is over, but our previous (late) delta holds this round's place in the syncer (one per island
    # per round): keep the work and carry it onto the next global, so the next push lands fresh
    CARRY = "carry"


@dataclass(frozen=True)
class RoundCounts:
    """What a round's training took, as its delta reports it (the merge weighs by these; the syncer checks them)."""

    tokens: int
    loss_tokens: int
    steps: int
    loss: float
    compute_s: float
    # of `steps`, those trained in an earlier round's window and carried onto this one (StepVerdict.CARRY): step
    # normalization leaves them out of the round's length
    carried_steps: int = 0
    # the island's latest score of a global on its --eval-task ({version, accuracy, n}), informational: the syncer
    # records it on the tape, never weighs by it
    task_eval: Optional[dict[str, Any]] = None

    def header(self) -> dict[str, Any]:
        h = {"tokens": self.tokens, "loss_tokens": self.loss_tokens, "inner_steps": self.steps, "loss": self.loss,
             "compute_s": round(self.compute_s, 4)}
        if self.carried_steps:
            h["carried_steps"] = self.carried_steps
        if self.task_eval is not None:
            h["task_eval"] = dict(self.task_eval)
        return h
