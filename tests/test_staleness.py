"""Rounds that never wait on the slowest island: a real syncer on loopback and real island loops (numpy islands).

A fast island and one whose single step outlasts the round's window train in time-window rounds with quorum 1. The
syncer closes a round once the fast delta is in and the slow one is not predicted within the grace cap; the slow
island's delta, trained from a version the global has since left, is merged where it arrives (its lag on the tape),
never dropped; the round it trains meanwhile is carried onto the next global rather than sent a version late too.
"""

import numpy as np

from tests.peers import QuadraticIsland, island_thread, tape_with
from yeto.sync.core.island import WINDOW_NEAREST_BOUNDARY
from yeto.sync.core.rounds import GRACE_SLACK, GRACE_SLACK_S, OpenRound, Pace, RoundMembers, grace_until
from yeto.sync.core.state import Member
from yeto.sync.core.syncer import SyncerConfig, SyncerCore

GRACE_S = 0.3  # below the slow island's step: it is never waited for
ROUND_S = 0.6
FAST_STEP_S, SLOW_STEP_S = 0.03, 1.0  # the slow island's one step ends 0.4 s past the window: a version late


def test_a_slow_island_contributes_every_delta_and_the_fast_one_never_waits_past_the_cap(start_syncer, tmp_path):
    out = tmp_path / "syncer"
    s, port = start_syncer(out=out, islands=2, quorum=1, outer_steps=10, round_seconds=ROUND_S, grace_s=GRACE_S,
                           max_base_lag=4, straggler_timeout=30.0)
    results: dict = {}
    islands = [QuadraticIsland(1.0, 100), QuadraticIsland(-1.0, 100)]
    fast = island_thread(islands[0], port, 0, results, step_delay=FAST_STEP_S)
    slow = island_thread(islands[1], port, 1, results, step_delay=SLOW_STEP_S)
    fast.join(120)
    slow.join(120)
    assert not isinstance(results.get(0), Exception) and not isinstance(results.get(1), Exception), results
    tape = tape_with(out, "finish")
    merges = [e for e in tape if e["event"] == "merge"]
    assert len(merges) == 10
    # every delta the slow island sent was accepted and merged: none refused, none dropped as stale (one sent after
    # the last merge, when no round is open any more, is the end of the run, not a dropped delta)
    last = merges[-1]["round"]
    refused = [e for e in tape if e["event"] in ("reject", "refuse_delta") and e.get("island") == 1
               and e["seq"] < merges[-1]["seq"]]
    assert not refused, refused
    slow_deltas = [e for e in tape if e["event"] == "delta" and e["island"] == 1]
    merged = {d for m in merges for lid, d in zip(m["responders"], m["deltas"]) if lid == 1}
    assert slow_deltas and all(e["digest"] in merged for e in slow_deltas if e["round"] <= last)
    assert results[1]["abandoned_rounds"] == 0
    # the slow island contributed with lag on the tape, and its weight followed it
    assert any(e["lag"] > 0 for e in slow_deltas), [e["lag"] for e in slow_deltas]
    # a round trained while its late delta held the next round's place was carried onto the next global, not sent a
    # version late in turn (its window fits one 1 s step: a delta of more steps holds carried ones)
    assert results[1]["carried_rounds"] > 0 and max(e["inner_steps"] for e in slow_deltas) >= 2, slow_deltas
    for m in merges:
        assert len(m["lags"]) == len(m["responders"])
        # the fast island (quorum) never waited past the cap for the slow one
        assert m["grace_s"] is None or m["grace_s"] <= GRACE_S + 0.1, m
    assert results[0]["abandoned_rounds"] == 0
    # each island's LR schedule ends about where its own steps did (its pace over the rounds left), the slow island's
    # too: not at --max-steps of its own steps, which a 10x slower island never reaches
    for isl in islands:
        assert isl.horizons and abs(isl.horizons[-1] - isl.step_count) <= max(2, isl.step_count // 2), \
            (isl.horizons, isl.step_count)
    assert islands[1].horizons[-1] < islands[0].horizons[-1] / 4


def test_overlap_steps_are_the_rounds_own_not_carried_in(start_syncer, tmp_path):
    """--overlap trains the next round while a delta awaits its merge: those steps are taken for the round they go
    to, so a delta reports none carried in and step normalization takes its steps whole as the round's length (it
    took them out, shrinking every delta by window/inner). The slow island pushes first and overlaps a step."""
    out = tmp_path / "syncer"
    s, port = start_syncer(out=out, islands=2, quorum=2, outer_steps=4, round_seconds=ROUND_S)
    assert s.core.cfg.step_normalize
    results: dict = {}
    threads = [island_thread(QuadraticIsland(sign, 100), port, lid, results, step_delay=delay, overlap=True)
               for lid, (sign, delay) in enumerate([(1.0, FAST_STEP_S), (-1.0, 0.25)])]
    for t in threads:
        t.join(120)
    assert not any(isinstance(r, Exception) for r in results.values()), results
    tape = tape_with(out, "finish")
    deltas = [e for e in tape if e["event"] == "delta"]
    assert len([e for e in tape if e["event"] == "merge"]) == 4
    assert [e["round_steps"] for e in deltas] == [e["inner_steps"] for e in deltas], deltas


def _grace(core: SyncerCore, r: OpenRound, waiting: list[int]) -> float:
    """When round `r` (quorum in at r.quorum_at) stops waiting for these members of `core`, by the core's policy."""
    members = core.state.members
    paces = {lid: Pace(members[lid].since, members[lid].round_s, members[lid].step_s) for lid in waiting}
    return grace_until(r, r.quorum_at, RoundMembers((), 0, paces), core.driver._close_policy())


def test_the_grace_waits_for_an_island_predicted_within_the_cap_and_not_for_one_beyond():
    """The grace rule alone, with the clock in hand: after quorum the round waits until the latest predicted push
    among the members predicted within the cap, never longer than the cap, and not at all for one predicted later."""
    core = SyncerCore(SyncerConfig(islands=3, quorum=1, grace_s=2.0, straggler_timeout=100.0), "inc")
    r = OpenRound(number=5, base_version=4, opened_at=-100.0, quorum_at=10.0)  # 5% of 110 s: the 2 s cap binds
    members = core.state.members = {lid: Member(lid, "s", f"p{lid}", "test", last_seen=10.0) for lid in (1, 2)}
    members[1].round_s, members[1].since = 8.0, 2.0  # predicted at 2 + 1.02 x 8 + 0.25: within the cap
    members[2].round_s, members[2].since = 60.0, 0.0  # predicted at 72.25: beyond the cap (12.0)
    assert np.isclose(_grace(core, r, [1, 2]), 2.0 + GRACE_SLACK * 8.0 + GRACE_SLACK_S)
    assert _grace(core, r, [2]) == 10.0  # only a far one: close at once
    members[1].round_s = 9.9  # due at 11.9, within the cap; padded (12.35) past it: waited for, up to the cap
    assert _grace(core, r, [1, 2]) == 12.0
    members[1].round_s = None  # not measured yet: the whole cap
    assert _grace(core, r, [1, 2]) == 12.0
    core.observe_merge(1.0)  # merges take ~0.5 s (running estimate): the cap leaves room for them
    assert _grace(core, r, [1]) == 12.0 - core.state.merge_s
    members[1].round_s, members[1].since = 1.0, 0.0  # overdue: its pace changed; the cap, not zero
    assert _grace(core, r, [1]) == 12.0 - core.state.merge_s
    short = OpenRound(number=5, base_version=4, opened_at=0.0, quorum_at=10.0)  # a 10 s round: 0.5 s of grace
    members[1].round_s, members[1].since = 8.0, 2.0  # predicted at 10.41, beyond 10 + 0.5 share
    assert _grace(core, short, [1]) == 10.0  # - 0.5 merge: not waited for


def test_a_time_window_round_waits_for_its_window_and_predicts_each_member_at_its_end():
    """Every member's window ends with the round's: quorum in early does not close the round before the window ends
    (the others are training until then); after it, a member is predicted at the window's end, padded by the half
    step its push may trail it by, and waited for until then where that half step fits the share (5% of the round),
    else up to the share less the merge time; one that started so late that its single step ends past the cap is not
    waited for; with everyone in, the round closes at once."""
    core = SyncerCore(SyncerConfig(islands=2, quorum=1, grace_s=5.0, round_seconds=20.0,
                                   straggler_timeout=100.0), "inc")
    r = OpenRound(number=1, base_version=0, opened_at=0.0, quorum_at=12.0, ends_at=20.0)  # cap: 5% of 20 s = 1 s
    members = core.state.members = {1: Member(1, "s", "p1", "test", last_seen=12.0)}
    assert _grace(core, r, [1]) == 21.0  # its pace unknown: the window's end, then up to the cap
    members[1].step_s = 1.0  # 1 s steps: at most half a step past the end (+ slack)
    assert np.isclose(_grace(core, r, [1]), 20.0 + WINDOW_NEAREST_BOUNDARY * 1.0 + GRACE_SLACK_S)
    core.observe_merge(0.4)  # merges take time: the share's cut (1 s, less the merge) comes before a 1.8 s step's
    members[1].step_s = 1.8  # half-step trail, but that half step fits the share: waited for until its padded push
    assert np.isclose(_grace(core, r, [1]), 20.0 + WINDOW_NEAREST_BOUNDARY * 1.8 + GRACE_SLACK_S)
    assert _grace(core, r, [1]) > 21.0 - core.state.merge_s
    members[1].step_s = 10.0  # 10 s steps: its push may trail the end by 5 s; waited for up to the share's cut
    assert _grace(core, r, [1]) == 21.0 - core.state.merge_s
    core.state.merge_s = 0.0
    members[1].since = 15.0  # it started at 15 s (its stale delta was just acked): one step ends at 25 s
    assert _grace(core, r, [1]) == 20.0  # beyond the cap: the round closes at the window's end
    assert _grace(core, r, []) == 12.0  # everyone in: no waiting for the window
    late = OpenRound(number=1, base_version=0, opened_at=0.0, quorum_at=22.0, ends_at=20.0)
    members[1].step_s, members[1].since = 1.0, 0.0  # due by 20.75, quorum came at 22: overdue (its pace
    assert _grace(core, late, [1]) == 27.0  # changed?): --grace, as in any round

