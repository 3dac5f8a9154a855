"""The syncer's open round: its phases, and when it closes, as a pure function of the round, its members and the clock.

A round is OPEN until quorum is in, then in GRACE (waiting for members predicted to push soon), then MERGING (the
merge transaction) and COMMITTED; a run that ends with the round open ABANDONS it, and a merge whose refusals take the
round back below quorum reopens it. `ROUND_TRANSITIONS` is that list, written once; `OpenRound.advance` checks every
step against it and raises `RoundPhaseError` on any other (a bug in the core, never a peer's doing: it stops the
syncer, whose restart resumes from the tape, rather than merging from a state the design does not have).

`close_decision` says what the round does now: close, wait until a time (and for whom), wait for quorum, or give up
once --quorum-timeout passed short of it. It reads only what it is given, so its rules are tested from a table of
cases (tests/test_rounds.py) and the core applies its answer.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from enum import Enum
from typing import TYPE_CHECKING, Any, Optional


if TYPE_CHECKING:
    from yeto.sync.core.config import SyncerConfig

WINDOW_GRACE_CAP_S = 30.0  # a time-window round waits at most this long past its window (or --straggler-timeout)
GRACE_ROUND_SHARE = 0.05  # the grace is at most this share of the time the round took to reach quorum (>= 95% busy)
GRACE_SLACK = 1.02  # a predicted push: its observed round time (a running estimate) times this ...
GRACE_SLACK_S = 0.25  # ... plus this (upload, jitter), after its start
# a time window ends at the step boundary nearest its end: stop once the next step (at this window's mean pace)
# would overrun the end by more than the time left. Islands' pushes then centre on the window's end instead of
# trailing it by up to a step, so a fast island is not the last in, missing a round a slow one's push closed
WINDOW_NEAREST_BOUNDARY = 0.5


class RoundPhase(Enum):
    OPEN = "open"  # deltas come in; short of quorum
    GRACE = "grace"  # quorum is in: waiting for members predicted to push by the grace's end
    MERGING = "merging"  # the merge transaction runs (a delta that breaks it is refused and the merge retried)
    COMMITTED = "committed"  # merged: the next version is checkpointed and broadcast
    ABANDONED = "abandoned"  # the run finished (or gave up) with the round open


ROUND_TRANSITIONS: dict[RoundPhase, frozenset[RoundPhase]] = {
    RoundPhase.OPEN: frozenset({RoundPhase.GRACE, RoundPhase.ABANDONED}),
    RoundPhase.GRACE: frozenset({RoundPhase.MERGING, RoundPhase.ABANDONED}),
    # refusals took the round back below quorum: it stays open
    RoundPhase.MERGING: frozenset({RoundPhase.COMMITTED, RoundPhase.OPEN}),
    RoundPhase.COMMITTED: frozenset(),
    RoundPhase.ABANDONED: frozenset(),
}


class RoundPhaseError(Exception):
    """A round asked to make a transition `ROUND_TRANSITIONS` does not allow: a bug in the syncer's core."""


@dataclass
class OpenRound:
    number: int
    base_version: int
    opened_at: float
    quorum_at: Optional[float] = None
    fresh_at: Optional[float] = None  # when quorum was met by fresh deltas alone (the grace counts from here)
    last_wait_log: float = -math.inf
    ends_at: float = math.inf  # a time-window round's window end: every member's window ends here
    phase: RoundPhase = field(default=RoundPhase.OPEN)

    def advance(self, to: RoundPhase) -> None:
        """Move to phase `to`, if the table allows it from the phase the round is in."""
        allowed = ROUND_TRANSITIONS[self.phase]
        if to not in allowed:
            names = ", ".join(sorted(p.name for p in allowed)) or "none: it is over"
            raise RoundPhaseError(f"internal error: round {self.number} cannot go from {self.phase.name} to "
                                  f"{to.name} (allowed from {self.phase.name}: {names})")
        self.phase = to

    def enter(self, phase: RoundPhase) -> None:
        """Be in `phase`: a transition unless the round is in it already."""
        if self.phase is not phase:
            self.advance(phase)


