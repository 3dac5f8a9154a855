"""Deterministic simulation: the real cores through seeded fault schedules, every invariant checked.

CI runs a few hundred schedules (YETO_SIM_SEEDS overrides; `make sim N=100000`
runs many more). The simulator itself must be able to fail: planted bugs, each a
mistake this design exists to prevent, are found within a bounded number of seeds.
"""

import dataclasses
import heapq
import os

import pytest

from yeto.sync import sim
from yeto.sync.core import actions
from yeto.sync.core import admission as sadmission
from yeto.sync.core import deltas as sdeltas
from yeto.sync.core import driver as sdriver
from yeto.sync.core.island import core as lcore
from yeto.sync.core.island import messages as lmessages
from yeto.sync.core.island import pipeline as lpipeline
from yeto.sync.core.island import phases as lphases
from yeto.sync.core import merging
from yeto.sync.core import state as sstate
from yeto.sync.core import syncer as score
from yeto.sync.merge.outer import nesterov_step
from yeto.sync.merge.rules import low_median

SEEDS = int(os.environ.get("YETO_SIM_SEEDS", "300"))
FRESH_SEEDS = int(os.environ.get("YETO_SIM_FRESH_SEEDS", "200"))  # from a random first seed each run (YETO_SIM_FIRST)
PLANTED_SEEDS = 400  # each planted bug must be found within this many schedules


def test_seeded_fault_schedules_keep_every_invariant():
    outcomes = [sim.run_seed(s) for s in range(SEEDS)]
    bad = [o for o in outcomes if not o.ok]
    assert not bad, "\n".join(f"seed {o.seed}: {o.error}\n  reproduce: python -m yeto.sync.sim --seed {o.seed} --trace"
                              for o in bad[:5])
    streamed = [o for o in outcomes if "streamed" in o.exercised]  # (--fragments: one part merged per round)
    assert len(streamed) >= SEEDS // 10 and any("resume" in o.exercised and "reject" in o.exercised for o in streamed)
    slow = [o for o in outcomes if "slow_link" in o.exercised]  # (an island's adapters take longer than its timeout)
    assert len(slow) >= SEEDS // 10 and any("resume" in o.exercised for o in slow)
    piped = [o for o in outcomes if "pipelined" in o.exercised]  # (--pipeline: a delta pushed ahead of its round)
    assert len(piped) >= SEEDS // 20 and any("resume" in o.exercised for o in piped)


def test_fresh_fault_schedules_keep_every_invariant():
    """Schedules no earlier run checked: the pinned range above only ever re-checks what already passed."""
    first = int(os.environ.get("YETO_SIM_FIRST") or sim.fresh_first_seed())
    bad = [o for o in (sim.run_seed(s) for s in range(first, first + FRESH_SEEDS)) if not o.ok]
    assert not bad, f"fresh seeds {first}..{first + FRESH_SEEDS - 1}:\n" + "\n".join(
        f"seed {o.seed}: {o.error}\n  reproduce: python -m yeto.sync.sim --seed {o.seed} --trace" for o in bad[:5])


def test_a_sweep_starts_from_a_fresh_seed_and_says_which(capsys):
    """`make sim` (python -m yeto.sync.sim --seeds N) draws its first seed anew each time and prints the range, so a
    failure reproduces; --first runs a given range again."""
    firsts = []
    for _ in range(2):
        assert sim.main(["--seeds", "2"]) == 0
        err = capsys.readouterr().err
        firsts.append(int(err.split("--first ")[1].split()[0]))
    assert firsts[0] != firsts[1] and all(f >= sim.runner.FRESH_SEEDS_FROM for f in firsts)
    assert sim.main(["--seeds", "2", "--first", str(firsts[0])]) == 0
    assert f"seeds {firsts[0]}..{firsts[0] + 1}" in capsys.readouterr().out


