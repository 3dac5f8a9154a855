"""When the syncer's round closes, from a table of cases; the round's phases and their asserted transitions.

`close_decision` is a pure function of the round, its members and the clock: each row below gives those and what the
round must do (close now, wait until a time and for whom, wait for quorum, give the run up). The phase table is
checked on every transition, and the simulator runs the real core: a planted bad transition is caught there.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Optional

import pytest

from yeto.sync import sim
from yeto.sync.core import rounds
from yeto.sync.core.merging import Merging
from yeto.sync.core.rounds import (GRACE_SLACK, GRACE_SLACK_S, ClosePolicy, OpenRound, Pace, RoundMembers, RoundPhase,
                                   RoundPhaseError, Verdict, close_decision)

# quorum 2, --grace 2 s, in a round that took 110 s to reach quorum (5% of it: 5.5 s, so the 2 s cap binds)
POLICY = ClosePolicy(quorum=2, grace_cap_s=2.0, straggler_timeout=100.0, quorum_timeout=1800.0)
NOW = 10.0
# a time-window round: 20 s windows opened at 0, --grace 5 s (5% of the 20 s round: 1 s binds)
WINDOW = dict(round_seconds=20.0, grace_cap_s=5.0)


@dataclass
class Case:
    responders: tuple[int, ...]
    waiting: dict[int, Pace]
    verdict: Verdict
    until: float = math.inf
    waiting_for: Optional[tuple[int, ...]] = None  # None: the waiting members, then the absent ones
    fresh: Optional[int] = None  # None: every responder trained from the round's base
    absent: tuple[int, ...] = ()
    now: float = NOW
    opened_at: float = -100.0
    quorum_at: Optional[float] = None  # when quorum came (the grace counts from here when the quorum is fresh)
    ends_at: float = math.inf
    policy: dict = field(default_factory=dict)  # changes to POLICY
    counting: Optional[int] = None  # responders that count toward quorum (None: all; extra ids do not)


CASES = {
    "quorum not met: wait for deltas": Case((1,), {2: Pace(0.0, 8.0)}, Verdict.SHORT),
    "quorum not met, nobody else expected: still wait": Case((1,), {}, Verdict.SHORT),
    "quorum not met at --quorum-timeout exactly: wait": Case((1,), {}, Verdict.SHORT, opened_at=NOW - 1800.0),
    "quorum not met past --quorum-timeout: give up": Case((1,), {2: Pace(0.0)}, Verdict.QUORUM_TIMEOUT,
                                                          opened_at=NOW - 1800.5),
    "quorum met and nobody else expected: close at once": Case((1, 2), {}, Verdict.CLOSE, until=NOW),
    "an extra id's delta is no quorum, however fast: wait for the expected": Case(
        (1, 9), {2: Pace(0.0, 8.0)}, Verdict.SHORT, fresh=1, counting=1),
    "quorum met, one not measured yet: the whole cap": Case((1, 2), {3: Pace(0.0)}, Verdict.GRACE, until=NOW + 2.0),
    "quorum met, one not measured yet, the cap is over: close without it": Case(
        (1, 2), {3: Pace(0.0)}, Verdict.CLOSE, until=NOW, quorum_at=NOW - 2.0),
    "a predicted island within the grace: wait for its padded push": Case(
        (1, 2), {3: Pace(2.0, 8.0)}, Verdict.GRACE, until=2.0 + GRACE_SLACK * 8.0 + GRACE_SLACK_S),
    "an island predicted beyond the cap: close without it": Case((1, 2), {3: Pace(0.0, 60.0)}, Verdict.CLOSE,
                                                                 until=NOW),
    "an island due within the cap, its padding past it: cut at the cap": Case((1, 2), {3: Pace(2.0, 9.9)},
                                                                               Verdict.GRACE, until=NOW + 2.0),
    "the latest of two predicted islands within the grace": Case(
        (1, 2), {3: Pace(2.0, 8.0), 4: Pace(3.0, 7.0)}, Verdict.GRACE, until=2.0 + GRACE_SLACK * 8.0 + GRACE_SLACK_S),
    "an overdue island (its pace changed): the whole cap, not zero": Case((1, 2), {3: Pace(0.0, 1.0)}, Verdict.GRACE,
                                                                           until=NOW + 2.0),
    "the grace capped by GRACE_ROUND_SHARE of a 10 s round": Case((1, 2), {3: Pace(2.0, 8.4)}, Verdict.GRACE,
                                                                   until=NOW + 0.5, opened_at=0.0),
    "due past GRACE_ROUND_SHARE of a 10 s round: close without it": Case((1, 2), {3: Pace(2.0, 9.0)}, Verdict.CLOSE,
                                                                          until=NOW, opened_at=0.0),
    "the merge time comes off the cap": Case((1, 2), {3: Pace(0.0)}, Verdict.GRACE, until=NOW + 1.5,
                                             policy={"merge_s": 0.5}),
    "--grace 0: close as soon as quorum is in": Case((1, 2), {3: Pace(2.0, 8.0)}, Verdict.CLOSE, until=NOW,
                                                     policy={"grace_cap_s": 0.0}),
    "a member absent since a restart: the whole cap": Case((1, 2), {}, Verdict.GRACE, until=NOW + 2.0, absent=(7,)),
    "stragglers past the cap are named, the waiting then the absent": Case(
        (1, 2), {4: Pace(0.0), 3: Pace(0.0)}, Verdict.CLOSE, until=NOW - 3.0, absent=(0,), waiting_for=(4, 3, 0),
        quorum_at=NOW - 5.0),
    "quorum held by stale deltas: paced by --straggler-timeout, not the grace": Case(
        (1, 2), {3: Pace(2.0, 8.0)}, Verdict.GRACE, until=NOW + 100.0, fresh=1),
    "quorum held by stale deltas, nobody else expected: close": Case((1, 2), {}, Verdict.CLOSE, until=NOW + 100.0,
                                                                     fresh=1),
    "quorum held by stale deltas, --straggler-timeout over: close": Case(
        (1, 2), {3: Pace(2.0, 8.0)}, Verdict.CLOSE, until=NOW, fresh=1, quorum_at=NOW - 100.0),
    "time window: quorum before the window's end waits for it (pace unknown: then up to the cap)": Case(
        (1, 2), {3: Pace(0.0)}, Verdict.GRACE, until=21.0, opened_at=0.0, ends_at=20.0, now=12.0, policy=WINDOW),
    "time window: a measured member, at the window's end plus half a step": Case(
        (1, 2), {3: Pace(0.0, step_s=1.0)}, Verdict.GRACE, until=20.0 + 0.5 + GRACE_SLACK_S, opened_at=0.0,
        ends_at=20.0, now=12.0, policy=WINDOW),
    "time window: one step that ends past the cap: close at the window's end": Case(
        (1, 2), {3: Pace(15.0, step_s=10.0)}, Verdict.GRACE, until=20.0, opened_at=0.0, ends_at=20.0, now=12.0,
        policy=WINDOW),
    "time window: everyone in: close at once, before the window's end": Case(
        (1, 2), {}, Verdict.CLOSE, until=12.0, opened_at=0.0, ends_at=20.0, now=12.0, policy=WINDOW),
    "time window, stale quorum: at least until the others are predicted": Case(
        (1, 2), {3: Pace(0.0)}, Verdict.GRACE, until=21.0, fresh=1, opened_at=0.0, ends_at=20.0, now=16.0,
        quorum_at=12.0, policy={**WINDOW, "straggler_timeout": 3.0}),
    "time window over by its cap: close whoever is still expected": Case(
        (1, 2), {3: Pace(2.0, step_s=1.0)}, Verdict.CLOSE, until=112.0, fresh=1, opened_at=0.0, ends_at=20.0,
        now=50.5, quorum_at=12.0, policy=WINDOW),
    "time window not over by its cap yet: wait": Case(
        (1, 2), {3: Pace(2.0, step_s=1.0)}, Verdict.GRACE, until=112.0, fresh=1, opened_at=0.0, ends_at=20.0,
        now=49.5, quorum_at=12.0, policy=WINDOW),
}


@pytest.mark.parametrize("name", list(CASES))
def test_when_a_round_closes(name):
    c = CASES[name]
    policy = dataclasses.replace(POLICY, **c.policy)
    fresh = len(c.responders) if c.fresh is None else c.fresh
    fresh_quorum = fresh >= policy.quorum
    r = OpenRound(number=5, base_version=4, opened_at=c.opened_at, quorum_at=c.quorum_at,
                  fresh_at=c.quorum_at if fresh_quorum else None, ends_at=c.ends_at)
    d = close_decision(r, RoundMembers(c.responders, fresh, c.waiting, c.absent, c.counting), c.now, policy)
    assert d.verdict is c.verdict, d
    assert d.until == pytest.approx(c.until) if math.isfinite(c.until) else d.until == c.until, d
    assert d.waiting_for == (tuple(c.waiting) + c.absent if c.waiting_for is None else c.waiting_for), d
    if c.verdict in (Verdict.SHORT, Verdict.QUORUM_TIMEOUT):  # short of quorum: no mark set
        assert (d.quorum_at, d.fresh_at) == (r.quorum_at, r.fresh_at), d
    else:  # quorum in: marked once (the first time), the fresh mark only when fresh deltas alone make it
        marked = c.now if c.quorum_at is None else c.quorum_at
        assert (d.quorum_at, d.fresh_at) == (marked, marked if fresh_quorum else None), d


def test_the_decision_does_not_change_the_round():
    r = OpenRound(number=1, base_version=0, opened_at=0.0)
    before = dataclasses.replace(r)
    close_decision(r, RoundMembers((1, 2), 2, {3: Pace(0.0)}), NOW, POLICY)
    assert r == before


# ---------------------------------------------------------------------------------------------- phases


def test_a_round_goes_open_grace_merging_committed_and_any_other_step_is_an_internal_error():
    r = OpenRound(number=3, base_version=2, opened_at=0.0)
    for to in (RoundPhase.GRACE, RoundPhase.MERGING, RoundPhase.OPEN, RoundPhase.GRACE, RoundPhase.MERGING,
               RoundPhase.COMMITTED):
        r.advance(to)
    assert r.phase is RoundPhase.COMMITTED
    with pytest.raises(RoundPhaseError, match=r"round 3 cannot go from COMMITTED to OPEN \(allowed from COMMITTED: "
                                              r"none: it is over\)"):
        r.advance(RoundPhase.OPEN)
    fresh = OpenRound(number=4, base_version=3, opened_at=0.0)
    with pytest.raises(RoundPhaseError, match=r"round 4 cannot go from OPEN to COMMITTED \(allowed from OPEN: "
                                              r"ABANDONED, GRACE\)"):
        fresh.advance(RoundPhase.COMMITTED)
    assert fresh.phase is RoundPhase.OPEN  # (refused: unchanged)


def test_every_phase_is_in_the_table_and_every_phase_but_open_is_reached():
    assert set(rounds.ROUND_TRANSITIONS) == set(RoundPhase)
    reached = set().union(*rounds.ROUND_TRANSITIONS.values())
    assert reached == set(RoundPhase)  # (OPEN again when refusals take a merging round below quorum)


SIM_SEEDS = 20  # a planted bad transition is caught within these schedules (the first merge hits it)


def _first_failure() -> Optional[sim.Outcome]:
    for seed in range(SIM_SEEDS):
        out = sim.run_seed(seed)
        if not out.ok:
            return out
    return None


def test_the_simulator_catches_a_round_committed_without_merging(monkeypatch):
    """A call site that skips the merge transaction's phase (GRACE -> COMMITTED) stops the run in the simulator."""
    commit = Merging._commit

    def commit_skipping_the_merge(self, r, *a):
        r.phase = RoundPhase.GRACE  # as if the round were committed straight from its grace
        return commit(self, r, *a)

    monkeypatch.setattr(Merging, "_commit", commit_skipping_the_merge)
    out = _first_failure()
    assert out is not None and "cannot go from GRACE to COMMITTED" in out.error, out
    assert out.error.startswith("the syncer recorded an internal error"), out  # halted and recorded, not a crash


def test_the_simulator_checks_the_transition_table(monkeypatch):
    """The table is the one the core checks: without GRACE -> MERGING, no round can merge."""
    monkeypatch.setitem(rounds.ROUND_TRANSITIONS, RoundPhase.GRACE, frozenset({RoundPhase.ABANDONED}))
    out = _first_failure()
    assert out is not None and "cannot go from GRACE to MERGING" in out.error, out
