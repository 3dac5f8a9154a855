"""Streaming fragments (--fragments P): each round merges, steps and broadcasts one part of the adapter.

The pure pieces (which fragments a round syncs, the masked outer step, error feedback on a part) are checked on
their own; then a real syncer on loopback with real islands streams a run whose every merge is replayed by hand,
and a syncer killed mid-run resumes it. The simulator (tests/test_sim.py) runs streamed schedules under faults.
"""

from __future__ import annotations

import time
from dataclasses import replace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.peers import QuadraticIsland, island_thread, wait_until
from tests.test_core import Fleet
from yeto.sync.core.island import Wait
from yeto.sync.core.policy import RoundPolicy
from yeto import YetoError
from yeto.sync.merge.outer import nesterov_step, nesterov_step_on
from yeto.sync.merge.rules import DeltaCounts, merge_weights
from yeto.sync.shell.audit import audit, audit_run
from yeto.sync.shell.server import SyncerConfig
from yeto.sync.shell.tape import read_tape
from yeto.sync.core.actions import Durable
from yeto.sync.core.state import SyncerOutbox
from yeto.sync.wire.layout import (MAX_STREAM_PARTS, MIN_FRAGMENT_NUMEL, STREAM_GRANULES, build_layout, flatten,
                                   fragment_pieces, round_part, stream_part, stream_parts, synced_fragments)
from yeto.sync.wire.protocol import Message, ProtocolError, decode_fragments, encode, encode_fragments_ef
from yeto.sync.wire.quant import ErrorFeedback

LR = 0.1  # the quadratic islands' step: slow enough that a lost step shows
FRAGMENT_NUMEL = 8  # the quadratic island's two tensors of 8 values: two fragments, so two parts