# seeds beyond the CI range that once broke an invariant (each note says what was fixed); they stay fixed
FOUND_SEEDS = {
    1892: "a restart forgot islands who joined after checkpoint 0, and exited while one was knocking",
    2347: "the simulator relaunched a zombie as a second process",
    16035: "a syncer killed inside a durable write may die 20 s late: the faults end later",
    19555: "the same, with a zombie that finished the run for its replacement",
    54072: "an island that lost the restarted syncer's welcome ignored its pongs and waited forever",
    5316: "a delta re-sent to a restarted syncer kept its old ack; a pong then made the island drop it",
    4: "behind a slow link, every control-connection drop sent the delta again: copies queued up the uplink",
    62: "a finished syncer stopped serving a slow reader still fetching the final adapter",
    4529: "no copy on its way and the round's announcement lost: the island waited for an answer forever",
    6386: "a finished run's slow reader gave up while its control connection flapped",
    1887: "a restart with more --outer-steps moved a streamed run's whole last round: its saved delta was lost",
    945: "a pipelined delta taken when its round opened closed that round inside the opening (nested rounds)",
    492: "an island whose open round's delta was lost waited on its pipelined ones, which waited on that round",
    3141721: "a founding upload refused (its island dropped meanwhile) with the error lost: the island took it for "
             "still on its way and ignored every request for it",
    414694317: "(the simulator) a frozen island frozen again read its connection out of order: a pong sent before "
               "an ack came after it and dropped a merged delta's residual",
    192934085: "an island relaunched by a fleet stop joined the stopping syncer, took its finish, then joined the "
               "relaunched one and still ended mid-run (its next relaunch found no syncer)",
    192937500: "a pipelined delta sent just before a reconnect was taken for still on its way: its round waited "
               "on it forever",
    903596133: "an island asleep past --island-timeout was dropped; waking, its delta came before its hello again "
               "and was refused not joined, the refusal and the new welcome lost: the round waited on it forever",
    903606582: "the same, in a fleet of three",
    506180938: "an island dropped while asleep sent its pipelined delta to the syncer that forgot it; the refusal "
               "(not joined) named no delta, and only the oldest was sent again: its round waited on the other",
    800680: "a delta that reached a restarted syncer just before its round reopened was refused stale, the refusal "
            "lost, and a late hello wiped the answer the pongs repeat: the round waited on it forever",
    733602164: "a kept delta taken when its round opened overwrote what the pongs said of a later copy (refused "
               "stale, the error lost): its island waited on that copy forever",
    913001457: "a founding upload lost with a killed syncer's connections was still counted as on its way: asked "
               "again (its copy to the restarted syncer refused), the island ignored every request; never founded",
}


PINNED_BEFORE_EXTRA_IDS = (4, 62, 492, 945, 1887, 1892, 2347, 4529, 5316, 6386, 16035, 19555, 54072, 800680, 3141721,
                           192934085, 192937500, 414694317, 903596133, 903606582, 506180938)


def test_the_seeds_pinned_before_extra_ids_keep_their_schedules():
    """Extra ids and step claims came after these seeds were found: they draw none, so each still replays what it
    was found on."""
    assert not [s for s in PINNED_BEFORE_EXTRA_IDS if sim.Schedule.draw(s).extra_ids]
    assert not [s for s in PINNED_BEFORE_EXTRA_IDS if (h := sim.Schedule.draw(s).hostile) and h.steps != 1]


@pytest.mark.parametrize("seed", sorted(FOUND_SEEDS))
def test_a_schedule_that_once_failed_now_passes(seed):
    out = sim.run_seed(seed)
    assert out.ok, f"seed {seed} ({FOUND_SEEDS[seed]}): {out.error}"


def test_a_run_that_does_not_finish_is_reported_with_where_each_node_stands():
    """The liveness report (what a violation says) reads the syncer's open round, held deltas and live islands
    mid-run, while a round is open."""
    import json

    w = sim.World(sim.Schedule.draw(11))
    w.setup()
    while w.queue and (w.syncer.core is None or w.syncer.core.state.round is None):
        t, _, fn = heapq.heappop(w.queue)
        w.now = max(w.now, t)
        fn()
    status = json.loads(w.status())
    assert status["syncer"]["round"] == w.syncer.core.state.round.number
    assert status["syncer"]["live"] and len(status["islands"]) == w.s.islands + w.s.extra_ids