@dataclass(frozen=True)
class Pace:
    """What the grace predicts a member's next push from."""

    since: float  # when it (last) started training: the round's open, or the ack of its delta
    round_s: Optional[float] = None  # its observed compute time per round (running estimate)
    step_s: Optional[float] = None  # ... and per inner step (time windows)


@dataclass(frozen=True)
class RoundMembers:
    """Who the round has and whom it expects."""

    responders: tuple[int, ...]  # island ids whose delta is in
    fresh: int  # how many of the counting deltas were trained from the round's base (not stale)
    waiting: dict[int, Pace] = field(default_factory=dict)  # live members still training, by island id (sorted)
    absent: tuple[int, ...] = ()  # members known before a restart, not back yet (expected for a --island-timeout)
    counting: Optional[int] = None  # how many responders count toward quorum (None: all; an extra id never does)

    @property
    def expected(self) -> tuple[int, ...]:
        return tuple(self.waiting) + self.absent

    @property
    def quorum_count(self) -> int:
        return len(self.responders) if self.counting is None else self.counting


def round_header(cfg: SyncerConfig, r: OpenRound, now: float) -> dict[str, Any]:
    """What an island trains the open round by. A time-window round's window is the round's, not the island's:
    `seconds_left` (relative, so no clocks need agree) ends every member's window together, however late it
    started (an island whose stale delta was just acked trains what is left), so deltas land fresh together
    instead of each island's window drifting with its own start."""
    header = {"round": r.number, "version": r.base_version, "inner_steps": cfg.inner_steps,
              "round_seconds": cfg.round_seconds}
    if cfg.round_seconds:
        header["seconds_left"] = round(max(0.0, r.ends_at - now), 3)
    return header


@dataclass(frozen=True)
class ClosePolicy:
    """The syncer's settings that time a round (from `SyncerConfig`, with the quorum in force)."""

    quorum: int
    grace_cap_s: float  # --grace, at most --straggler-timeout
    straggler_timeout: float
    quorum_timeout: float
    round_seconds: float = 0.0  # > 0: time-window rounds
    merge_s: float = 0.0  # how long merges take (measured by the shell): the grace leaves room for it


class Verdict(Enum):
    CLOSE = "close"  # merge now
    GRACE = "grace"  # quorum is in: wait until `Decision.until` for `Decision.waiting_for`
    SHORT = "short"  # short of quorum: wait for deltas
    QUORUM_TIMEOUT = "quorum_timeout"  # short of quorum past --quorum-timeout: the run gives up


@dataclass(frozen=True)
class Decision:
    verdict: Verdict
    waiting_for: tuple[int, ...]  # the expected members still out (CLOSE: the stragglers it leaves behind)
    until: float = math.inf  # GRACE: when the round closes unless they all push first
    quorum_at: Optional[float] = None  # the round's marks, for the core to keep: when quorum was met ...
    fresh_at: Optional[float] = None  # ... and when it was met by fresh deltas alone


def close_decision(r: OpenRound, members: RoundMembers, now: float, policy: ClosePolicy) -> Decision:
    """What round `r` does at `now`. Quorum counts the expected ids' deltas (an extra id on the shared key, however
    fast, never closes a round or starts its grace). With quorum in it closes once nobody else is expected, or once
    the grace is over (`grace_until`), or a time-window round once its window plus WINDOW_GRACE_CAP_S passed. A round
    whose quorum holds stale deltas is paced by the members still training: it waits up to --straggler-timeout after
    quorum instead of the grace (and, in time windows, at least until they are predicted to push)."""
    expected = members.expected
    if members.quorum_count < policy.quorum:
        timed_out = now - r.opened_at > policy.quorum_timeout
        return Decision(Verdict.QUORUM_TIMEOUT if timed_out else Verdict.SHORT, expected,
                        quorum_at=r.quorum_at, fresh_at=r.fresh_at)
    quorum_at = now if r.quorum_at is None else r.quorum_at
    fresh_at = r.fresh_at
    window_over = policy.round_seconds > 0 and now - r.opened_at > policy.round_seconds + min(
        WINDOW_GRACE_CAP_S, policy.straggler_timeout)
    if members.fresh < policy.quorum:  # stale deltas made the quorum: the round is paced by those still training
        until = quorum_at + policy.straggler_timeout
        if math.isfinite(r.ends_at) and members.waiting:  # ... who train until the window's end
            start = fresh_at if fresh_at is not None else quorum_at
            until = max(until, grace_until(r, start, members, policy))
    else:
        fresh_at = now if fresh_at is None else fresh_at
        until = grace_until(r, fresh_at, members, policy)
    close = not expected or now >= until or window_over
    return Decision(Verdict.CLOSE if close else Verdict.GRACE, expected, until, quorum_at, fresh_at)


