"""A frozen simulated node (a laptop asleep, a VM paused): what reaches it waits for it to wake, in order."""

from __future__ import annotations

from typing import Any, Callable


class Sleep:
    """A frozen node's events, kept in the order they came until it wakes: a process asleep reads its sockets in
    order when it wakes, and a second freeze while asleep only makes the sleep longer. (Each event rescheduled for
    the wake on its own was reordered by a second freeze: those that came before it were put behind those that came
    during it, so an ack overtook the pongs sent before it: sim seed 414694317.)"""

    def __init__(self, world: Any):
        self.w = world
        self.until = 0.0
        self.held: list[Callable[[], None]] = []

    def freeze(self, dur: float) -> None:
        self.until = max(self.until, self.w.now + dur)

    def hold(self, fn: Callable[[], None]) -> bool:
        """Keep fn for the wake if the node is asleep (or events held for this wake are still to run); False: run
        it now."""
        if self.w.now >= self.until and not self.held:
            return False
        self.held.append(fn)
        if len(self.held) == 1:
            self.w.at(self.until, self._wake)
        return True

    def _wake(self) -> None:
        if self.w.now < self.until:  # frozen again meanwhile
            self.w.at(self.until, self._wake)
            return
        held, self.held = self.held, []
        for fn in held:
            fn()
