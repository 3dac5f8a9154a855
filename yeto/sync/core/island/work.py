"""The arithmetic of the work an island's training loop keeps from one round to the next, shared by the loops that
drive a `IslandCore` (the real one, `yeto.island.diloco`, and the simulator's island): the steps it holds toward a
round (`RoundSteps`), steps trained that go on top of the next global (`Carry`: a time window's work the core said
to carry, --overlap's steps while a merge is in flight, a pipelined island's steps ahead), and where each round's
training starts (`RoundStart`: on a carry, a streamed run's kept parts, --merge-alpha's blend)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Generic, Iterable, Optional, TypeVar

import numpy as np

from yeto.sync.core.policy import RoundPolicy
from yeto.sync.wire.layout import Layout


@dataclass
class RoundSteps:
    """The inner steps an island holds toward round `round`."""

    round: int
    steps: int = 0
    before: int = 0  # of `steps`, those taken before this round's training started (they do not pace its window)
    carried: int = 0  # of those, the steps trained for an earlier round's window and carried onto this one (CARRY):
    # step normalization leaves them out of the round's length

    @property
    def window_steps(self) -> int:
        """The steps taken since this round's training started: they pace its time window."""
        return self.steps - self.before


Steps = TypeVar("Steps", bound=RoundSteps)  # a loop's own record of its steps (its tokens and loss beside them)


@dataclass
class Carry(Generic[Steps]):
    """Steps already trained that go on top of the next global: θ ← g + (θ − since)."""

    count: Steps  # the steps kept
    since: Optional[np.ndarray]  # the adapter they were taken from: the push, or the round's base (None: steps ahead
    # of a streamed round, whose start keeps the island's adapter)
    place: Optional[int] = None  # the round whose work this is, carried because a late delta of ours held its place

    def onto(self, new_global: np.ndarray, here: np.ndarray) -> np.ndarray:
        """The adapter the next round starts from: the kept steps (`here` − `since`) on top of `new_global`."""
        assert self.since is not None
        return new_global + (here - self.since)

    def into(self, rnd: int) -> bool:
        """Count the kept steps toward round `rnd`: taken before its training started, and carried in if they were
        trained for another round's window (--overlap's and a pipeline's were trained for `rnd` itself). True: they go
        back to the round they were carried from (the late delta that held its place was refused)."""
        c = self.count
        back = c.round == rnd and self.place == rnd
        if c.round != rnd:
            c.carried = c.steps
        c.round, c.before = rnd, c.steps
        return back


class RoundStart:
    """Where each round's training starts, and what that needs kept from earlier rounds: the global the island last
    took, its last push (--merge-alpha), and in a streamed run the adapter at each fragment's latest push."""

    def __init__(self, layout: Layout):
        self.layout = layout
        self.held_global: Optional[np.ndarray] = None  # the global the island's adapter last took (None: no round yet)
        self.last_local: Optional[np.ndarray] = None  # the adapter this island last pushed (--merge-alpha blends it in)
        self.pushed_at: dict[int, np.ndarray] = {}  # fragment -> the adapter at its latest push (a streamed run)

    def start(self, new_global: np.ndarray, here: Callable[[], np.ndarray], carry: Optional[Carry],
              policy: RoundPolicy, given_back: Callable[[], Iterable[int]]) -> np.ndarray:
        """The adapter a round trained from `new_global` starts from (its delta is always taken against
        `new_global`): a streamed run (--fragments) keeps the island's adapter (`here()`) and takes only the parts
        that changed (`streamed`), every round; else the carried steps on top of the global, else the global blended
        with our last push under --merge-alpha < 1. `given_back()`: the fragments whose latest push never counted
        (the core's, taken only where used): their steps before that push are in no global, so they are kept."""
        if policy.fragments > 1 and self.held_global is not None:
            for f in given_back():
                self.pushed_at.pop(f, None)
            start = self.streamed(new_global, here())
        elif carry is not None:
            start = carry.onto(new_global, here())
        else:
            alpha = policy.merge_alpha
            start = new_global if self.last_local is None or alpha >= 1 else (
                alpha * new_global + (1 - alpha) * self.last_local).astype(np.float32)
        self.held_global = new_global.copy()
        return start

    def streamed(self, new_global: np.ndarray, here: np.ndarray) -> np.ndarray:
        """Streaming DiLoCo's start: the island's adapter is never reset, since each part keeps training between its
        syncs. A fragment the new global changed takes its new value with this island's steps since its own push of
        it on top, and every other step kept: θ_f ← g_f + (θ_f − ref_f), ref_f the adapter at our latest push of f
        (those steps are in g_f now) or, for a fragment we did not push since, the global we held (no step of ours is
        in it). A pipelined run has several pushes in flight: each fragment keeps its own until its global moves."""
        assert self.held_global is not None
        start = here.copy()
        for f in self.layout.fragments:
            span = slice(f.start, f.start + f.numel)
            if np.array_equal(new_global[span], self.held_global[span]):
                continue
            ref = self.pushed_at.pop(f.index, self.held_global)
            start[span] = new_global[span] + (here[span] - ref[span])
        return start

    def pushed(self, local: np.ndarray, fragments: Iterable[int], streamed: bool) -> None:
        """The island pushed `local` for a round that syncs `fragments`."""
        self.last_local = local
        if streamed:
            self.pushed_at.update((f, local) for f in fragments)

    def abandoned(self) -> None:
        """A round closed without us: the next starts from the new global alone."""
        self.last_local = None
