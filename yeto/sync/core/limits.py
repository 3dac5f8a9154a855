"""Per-key rate limits with an injected clock: what one peer may cost the syncer per time window."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Hashable


@dataclass
class RateLimit:
    """At most `per_window` events per key in each `window_s`; the rest are counted, not served.

    Fixed windows (not a token bucket): simple to reason about in the simulator, and the bound is what matters.
    At most `max_keys` keys are tracked; when more appear the oldest windows are forgotten (their keys start fresh,
    which only ever lets through `per_window` more events)."""

    per_window: int
    window_s: float
    max_keys: int = 4096
    windows: dict[Hashable, list] = field(default_factory=dict)  # key -> [window start, used, refused]
    expired_refusals: dict[Hashable, int] = field(default_factory=dict)  # refused in a key's window that just ended

    def allow(self, key: Hashable, now: float) -> bool:
        w = self.windows.get(key)
        if w is not None and now - w[0] >= self.window_s and w[2]:
            self.expired_refusals[key] = w[2]  # (the caller pops it, e.g. to put the count on the tape)
        if w is None or now - w[0] >= self.window_s:
            if w is None and len(self.windows) >= self.max_keys:
                for k in sorted(self.windows, key=lambda k: self.windows[k][0])[: self.max_keys // 2]:
                    del self.windows[k]
            w = self.windows[key] = [now, 0, 0]
        if w[1] < self.per_window:
            w[1] += 1
            return True
        w[2] += 1
        return False