def test_a_islands_layout_has_enough_fragments_to_stream_and_the_parts_cover_it_once_per_cycle():
    rng = np.random.default_rng(0)
    named = {f"model.layers.{i}.{m}.lora_{ab}.weight": np.zeros(rng.integers(1, 64, size=2))
             for i in range(40) for m in ("q", "v", "up") for ab in "AB"}
    layout = build_layout(named)
    assert len(layout.fragments) >= STREAM_GRANULES // 2
    for parts in (1, 2, 3, 4, 8):
        cycle = [stream_part(layout, parts, r) for r in range(1, parts + 1)]
        assert sorted(i for p in cycle for i in p) == list(range(len(layout.fragments)))  # each fragment once
        assert [stream_part(layout, parts, r + parts) for r in range(1, parts + 1)] == cycle  # then again
        sizes = [sum(layout.fragments[i].numel for i in p) for p in cycle]
        assert max(sizes) <= 1.5 * layout.numel / parts  # about equal parts
    small = build_layout({"a": np.zeros(MIN_FRAGMENT_NUMEL // 2)})  # too small to split: one part, every round
    assert stream_part(small, 4, 3) == (0,)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.sampled_from([1, 7, 100, 300, 1000, 20000]), min_size=1, max_size=48),
       st.integers(1, MAX_STREAM_PARTS))
def test_the_parts_are_never_empty_and_cover_every_fragment_once_in_order(sizes, parts):
    """A fragment larger than N / P (one big tensor) must not leave a part empty: a round of an empty part could
    never be merged (its delta carries nothing), and the run would stall on it."""
    layout = build_layout({f"t{i:03d}": np.zeros(n) for i, n in enumerate(sizes)})
    cycle = stream_parts(layout, parts)
    assert len(cycle) == min(parts, len(layout.fragments)) and all(cycle)
    assert [i for p in cycle for i in p] == list(range(len(layout.fragments)))
    assert [stream_part(layout, parts, r) for r in range(1, len(cycle) + 1)] == list(cycle)


def test_a_big_tensor_gets_a_part_of_its_own_and_fewer_fragments_than_parts_are_said_at_founding(monkeypatch):
    layout = build_layout({"a": np.zeros(10), "b": np.zeros(1000)})
    assert stream_parts(layout, 2) == ((0,), (1,))  # (by first value alone, part 1 would be empty)
    said = []
    monkeypatch.setattr(SyncerOutbox, "log", lambda self, level, text: said.append((level, text)))
    Fleet(n=2, fragments=4)  # its adapter packs into one fragment
    assert any(level == "warning" and "--fragments 4" in text and "streams in 1 part" in text for level, text in said)


def test_a_parts_deltas_are_judged_by_the_norm_clip_against_that_parts_own_history():
    """Parts differ in size and layers: a big part's deltas, against two small parts' norms, would all be clipped."""
    shapes = {"a.lora_A.weight": (48, 48), "b.lora_A.weight": (48, 48), "c.lora_A.weight": (256, 256)}
    f = Fleet(n=2, shapes=shapes, fragments=3, outer_steps=6)
    assert stream_parts(f.layout, 3) == ((0,), (1,), (2,))
    for _ in range(6):
        f.train(0)
        f.train(1)
    merges = [e for e in f.tape if e["event"] == "merge"]
    assert [e.get("part") for e in merges] == [[0], [1], [2], [0], [1], None]
    norms = [max(e["merged_norms"]) for e in merges]
    assert norms[2] > 5 * norms[0]  # the big part's deltas, 5.3x the small ones', beyond the clip's k = 4
    assert not [e["clip"] for e in merges if e["clip"]]


def test_a_restart_that_moves_the_last_round_refuses_its_saved_whole_deltas_on_the_tape():
    """Round 2 of 2 syncs the whole adapter; the syncer restarts with --outer-steps 3, so round 2 now syncs part 1: the
    saved whole delta cannot count (nor can its island's copy), and is refused on the tape, not silently lost."""
    f = Fleet(n=2, shapes={"a.lora_A.weight": (48, 48), "b.lora_A.weight": (48, 48)}, fragments=2, outer_steps=2)
    f.train(0)
    f.train(1)
    f.train(0)  # round 2, the last: the whole adapter, accepted and saved
    assert f.syncer.version == 1 and list(f.disk["deltas"]) == [(2, 0)]
    f.cfg = replace(f.cfg, outer_steps=3)
    f.syncer = f._boot_syncer(Durable(f.disk["checkpoint"], list(f.disk["deltas"].values()), list(f.tape)))
    refused = [e for e in f.tape if e["event"] == "refuse_delta"]
    assert [(e["island"], e["round"]) for e in refused] == [(0, 2)] and "--outer-steps" in refused[0]["reason"]
    assert not f.syncer.state.pending and audit(f.tape).ok
    for lid, c in f.islands.items():
        f.to_syncer(lid, c.connected_now(f.now))
    f.run()
    f.tick(dt=1.0, times=3)  # island 0 sends its delta again, is told it was refused, and trains round 2 anew
    for _ in range(2):
        f.train(0)
        f.train(1)
    assert f.syncer.version == 3 and f.syncer.state.finished_at is not None
    assert [e.get("part") for e in f.tape if e["event"] == "merge"] == [[0], [1], None]
    assert audit(f.tape).ok


PIPELINE_SHAPES = {"a.lora_A.weight": (48, 48), "b.lora_A.weight": (48, 48)}  # two fragments: two parts


def _mine(f: Fleet, lid: int) -> list[tuple[int, int]]:
    """(round, merge version) of each of island `lid`'s deltas a merge counted."""
    deltas = {e["digest"]: e for e in f.tape if e["event"] == "delta"}
    return [(deltas[d]["round"], e["version"]) for e in f.tape if e["event"] == "merge"
            for i, d in zip(e["responders"], e["deltas"]) if i == lid]


def test_a_pipelined_delta_waits_unacked_for_its_round_and_counts_there_as_a_fresh_one():
    """--pipeline 2: island 0 pushes round 1, then trains round 2 from version 0 at once (round 2's part is not
    round 1's) and pushes it; the syncer keeps it until round 2 opens, then takes it as a fresh delta of version 1."""
    f = Fleet(n=2, shapes=PIPELINE_SHAPES, fragments=2, pipeline=2, outer_steps=4)
    f.train(0)  # round 1
    task, _ = f.train(0)  # round 2, ahead of round 1's merge
    assert (task.round, task.base_version) == (2, 0)
    c = f.islands[0]
    assert [p.round for p in c.in_flight()] == [1, 2] and not c.deltas.ahead[0].acked
    assert isinstance(c.next_task(f.now), Wait)  # two in flight: the pipeline is full
    assert f.syncer.state.ahead[0][2][1].header["trained_from"] == 0 and f.syncer.state.pending[0].round == 1
    f.train(1)  # round 1's quorum: merged; round 2 opens and takes island 0's pipelined delta
    assert f.syncer.version == 1 and f.syncer.state.pending[0].round == 2 and f.syncer.state.pending[0].lag == 0
    assert [p.round for p in c.in_flight()] == [2] and c.pushed.acked
    accepted = [e for e in f.tape if e["event"] == "delta" and e["island"] == 0]
    assert [(e["round"], e["base_version"], e.get("trained_from")) for e in accepted] == [(1, 0, None), (2, 1, 0)]
    f.train(1)  # round 2 merged: island 0's delta counted in it
    for _ in range(2):
        f.train(0)
        f.train(1)
    assert f.syncer.version == 4 and f.syncer.state.finished_at is not None
    assert _mine(f, 0) == [(1, 1), (2, 2), (3, 3), (4, 4)] and audit(f.tape).ok


@pytest.mark.parametrize("cap", [0, 2, 8])
def test_a_round_and_a_pipelined_round_ask_the_policy_how_many_steps(cap, monkeypatch):
    """The island core's round start and its pipelined rounds both ask `RoundPolicy.steps_for` (--inner-steps 4, or
    the island's --max-inner-steps where lower); planted, a policy that says 3 is what both then train."""
    for planted in (False, True):
        if planted:
            monkeypatch.setattr(RoundPolicy, "steps_for", lambda self, max_inner_steps=0: 3)
        f = Fleet(n=2, shapes=PIPELINE_SHAPES, fragments=2, pipeline=2, outer_steps=4, inner_steps=4)
        f.islands[0].max_inner_steps = cap
        first, _ = f.train(0)
        ahead, _ = f.train(0)  # round 2, ahead of round 1's merge
        assert (first.round, ahead.round, ahead.base_version) == (1, 2, 0)
        assert first.steps == ahead.steps == (3 if planted else min(4, cap or 4))


def test_a_pipelined_delta_whose_part_a_merge_changes_is_refused_and_gives_its_residual_back():
    """Round 4 of 4 syncs the whole adapter, so it is never pushed ahead; a crafted delta that claims it was is
    refused, and an island whose pipelined delta is refused gets that part's residual back (its other part's stays)."""
    f = Fleet(n=2, shapes=PIPELINE_SHAPES, fragments=2, pipeline=2, outer_steps=3, sync_bits=4)
    f.train(0)
    f.train(0)
    c = f.islands[0]
    head, ahead = c.pushed, c.deltas.ahead[0]
    assert c.deltas.next_pipelined() is None  # (round 3, the last, moves the whole adapter: never ahead)
    before = c.ef.residual.copy()
    for refused, left in ((head, [ahead]), (ahead, [])):  # the oldest first: the pipelined one takes its place
        c.receive(Message("error", {"code": "refused", "reason": "x", "round": refused.round, "version": 0,
                                    "base_version": refused.base_version, "digest": refused.digest}), f.now)
        assert c.in_flight() == left
        mine = np.zeros(f.layout.numel, bool)
        for a, n in fragment_pieces(f.layout, synced_fragments(f.layout, refused.part)):
            mine[a:a + n] = True
        np.testing.assert_array_equal(c.ef.residual[mine], refused.residual_before[mine])
        np.testing.assert_array_equal(c.ef.residual[~mine], before[~mine])  # (the other part's is its own)
        before = c.ef.residual.copy()
        assert set(synced_fragments(f.layout, refused.part)) <= c.deltas.given_back  # (the loop keeps its steps)
    # the syncer's side: a delta of the last round (the whole adapter) trained before round 2's merge
    f.train(1)
    f.train(1)
    f.train(0)
    assert f.syncer.version == 2
    h = {"round": 3, "base_version": 2, "trained_from": 1, "trained_digest": f.syncer.state.digests[1]}
    assert "changed its part" in f.syncer.deltas.pipelined_refusal(h).reason
    assert f.syncer.deltas.pipelined_refusal({**h, "trained_from": 2,
                                              "trained_digest": f.syncer.state.digests[2]}) is None
    assert "rolled it back" in f.syncer.deltas.pipelined_refusal({**h, "trained_digest": "0" * 16}).reason


def test_a_pipeline_takes_no_round_the_syncer_would_refuse_and_the_syncer_keeps_only_well_formed_deltas():
    """--pipeline 3 of 4 parts: with round 2's delta refused, rounds 1 and 3 in flight, round 4 from version 0 would be
    3 versions back (the syncer takes 2): not trained. A kept delta must carry its round's part, checked on arrival."""
    shapes = {f"{t}.lora_A.weight": (48, 48) for t in "abcd"}
    f = Fleet(n=2, shapes=shapes, fragments=4, pipeline=3, outer_steps=8)
    for rnd in (1, 2, 3):
        task, _ = f.train(0)
        assert (task.round, task.base_version) == (rnd, 0)
    c = f.islands[0]
    assert sorted(f.syncer.state.ahead[0]) == [2, 3] and c.deltas.next_pipelined() is None  # (full)
    second = c.deltas.ahead[0]
    c.receive(Message("error", {"code": "refused", "reason": "x", "round": 2, "base_version": 1, "version": 0,
                                "digest": second.digest}), f.now)
    assert [p.round for p in c.in_flight()] == [1, 3] and c.deltas.next_pipelined() is None
    # a delta for round 3 carrying round 2's part: refused at once, the kept one stays
    kept = f.syncer.state.ahead[0][3][1]
    bad = {**second.header, "round": 3, "base_version": 2, "copy": 9}
    f.queue.append(("up", 0, encode("delta", {**bad, "island": 0, "session": c.session}, second.frames)))
    f.run()
    assert f.syncer.state.ahead[0][3][1] is kept
    assert any(e["event"] == "reject" and e["round"] == 3 and e["digest"] == second.digest for e in f.tape)


def test_the_outer_step_on_a_part_is_the_step_inside_it_and_nothing_outside():
    rng = np.random.default_rng(1)
    params, avg, mom = (rng.standard_normal(20).astype(np.float32) for _ in range(3))
    new, m = nesterov_step_on(params, avg, mom, 0.7, 0.9, [(3, 5), (12, 4)])
    whole_new, whole_m = nesterov_step(params, avg, mom, 0.7, 0.9)
    inside = np.zeros(20, bool)
    inside[3:8] = inside[12:16] = True
    np.testing.assert_array_equal(new[inside], whole_new[inside])
    np.testing.assert_array_equal(m[inside], whole_m[inside])
    np.testing.assert_array_equal(new[~inside], params[~inside])  # (a whole step would move them by lr mu m)
    np.testing.assert_array_equal(m[~inside], mom[~inside])


def test_a_part_goes_up_alone_its_residual_moves_and_the_rest_waits_its_turn():
    layout = build_layout({"a": np.zeros(16), "b": np.zeros(16)}, FRAGMENT_NUMEL * 2)
    x = np.random.default_rng(2).standard_normal(32).astype(np.float32)
    ef = ErrorFeedback(32)
    ef.residual = np.full(32, 0.01, np.float32)
    before = ef.residual
    descs, frames, sent = encode_fragments_ef(layout, x, 2, ef, only=(1,))
    assert [d["index"] for d in descs] == [1] and len(frames) == 1
    assert not sent[:16].any() and sent[16:].any()
    np.testing.assert_array_equal(ef.residual[:16], before[:16])  # not sent: its residual as it was
    np.testing.assert_allclose(ef.residual[16:], x[16:] + 0.01 - sent[16:], atol=1e-6)
    assert before is not ef.residual and (before == 0.01).all()  # a caller holding the old residual keeps it
    msg = Message("delta", {"fragments": descs}, frames)
    np.testing.assert_array_equal(decode_fragments(layout, msg, (1,)), sent)
    with pytest.raises(ProtocolError, match="expected 1 fragments"):
        decode_fragments(layout, Message("delta", {"fragments": descs * 2}, frames * 2), (1,))
    with pytest.raises(ProtocolError, match="does not match layout fragment 0"):
        decode_fragments(layout, msg, (0,))  # another round's part


@pytest.mark.parametrize("flags, error", [
    ({"fragments": 0}, "--fragments must be between 1"),
    ({"fragments": 4, "max_base_lag": 2}, "--max-base-lag 0"),
    ({"fragments": 4, "merge": "mean", "lora_merge": "product"}, "--lora-merge factors"),
    ({"fragments": 4, "merge_alpha": 0.5}, "--merge-alpha 1"),
    ({"fragments": 2, "pipeline": 3}, "--pipeline must be between 1"),
    ({"pipeline": 2}, r"--pipeline must be between 1 \(one delta in flight\) and --fragments \(1\)"),
    ({"fragments": 2, "pipeline": 2, "round_seconds": 30.0}, "--inner-steps with --pipeline"),
])
def test_streaming_flags_that_cannot_go_together_are_one_line_each(flags, error):
    with pytest.raises(YetoError, match=error):
        SyncerConfig(**flags).check()
    assert SyncerConfig(fragments=4).max_base_lag == 0 and SyncerConfig().max_base_lag > 0


def _replay(targets: list[float], rounds: int, parts: int, steps: int, reset: bool = False,
            whole_last: bool = True) -> np.ndarray:
    """Streaming DiLoCo by hand: the islands never reset (`reset`: they do, the bug); round r merges part
    (r - 1) mod P of their deltas (the mean, outer lr 1) and each island takes that part of the new global; the last
    round merges the whole adapter (`whole_last`: else its part, and the other parts' last steps are lost)."""
    layout = build_layout(QuadraticIsland(0.0, 1).state, FRAGMENT_NUMEL)
    g = np.zeros(layout.numel, np.float32)
    thetas = [g.copy() for _ in targets]
    w = merge_weights([DeltaCounts(steps * 100, 0, steps)] * len(targets))
    for r in range(1, rounds + 1):
        for th, tgt in zip(thetas, targets):
            if reset:
                th[:] = g
            for _ in range(steps):
                th -= np.float32(LR) * (th - np.float32(tgt))
        part = round_part(layout, parts, r, rounds if whole_last else rounds + 1)
        for a, n in fragment_pieces(layout, synced_fragments(layout, part)):
            g[a:a + n] += sum(wi * (th[a:a + n] - g[a:a + n]) for wi, th in zip(w, thetas))
            for th in thetas:
                th[a:a + n] = g[a:a + n]
    return g


def test_a_streamed_run_merges_one_part_a_round_exactly_as_by_hand(start_syncer, tmp_path):
    syncer, port = start_syncer(islands=2, quorum=2, outer_steps=6, inner_steps=2, sync_bits=32, merge="mean",
                                fragments=2)
    islands = {0: QuadraticIsland(1.0, 100, lr=LR), 1: QuadraticIsland(-2.0, 100, lr=LR)}
    results: dict = {}
    threads = [island_thread(isl, port, lid, results, fragment_numel=FRAGMENT_NUMEL) for lid, isl in islands.items()]
    for t in threads:
        t.join(60)
    assert all(isinstance(r, dict) and r["complete"] for r in results.values()), results
    expected = _replay([1.0, -2.0], 6, 2, 2)
    np.testing.assert_allclose(syncer.global_, expected, rtol=1e-5, atol=1e-6)
    # (islands that start each round from the global would end elsewhere: each part's steps between its syncs lost)
    assert not np.allclose(expected, _replay([1.0, -2.0], 6, 2, 2, reset=True), atol=1e-3)
    # (a last round of one part would leave the other part's last round of steps out of the final adapter)
    assert not np.allclose(expected, _replay([1.0, -2.0], 6, 2, 2, whole_last=False), atol=1e-3)

    tape = read_tape(tmp_path / "syncer")
    assert [e.get("part") for e in tape if e["event"] == "merge"] == [[0], [1]] * 2 + [[0], None]  # (the last: all)
    whole = [e["bytes"] for e in tape if e["event"] == "delta"]
    assert len(whole) == 12 and max(whole) < 16 * 4 + 2048  # one 8-value fragment of fp32 and its header each
    broadcasts = [e for e in tape if e["event"] == "broadcast"]
    assert len(broadcasts) == 6 and all(e["bytes"] < 16 * 4 + 2048 for e in broadcasts)
    assert audit_run(tmp_path / "syncer").ok
    layout = build_layout(islands[0].state, FRAGMENT_NUMEL)
    np.testing.assert_allclose(flatten(layout, islands[1].state), expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("overlap", [False, True])
def test_a_pipelined_run_on_loopback_pushes_ahead_and_lands_where_streaming_does(start_syncer, tmp_path, overlap):
    """--pipeline 2 with real islands: the fast one pushes each next round's part while the slow one still trains
    (it would wait otherwise), every merge counts both islands, and the run ends where the unpipelined replay does:
    an island takes a merged part a round later, but its steps are affine and the merge an equal-weight mean, so
    the islands' late takes cancel in the part's next merge (a delta taken against the wrong base would not).
    With --overlap the fast island also trains on while its pipeline is full, and before the last round: its steps
    take the merged parts later still (near the replay, not on it)."""
    syncer, port = start_syncer(islands=2, quorum=2, outer_steps=6, inner_steps=2, sync_bits=32, merge="mean",
                                fragments=2, pipeline=2)
    islands = {0: QuadraticIsland(1.0, 100, lr=LR), 1: QuadraticIsland(-2.0, 100, lr=LR)}
    results: dict = {}
    threads = [island_thread(isl, port, lid, results, fragment_numel=FRAGMENT_NUMEL, step_delay=0.1 * lid,
                             overlap=overlap) for lid, isl in islands.items()]
    for t in threads:
        t.join(90)
    assert all(isinstance(r, dict) and r["complete"] for r in results.values()), results
    tape = read_tape(tmp_path / "syncer")
    merges = [e for e in tape if e["event"] == "merge"]
    assert [sorted(e["responders"]) for e in merges] == [[0, 1]] * 6
    ahead = [e for e in tape if e["event"] == "delta" and "trained_from" in e]
    assert {e["island"] for e in ahead} >= {0} and all(e["trained_from"] < e["base_version"] for e in ahead)
    assert audit_run(tmp_path / "syncer").ok
    expected = _replay([1.0, -2.0], 6, 2, 2)
    np.testing.assert_allclose(syncer.global_, expected, rtol=1e-5, atol=1e-6 if not overlap else 0.15)
    layout = build_layout(islands[0].state, FRAGMENT_NUMEL)
    np.testing.assert_allclose(flatten(layout, islands[0].state), syncer.global_, rtol=1e-5, atol=1e-6)


def test_a_streamed_run_whose_syncer_is_killed_mid_run_resumes_and_finishes(start_syncer, tmp_path):
    cfg = dict(islands=2, quorum=2, outer_steps=8, inner_steps=2, sync_bits=4, fragments=2)
    syncer, port = start_syncer(**cfg)
    islands = {0: QuadraticIsland(1.0, 100), 1: QuadraticIsland(-2.0, 100)}
    results: dict = {}
    threads = [island_thread(isl, port, lid, results, fragment_numel=FRAGMENT_NUMEL, step_delay=0.05)
               for lid, isl in islands.items()]
    assert wait_until(lambda: syncer.version >= 3, 30)
    syncer.kill()  # gone mid-run, telling nobody; back from its checkpoint on the same port
    time.sleep(0.5)
    syncer2, _ = start_syncer(port=port, **cfg)
    for t in threads:
        t.join(90)
    assert all(isinstance(r, dict) and r["complete"] for r in results.values()), results
    assert wait_until(lambda: syncer2.finished) and syncer2.version == 8
    tape = read_tape(tmp_path / "syncer")
    merges = [e for e in tape if e["event"] == "merge"]
    assert [e["version"] for e in merges] == list(range(1, 9))
    assert [e.get("part") for e in merges] == [[0], [1]] * 3 + [[0], None]  # (the part follows the round, across
    # the restart)
    assert any(e["event"] == "resume" for e in tape) and audit_run(tmp_path / "syncer").ok