def test_a_node_frozen_twice_reads_what_came_in_the_order_it_came():
    """A process asleep reads its sockets in order when it wakes; a second freeze only makes the sleep longer."""
    w = sim.World(sim.Schedule.draw(11))
    node, seen = w.islands[0], []
    node.pause(5.0)
    w.at(1.0, lambda: node.sleep.hold(lambda: seen.append("before")) or seen.append("early"))
    w.at(2.0, lambda: node.pause(10.0))  # (until t=12)
    w.at(6.0, lambda: node.sleep.hold(lambda: seen.append("during")) or seen.append("early"))
    w.at(13.0, lambda: node.sleep.hold(lambda: seen.append("after")) or seen.append("awake"))
    while w.queue and w.queue[0][0] <= 13.0:
        t, _, fn = heapq.heappop(w.queue)
        w.now = t
        fn()
    assert seen == ["before", "during", "awake"]


def test_a_schedule_replays_exactly_from_its_seed():
    runs = []
    for _ in range(2):
        lines: list[str] = []
        out = sim.run_seed(11, trace=lines.append)
        assert out.ok, out.error
        runs.append(lines)
    assert runs[0] == runs[1] and len(runs[0]) > 100


def _after_step_ignoring_new_versions(orig):
    def after_step(self, steps, now):  # keep training through a broadcast (the bug the issue reports) ...
        t = self.training
        if t is not None and t.base_version != self.version and self.finish is None and not self.run.need_state:
            return lcore.StepVerdict.PUSH if t.steps and steps >= t.steps else lcore.StepVerdict.CONTINUE
        return orig(self, steps, now)
    return after_step


def _push_against_newest(orig):
    def push(self, local, *a):  # ... and subtract the newer adapter
        t = self.training
        if t is not None and t.base_version != self.version:
            t.base, t.base_version = self.global_, self.version
        return orig(self, local, *a)
    return push


def _broadcast_before_checkpoint(orig):
    def commit(self, *a):
        out = self.outbox.actions
        n = len(out)
        orig(self, *a)
        new = out[n:]
        out[n:] = [x for x in new if not isinstance(x, actions.SaveCheckpoint)] + \
            [x for x in new if isinstance(x, actions.SaveCheckpoint)]
    return commit


def _no_duplicate_check(orig):
    def on_delta(self, peer, msg, now):
        self.state.pending.pop(msg.header["island"], None)
        return orig(self, peer, msg, now)
    return on_delta


def _quorum_minus_one(orig):
    def maybe_close(self, now):
        cfg = self.state.cfg
        q = cfg.quorum
        cfg.quorum = max(1, q - 1)
        try:
            orig(self, now)
        finally:
            cfg.quorum = q
    return maybe_close


def _forget_saved_deltas(orig):
    def start(self, now, durable):
        durable.deltas = []
        return orig(self, now, durable)
    return start


def _settle_every_refusal(orig):
    def settle(self, code, h):  # give the residual back on any refusal, even a "stale" for a delta that was merged
        d = self.deltas
        p = d.pushed
        if p is not None and [p.round, p.base_version] == [h.get("round"), h.get("base_version")]:
            d.ef.residual, d.pushed = p.residual_before, None
    return settle


def _no_merged_ack(orig):
    def on_delta(self, peer, msg, now):
        self.state.merged.clear()  # a delta sent again after a lost ack is called stale, not acked
        return orig(self, peer, msg, now)
    return on_delta


def _weights_by_claim(orig):
    def terms(self, ids):  # every claim buys its full weight (the red team's "weight by claim")
        return dataclasses.replace(orig(self, ids), counted=[self.deltas.weight(self.state.pending[i])
                                                                   for i in ids])
    return terms


def _whole_residual_given_back(orig):
    def give_back(self, p):  # a refused delta gives back the whole residual, undoing the other deltas in flight
        self.ef.residual = p.residual_before
    return give_back


def _every_part_stepped(orig):
    def step_on(params, avg, momentum, lr, mu, pieces):  # a streamed round's outer step taken on the whole adapter
        return nesterov_step(params, avg, momentum, lr, mu)
    return step_on


def _zeros_kept(orig):
    def reference(norms, history, tiers=None):  # the low median of every norm, zeros included (the red team's freeze)
        return low_median([*norms, *(n for n, _ in history)])
    return reference


def _step_claims_believed(orig):
    def terms(counts, how, lags, exponent, normalize, window_steps, tiers=None):  # the syncer believes every step
        # claim, a join-key holder's too (the red team's 10^6x; the weights stay capped)
        real = orig(counts, how, lags, exponent, normalize, window_steps, tiers)
        believed = orig(counts, how, lags, exponent, normalize, window_steps, ["trusted"] * len(counts))
        return dataclasses.replace(real, scales=believed.scales, length=believed.length, judged=believed.judged)
    return terms


