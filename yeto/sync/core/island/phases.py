"""An island's phases: what its training loop holds of a round, and the one table of the moves between them.

    JOINING ──▶ WAITING ──▶ TRAINING ──▶ HOLDING ──▶ WAITING   a round trained, sent once the previous delta settled
                              │ │
                              │ └──▶ CARRYING ──▶ WAITING     a late delta of ours holds the round: the work goes on
                              │                               top of the next global, or back to its round
                              └──▶ WAITING                    abandoned (the round's base is gone), or stopped
    JOINING, WAITING, CARRYING ──▶ FINISHING ──▶ DONE         the syncer finished: fetch its final adapter first
                                   FINISHING ──▶ JOINING, WAITING   ... unless it was a stop, and a restarted
                                                                  syncer welcomes us into the run going on
    any phase but DONE ──▶ DONE                               refused, gave up, or finished

Each phase owns the data only it needs (`Training`, `Held`, `Place`, `Done`), so an island cannot train one round
while holding another's work or carrying a third. What is not a phase is said beside it in `IslandCore`: the link
(joined or not), the delta in the syncer's hands (`Pushed`, unsettled while the next round trains), and what the
island knows of the syncer (the open round, places held by an earlier process's delta). `Phases` holds the phase and
its data; every move goes through `Phases.enter`, which checks it against `TRANSITIONS`; the simulator checks every
island's moves again.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Callable, Optional, Union

import numpy as np

from yeto.sync.core.island.loop import Done, RoundCounts


class Phase(Enum):
    JOINING = "joining"  # no global adapter yet: connecting, saying hello, founding the run or fetching its state
    WAITING = "waiting"  # holds a global adapter and no round's work: waits for a round it may train
    TRAINING = "training"  # trains a round from the global adapter of the round's base version (data: Training)
    HOLDING = "holding"  # a round's work is done and waits for the previous delta to settle (data: Held)
    CARRYING = "carrying"  # a round's work goes on top of the next global (data: Place, the round it was trained for)
    FINISHING = "finishing"  # the syncer finished the run: fetching its final adapter before saying done
    DONE = "done"  # the run is over for this island (data: Done, what the training loop was told)


# the only moves an island makes (Phases.enter raises on any other; the simulator checks every island's)
TRANSITIONS: dict[Phase, frozenset[Phase]] = {
    Phase.JOINING: frozenset({Phase.WAITING, Phase.FINISHING, Phase.DONE}),
    Phase.WAITING: frozenset({Phase.TRAINING, Phase.FINISHING, Phase.DONE}),
    Phase.TRAINING: frozenset({Phase.HOLDING, Phase.CARRYING, Phase.WAITING, Phase.DONE}),
    Phase.HOLDING: frozenset({Phase.WAITING, Phase.DONE}),
    Phase.CARRYING: frozenset({Phase.WAITING, Phase.FINISHING, Phase.DONE}),
    Phase.FINISHING: frozenset({Phase.DONE, Phase.JOINING, Phase.WAITING}),
    Phase.DONE: frozenset(),
}


class IllegalTransition(AssertionError):
    """An internal error: the island core tried a move its phase table forbids (a bug in the core, never input)."""


def check_transition(old: Phase, new: Phase, event: str) -> None:
    if new not in TRANSITIONS[old]:
        allowed = ", ".join(sorted(p.value for p in TRANSITIONS[old])) or "none: it is final"
        raise IllegalTransition(f"island core: illegal phase transition {old.value} -> {new.value} on {event} "
                                f"(from {old.value} the table allows: {allowed})")


@dataclass(frozen=True)
class Place:
    """A round's place in the syncer (one delta per island per round): the round and the global it opened on."""

    round: int
    version: int
    digest: str = ""  # that global's, where it matters (a carry: a rollback may make its version another adapter)

    def matches(self, rnd: int, version: int) -> bool:
        return (self.round, self.version) == (rnd, version)


@dataclass
class Training:
    round: int
    base_version: int
    base: np.ndarray
    started_at: float
    steps: int
    seconds: float  # time windows: what is left of the round's window when training starts (0: one step)
    base_digest: str = ""
    windowed: bool = False  # a time-window round
    place_taken: bool = False  # our previous delta, late, holds (or will hold) this round's place in the syncer


@dataclass
class Held:
    """A finished round's work waiting for the previous delta to settle (raw: quantized once it goes)."""

    training: Training
    local: np.ndarray = field(repr=False)
    counts: RoundCounts


PhaseData = Union[None, Training, Held, Place, Done]
# the data each phase holds (None: none); Phases.enter checks it too
DATA: dict[Phase, type] = {Phase.JOINING: type(None), Phase.WAITING: type(None), Phase.TRAINING: Training,
                           Phase.HOLDING: Held, Phase.CARRYING: Place, Phase.FINISHING: type(None), Phase.DONE: Done}


class Phases:
    """An island's phase and the data only it holds, changed by `enter` alone (the core hands this object to each part
    that moves the phase, so no part sets a phase the table does not allow)."""

    def __init__(self) -> None:
        self._phase = Phase.JOINING
        self._data: PhaseData = None
        self.on_move: Optional[Callable[[Phase, Phase, str], None]] = None  # told every move (the simulator's oracle)

    def enter(self, phase: Phase, event: str, data: PhaseData = None) -> None:
        """The one way an island changes phase: the move must be in the table (`TRANSITIONS`), and the new phase gets
        its own data, dropping the old phase's."""
        old = self._phase
        check_transition(old, phase, event)
        assert isinstance(data, DATA[phase]), f"island core: {phase.value} holds {DATA[phase].__name__}, not {data!r}"
        self._phase, self._data = phase, data
        if self.on_move is not None:
            self.on_move(old, phase, event)

    @property
    def phase(self) -> Phase:
        """Read only: `enter` is the one way to change it."""
        return self._phase

    @property
    def training(self) -> Optional[Training]:
        """The round being trained, while training."""
        return self._data if isinstance(self._data, Training) else None

    @property
    def held(self) -> Optional[Held]:
        """A finished round's work waiting for the previous delta to settle, while holding."""
        return self._data if isinstance(self._data, Held) else None

    @property
    def carried(self) -> Optional[Place]:
        """The round whose work the training loop carries onto the next global, while carrying."""
        return self._data if isinstance(self._data, Place) else None

    @property
    def done(self) -> Optional[Done]:
        """What the training loop was told when the run ended for this island, once done."""
        return self._data if isinstance(self._data, Done) else None