def grace_until(r: OpenRound, start: float, members: RoundMembers, policy: ClosePolicy) -> float:
    """When a round whose quorum came in at `start` stops waiting: at the latest predicted push among the expected
    members predicted within the cap (--grace and GRACE_ROUND_SHARE of the time the round took to reach quorum, less
    the merge time), so an island far behind never holds the others (they stay >= 95% busy) and one about to push is
    not left out (a prediction padded for jitter past the cap is cut at the cap, not dropped). A member not measured
    yet, or overdue (its pace changed), or absent since a restart, is waited for up to --grace. A time-window round
    does not close before its window ends (the members train until then) and predicts each member at the window's
    end, or one step after its start if it started later, padded by the half step a push may trail the window by; a
    member whose half step fits the share is waited for until then, up to the cap (`trails_within`)."""
    if math.isfinite(r.ends_at) and members.expected:
        start = max(start, r.ends_at)  # quorum came before the window's end: the others train until then
    cap = policy.grace_cap_s - policy.merge_s
    whole_cap = start + max(0.0, cap)
    share = GRACE_ROUND_SHARE * (start - r.opened_at)
    deadline = start + max(0.0, min(cap, share - policy.merge_s))
    until = whole_cap if members.absent else start
    for pace in members.waiting.values():
        push = predicted_push(r, pace)
        if push is None or push.padded < start:  # not measured yet, or overdue
            until = max(until, whole_cap)
        elif push.due <= deadline:  # (the padding never leaves out one due within the deadline: it is cut there)
            on_its_boundary = math.isfinite(r.ends_at) and trails_within(pace, share)
            until = max(until, min(whole_cap if on_its_boundary else deadline, push.padded))
    return until


def trails_within(pace: Pace, share: float) -> bool:
    """Whether a member of a time-window round stops within `share` of the window's end: it stops at the step boundary
    nearest the end, so its push trails the end by at most half a step (and the upload). Such a member is waited for
    until its padded push (up to the cap), not cut at the share less the merge time: the others then idle at most the
    share plus GRACE_SLACK_S, and a fast island whose window holds ten-odd steps is not left a version stale by a
    fraction of a second (with the share cut it missed a round by 0.1 s in 2 of 3 seeds, docs/benchmarks.md)."""
    return pace.step_s is not None and WINDOW_NEAREST_BOUNDARY * pace.step_s <= share


@dataclass(frozen=True)
class Push:
    due: float  # when a member is predicted to push
    padded: float  # ... padded for jitter and upload


def predicted_push(r: OpenRound, pace: Pace) -> Optional[Push]:
    """When a member of round `r` is predicted to push, or None where its pace is not measured yet."""
    if math.isfinite(r.ends_at):
        if pace.step_s is None:  # its pace unknown: it pushes at the window's end, or at most the cap after
            return Push(r.ends_at, math.inf)
        due = max(r.ends_at, pace.since + pace.step_s)
        return Push(due, due + WINDOW_NEAREST_BOUNDARY * pace.step_s + GRACE_SLACK_S)
    if pace.round_s is None:
        return None
    return Push(pace.since + pace.round_s, pace.since + GRACE_SLACK * pace.round_s + GRACE_SLACK_S)