PLANTED = {
    "a delta against a newer adapter than it trained from": [(lcore.IslandCore, "after_step",
                                                              _after_step_ignoring_new_versions),
                                                             (lcore.IslandCore, "push", _push_against_newest)],
    "broadcast before the checkpoint is durable": [(merging.Merging, "_commit", _broadcast_before_checkpoint)],
    "an island's second delta in a round accepted": [(sdeltas.Deltas, "on_delta", _no_duplicate_check)],
    "merging one responder short of quorum": [(sdriver.RoundDriver, "maybe_close", _quorum_minus_one)],
    "a restart that forgets the saved deltas": [(score.SyncerCore, "start", _forget_saved_deltas)],
    "an island that never catches up": [(lmessages.SyncerMessages, "maybe_sync", lambda orig: lambda self, now: None)],
    "a claim that buys more than the round's median weight": [(merging.Merging, "_terms", _weights_by_claim)],
    "a streamed round that steps the parts it did not merge": [(merging, "nesterov_step_on", _every_part_stepped)],
    "a delta sent again on every control-connection drop (copies queue up a slow link)": [
        (lcore.IslandCore, "link_lost", lambda orig: lambda self, now, bulk=True: orig(self, now, True))],
    "a pipelined delta across a merge of its own part": [(lpipeline, "untouched_since", lambda orig: lambda *a: True),
                                                         (sdeltas, "untouched_since", lambda orig: lambda *a: True)],
    "a refused pipelined delta that gives back the whole residual": [
        (lpipeline.DeltasInFlight, "give_back", _whole_residual_given_back)],
    "a finished syncer that stops serving a slow reader": [
        (sdriver.RoundDriver, "_fetching_final", lambda orig: lambda self, now: False)],
    "an extra id's delta counted toward quorum": [(sstate, "counts_toward_quorum", lambda orig: lambda tier: True)],
    "a clip reference over zero norms (a zero delta sets it to nothing)": [(merging, "clip_reference", _zeros_kept)],
    "a join-key holder's step claim believed (the round as long as it says)": [
        (merging, "merge_terms", _step_claims_believed)],
    "a clip reference taken from the largest norm (an outlier judged by itself)": [
        (merging, "clip_reference", lambda orig: lambda norms, history, tiers=None: max(norms))],
    "an error-feedback residual given back for a delta that counted": [
        (lmessages.SyncerMessages, "_settle_refused", _settle_every_refusal),
        (sdeltas.Deltas, "on_delta", _no_merged_ack)],
}


@pytest.mark.parametrize("bug", sorted(PLANTED))
def test_the_simulator_finds_a_planted_bug(bug, monkeypatch):
    for cls, name, wrap in PLANTED[bug]:
        monkeypatch.setattr(cls, name, wrap(getattr(cls, name)))
    for seed in range(PLANTED_SEEDS):
        out = sim.run_seed(seed)
        if not out.ok:
            return
    pytest.fail(f"{PLANTED_SEEDS} schedules did not notice: {bug}")


def _old_keep_rule(orig):
    def waits(self, h):  # only a pipelined delta waits for its round; one for the round a restarted syncer is about to
        # reopen is refused stale
        r = self.state.round
        return r is not None and h["round"] > r.number and "trained_from" in h
    return waits


def _request_init_without_heard(orig):
    def request(self, f, m):  # the request does not say the island's upload came and did not count
        self.outbox.send(m.peer, "init_request", {"bits": self.state.cfg.sync_bits})
    return request


def _init_copies_kept_across_a_break(orig):
    def link_lost(self, now, bulk=True):  # (before: the founding upload's copies a broken connection took still
        # counted as on their way)
        copies = self.link.init_copies
        actions = orig(self, now, bulk)
        self.link.init_copies = copies
        return actions
    return link_lost


def _only_the_pushed_copy_lost(orig):
    def lost(self):  # (before: a reconnect forgot the copy of `pushed` only, not of the pipelined ones)
        if self.pushed is not None:
            self.pushed.on_its_way = False
    return lost


