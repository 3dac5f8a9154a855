"""The round policy (`RoundPolicy`): what the syncer's welcome tells every island about the rounds, written by the
syncer (`SyncerConfig.round_policy()` builds one) and read back by the island, and the one answer to how many inner
steps a round asks of an island (`RoundPolicy.steps_for`): the island core's round start, its pipelined rounds, the
training loops' --overlap, steps ahead and carried windows, and the syncer's check of a delta's claim all ask it."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields
from typing import Any, Optional

# a limit on steps that is no limit: --overlap in time windows trains on until the merge comes (no island takes this
# many steps in a round)
NO_STEP_LIMIT = 10**9

_WIRE_TYPES = {"int": int, "float": float}  # how each field's wire value is read (by its annotation)


@dataclass(frozen=True)
class RoundPolicy:
    """What the syncer's welcome says every round asks (`SyncerConfig.policy()` writes it, in this field order). A key
    the syncer leaves out takes the field's one default (it sends every key: the defaults serve before its welcome,
    and tests): what an island assumed before, or the syncer's flag default where it assumed none or several. A key
    this version does not know is left out."""

    inner_steps: int = 50  # --inner-steps: a fixed-step round's length
    round_seconds: float = 0.0  # --round-seconds (> 0: time-window rounds, whose length is a time, not steps)
    outer_steps: int = 0  # --outer-steps: the run's rounds (a streamed run's last one syncs the whole adapter)
    sync_bits: int = 4  # the deltas' wire precision
    broadcast_bits: int = 4  # the broadcasts' (--broadcast-bits: --sync-bits unless set)
    quorum: int = 1
    heartbeat_s: float = math.inf  # ping at least this often (inf: as the island's own heartbeat says)
    max_base_lag: int = 0  # how many versions back a delta's base may be (0: only fresh deltas)
    merge_alpha: float = 1.0  # a round starts from alpha x the global + (1 - alpha) x the island's last push
    fragments: int = 1  # the parts the run streams its adapter in (1: the whole adapter every round)
    pipeline: int = 1  # deltas an island may have in flight (1: it waits for each merge)

    @classmethod
    def from_wire(cls, policy: dict[str, Any]) -> "RoundPolicy":
        """The policy a welcome carries (ValueError, TypeError: a value that is not a number; the core ignores that
        welcome as malformed)."""
        return cls(**{f.name: _WIRE_TYPES[str(f.type)](policy[f.name]) for f in fields(cls) if f.name in policy})

    def wire(self) -> dict[str, Any]:
        """The welcome's `policy`."""
        return asdict(self)

    @property
    def versions_kept(self) -> int:
        """How many versions back a delta's base may be: --max-base-lag, or a pipelined delta's distance."""
        return max(self.max_base_lag, self.pipeline - 1)

    @property
    def windowed(self) -> bool:
        """Time-window rounds (--round-seconds): a round lasts a time, and asks no number of steps."""
        return bool(self.round_seconds)

    def steps_for(self, max_inner_steps: int = 0) -> int:
        """The inner steps a round asks of an island whose own cap is `max_inner_steps` (its --max-inner-steps, 0:
        none): the run's --inner-steps, or the cap where lower; a time-window round asks only the cap (0: as many
        steps as its window holds)."""
        if self.windowed:
            return max_inner_steps
        return min(self.inner_steps, max_inner_steps) if max_inner_steps else self.inner_steps

    def train_on_limit(self, max_inner_steps: int = 0) -> int:
        """At most how many steps an island trains toward a round before that round's global comes (--overlap's
        steps while a merge is in flight, a pipelined island's steps ahead, a time window's work carried onto the
        next global): what a round asks of it (`steps_for`: a cap above --inner-steps trains no further, since the
        syncer refuses a delta claiming more than the round allows), else NO_STEP_LIMIT (a window: until it comes)."""
        return self.steps_for(max_inner_steps) or NO_STEP_LIMIT

    def schedule_horizon(self, step: int, pace: Optional[float], round_number: int) -> Optional[int]:
        """The step at which an island's LR schedule ends, asked at the start of round `round_number` with the island
        at `step`: the run's inner steps in all in fixed-step rounds; in time windows, the island's own pace (`pace`:
        its steps a round so far) over the rounds left, so that every island anneals with the run, however fast it is.
        Before its pace is known (its first round) a fresh island holds the peak LR (NO_STEP_LIMIT: no decay yet;
        --max-steps would put a GPU island at the floor within its first window) and a resumed one the horizon it
        saved (None: keep it)."""
        if not self.windowed:
            return self.outer_steps * self.inner_steps
        if pace is None:
            return NO_STEP_LIMIT if step == 0 else None
        return step + max(1, math.ceil(pace * max(1, self.outer_steps - round_number + 1)))
