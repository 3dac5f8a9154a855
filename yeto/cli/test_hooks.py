"""Test hooks, in one place: the switches that fault tests and benchmarks use to make an island slow or to kill a
process at a chosen point. They work in every install and cost nothing unset; `--help` does not show them. They
enter at the entry points (`yeto train`, `yeto syncer`), which hand `crash_hook(...)` to the library's extension
points (`train(before_state_commit=)`, `Syncer(before_checkpoint=)`); no library module imports this one.

    yeto train --step-delay S              sleep S seconds after each inner step (a slow island)
    YETO_CRASH_AT=checkpoint:V             the syncer dies (SIGKILL) after merge V, before its checkpoint is durable
    YETO_CRASH_AT=train_state:N            an island dies (SIGKILL) inside the save of its step N's training state
"""

from __future__ import annotations

import functools
import os
import signal
from typing import Callable, Optional

HIDDEN_TRAIN_FLAGS = ("step_delay",)  # TrainConfig fields whose flags --help leaves out
CRASH_ENV = "YETO_CRASH_AT"  # "KIND:AT": die at that point
CHECKPOINT, TRAIN_STATE = "checkpoint", "train_state"  # the crash points


def crash_here(kind: str, at: int) -> None:
    """Kill this process (SIGKILL: no cleanup, as a power cut or the OOM killer) if YETO_CRASH_AT names this point."""
    if os.environ.get(CRASH_ENV, "") == f"{kind}:{at}":
        os.kill(os.getpid(), signal.SIGKILL)


def crash_hook(kind: str) -> Optional[Callable[[int], None]]:
    """`crash_here` for the point `kind` when YETO_CRASH_AT names that kind; None (no hook at all) otherwise."""
    return functools.partial(crash_here, kind) if os.environ.get(CRASH_ENV, "").startswith(f"{kind}:") else None