# bugs that only rare schedules reach: each must be found on the seeds that found it (the oracle sees the class)
PLANTED_ON_SEEDS = {
    "a delta refused before its round reopens, its answer lost with a late hello": (
        [(sdeltas.Deltas, "_waits_for_its_round", _old_keep_rule),
         (sadmission.Admission, "_keep_delta_news", lambda orig: staticmethod(lambda old, new: None))], [800680]),
    "a pipelined delta's copy taken for still on its way after the connections were remade or the syncer forgot us": (
        [(lpipeline.DeltasInFlight, "copies_lost", _only_the_pushed_copy_lost)], [192937500, 506180938]),
    "a delta refused from an island dropped while asleep, the refusal lost, never asked for again": (
        [(sdeltas.Deltas, "_heard_while_away", lambda orig: lambda self, msg: None)], [903596133, 903606582]),
    "a founding upload refused with its error lost, never asked for again": (
        [(sadmission.Admission, "_request_init", _request_init_without_heard)], [3141721]),
    "a kept delta taken at its round's opening, the pongs then silent on a later copy refused with its error lost": (
        [(sdeltas.Deltas, "_take_kept", lambda orig: lambda self, m, msg, now: self._take_delta(m, msg, now))],
        [733602164]),
    "a founding upload lost with its connection still counted as on its way, every request for it ignored": (
        [(lcore.IslandCore, "link_lost", _init_copies_kept_across_a_break)], [913001457]),
}


@pytest.mark.parametrize("bug", sorted(PLANTED_ON_SEEDS))
def test_the_simulator_finds_a_rare_planted_bug_on_its_seed(bug, monkeypatch):
    patches, seeds = PLANTED_ON_SEEDS[bug]
    for seed in seeds:
        assert sim.run_seed(seed).ok, f"seed {seed} fails without the planted bug"
    for cls, name, wrap in patches:
        monkeypatch.setattr(cls, name, wrap(getattr(cls, name)))
    assert all(not sim.run_seed(seed).ok for seed in seeds), f"the oracle did not notice: {bug}"


PHASE_SEEDS = 50  # a planted bad move of an island's phase must be caught within this many schedules


def _first_violation(seeds: int) -> str:
    for seed in range(seeds):
        out = sim.run_seed(seed)
        if not out.ok:
            return out.error
    pytest.fail(f"{seeds} schedules did not notice the planted move")


def _without_abandon(monkeypatch):
    """The table forgets that a round may be abandoned (training -> waiting), which the core still does."""
    allowed = lphases.TRANSITIONS[lphases.Phase.TRAINING] - {lphases.Phase.WAITING}
    monkeypatch.setitem(lphases.TRANSITIONS, lphases.Phase.TRAINING, allowed)


def test_the_island_core_refuses_a_move_its_phase_table_does_not_have(monkeypatch):
    _without_abandon(monkeypatch)
    error = _first_violation(PHASE_SEEDS)
    assert "IllegalTransition" in error and "illegal phase transition training -> waiting on " in error, error


def test_the_simulator_checks_every_move_against_the_phase_table_itself(monkeypatch):
    """With the core's own check switched off, the oracle still finds the move the table does not have."""
    _without_abandon(monkeypatch)
    monkeypatch.setattr(lphases, "check_transition", lambda old, new, event: None)
    error = _first_violation(PHASE_SEEDS)
    assert "moved training -> waiting on " in error and "the phase table has no such move" in error, error


def test_the_simulator_catches_a_phase_changed_around_the_one_method_that_checks_it(monkeypatch):
    """A call site that sets the phase itself (here: abandoning a round) is caught after the event."""
    orig = lcore.IslandCore.after_step

    def after_step(self, steps_done, now, window_steps=None):
        t = self.training
        if t is not None and not self._base_ok(t.base_version, t.base_digest) and self.finish is None and not (
                self.refused or self.link.gave_up):
            self.phases._phase, self.phases._data = lphases.Phase.WAITING, None
            return lcore.StepVerdict.ABANDON
        return orig(self, steps_done, now, window_steps)

    monkeypatch.setattr(lcore.IslandCore, "after_step", after_step)
    error = _first_violation(PHASE_SEEDS * 4)
    assert "last recorded move entered training: a phase changed outside Phases.enter" in error, error
