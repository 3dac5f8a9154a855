"""The syncer as a real ZeroMQ server on loopback: robustness, quorum, exact merge math, restart.

Islands here are a minimal numpy backend (gradient steps on a quadratic) so the
expected global adapter can be computed by hand; the torch island processes are
in test_fleet.py and test_faults.py.
"""

import json
import time

import numpy as np
import pytest

from tests.peers import FAST, NAMES, QuadraticIsland, RawIsland, island_thread, tape_with, wait_until
from yeto import YetoError
from yeto.island.diloco import run_island
from yeto.launch.local import free_port
from yeto.sync.shell.audit import audit
from yeto.sync.wire.layout import build_layout, flatten
from yeto.sync.merge.rules import DeltaCounts, capped_claims, merge_weights
from yeto.sync.merge.outer import nesterov_step
from yeto.sync.wire.protocol import PROTOCOL_VERSION, encode, encode_fragments
from yeto.sync.wire.quant import quantize
from yeto.sync.shell.server import Syncer, SyncerConfig
from yeto.sync.shell.tape import read_tape


def test_two_islands_merge_exactly_as_computed_by_hand(start_syncer, tmp_path):
    syncer, port = start_syncer(islands=2, quorum=2, outer_steps=3, inner_steps=2, sync_bits=32, outer_lr=0.7,
                                outer_momentum=0.9, merge="mean")
    islands = {0: QuadraticIsland(1.0, 300), 1: QuadraticIsland(-2.0, 100)}
    results = {}
    threads = [island_thread(isl, port, lid, results) for lid, isl in islands.items()]
    for t in threads:
        t.join(30)
    assert all(isinstance(r, dict) for r in results.values()), results

    # replay by hand: both start from the founder's (zero) adapter; each round is 2 steps toward its target
    layout = build_layout(islands[0].state)
    g = np.zeros(layout.numel, np.float32)
    m = np.zeros_like(g)
    # loss-bearing tokens 2 steps x 300 and 2 x 100, counted as claimed (no keys, loopback only: trusted)
    w = merge_weights([DeltaCounts(600, 0, 2), DeltaCounts(200, 0, 2)])
    for _ in range(3):
        deltas = []
        for tgt in (1.0, -2.0):
            x = g.copy()
            for _ in range(2):
                x -= 0.5 * (x - tgt)
            deltas.append(x - g)
        g, m = nesterov_step(g, w[0] * deltas[0] + w[1] * deltas[1], m, 0.7, 0.9)
    np.testing.assert_allclose(syncer.global_, g, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(flatten(layout, islands[1].state), g, rtol=1e-5, atol=1e-6)  # islands end on the global
    assert all(r["complete"] for r in results.values())

    tape = read_tape(tmp_path / "syncer")
    merges = [e for e in tape if e["event"] == "merge"]
    assert [sorted(e["responders"]) for e in merges] == [[0, 1]] * 3  # (listed in the order they were summed)
    assert all(dict(zip(e["responders"], e["weights"])) == pytest.approx({0: 0.75, 1: 0.25}) for e in merges)
    assert all(e["tiers"] == ["trusted", "trusted"] for e in merges)
    assert wait_until(lambda: syncer.finished) and syncer.exit_code == 0
    assert audit(tape).ok, audit(tape).summary()
    assert (tmp_path / "syncer" / "adapter" / "adapter_model.safetensors").is_file()
    inits = [e for e in tape if e["event"] == "init"]
    assert len(inits) == 1 and inits[0]["bits"] == [32]  # only the founder uploaded an adapter


def test_malformed_messages_are_answered_and_change_nothing(start_syncer, tmp_path):
    syncer, port = start_syncer(islands=1, quorum=1, outer_steps=1, inner_steps=1, sync_bits=32)
    s = RawIsland(port, 5)
    bad = [
        [b"\xff\xfe not json"],
        [json.dumps([1, 2]).encode()],
        [json.dumps({"v": 99, "type": "ping", "island": 5}).encode()],
        [json.dumps({"v": PROTOCOL_VERSION, "type": "teleport"}).encode()],
        [json.dumps({"v": PROTOCOL_VERSION, "type": "delta", "island": 5, "session": "s1"}).encode()],
        [json.dumps({"v": PROTOCOL_VERSION, "type": "hello", "island": "five", "session": "s1", "backend": "x",
                     "layout": {}, "adapter_config": {}, "version": -1, "digest": ""}).encode()],
        encode("ping", s.header(version=-1, pushed=None)),  # before hello
        encode("welcome", {"incarnation": "x", "version": 0, "digest": "", "policy": {}, "open_round": None,
                           "contributed": False, "merged": [], "finished": False}),  # wrong direction
    ]
    for parts in bad:
        reply = s.ask(parts)
        assert reply.type == "error" and reply.header["reason"] and reply.header["code"]
    state = QuadraticIsland(0.0, 1).state
    parts, layout = s.hello_parts(state)
    cfg = json.loads(parts[0])
    for broken in ({"adapter_config": {"peft_type": "LORA", "r": "sixteen", "lora_alpha": 4}},
                   {"provenance": ["not", "a", "dict"]}):
        reply = s.ask(encode("hello", {**{k: v for k, v in cfg.items() if k not in ("v", "type")}, **broken}))
        assert reply.type == "refuse" and reply.header["code"] == "bad_config"
    assert syncer.core.run is None and syncer.core.state.founding is None  # a bad hello did not define the run
    req = s.ask(parts)
    assert req.type == "init_request"
    descs, frames = encode_fragments(layout, flatten(layout, state), 32)
    truncated = frames[:-1] + [frames[-1][:-4]]
    assert s.ask(encode("init", s.header(fragments=descs), truncated), bulk=True).type == "error"
    assert syncer.core.run is None
    s.bulk.send_multipart(encode("init", s.header(fragments=descs), frames))
    assert s.recv(want="welcome").header["version"] == 0
    rnd = s.recv(want="round")
    assert rnd.header["round"] == 1
    # deltas with NaN, wrong size, wrong round, impossible tokens: all refused, the global untouched
    before = syncer.global_.copy()
    nan = np.zeros(layout.numel, np.float32)
    nan[3] = np.nan
    base = s.header(round=1, base_version=0, tokens=10, loss_tokens=5, inner_steps=1, loss=1.0)
    frags = [{"index": 0, "numel": layout.numel, "bits": 32}]
    zeros = np.zeros(layout.numel, np.float32).tobytes()
    for header, payload in [
        (base, nan.tobytes()),
        (base, b"\0" * (4 * layout.numel - 4)),
        (dict(base, round=7), zeros),
        (dict(base, loss_tokens=0), zeros),
        (dict(base, loss_tokens=11), zeros),  # more loss-bearing tokens than tokens
        (dict(base, tokens=1 << 50, loss_tokens=1 << 50), zeros),
    ]:
        reply = s.ask(encode("delta", dict(header, fragments=frags), [payload]), bulk=True)
        assert reply.type == "error" and reply.header["code"] in ("refused", "stale", "malformed"), reply
    # 2-bit payloads: a non-finite block scale, a byte short, a precision nobody speaks
    two = quantize(np.linspace(-1, 1, layout.numel, dtype=np.float32), 2)
    nan_scale = np.float16(np.nan).tobytes() + two[2:]
    for bits, payload in ((2, nan_scale), (2, two[:-1]), (3, two)):
        reply = s.ask(encode("delta", dict(base, fragments=[dict(frags[0], bits=bits)]), [payload]), bulk=True)
        assert reply.type == "error" and reply.header["code"] in ("refused", "malformed"), reply
    np.testing.assert_array_equal(syncer.global_, before)
    assert syncer.version == 0 and not syncer.finished
    rejects = [e for e in read_tape(tmp_path / "syncer") if e["event"] == "reject"]
    assert len(rejects) >= len(bad) + 9
    assert any("non-finite" in e["reason"] for e in rejects)
    # and the run still works: a good delta is merged
    good = np.full(layout.numel, 0.01, np.float32)
    ack = s.ask(encode("delta", dict(base, fragments=frags), [good.tobytes()]), bulk=True)
    assert ack.type == "ack" and not ack.header["duplicate"]
    assert wait_until(lambda: syncer.version == 1) and np.isfinite(syncer.global_).all()
    assert audit(tape_with(tmp_path / "syncer", "merge")).ok
    s.close()


def send_a_huge_delta_in_a_round_of_three(start_syncer, merge):
    """Islands 0 and 1 push small deltas, island 2 one finite but far beyond what fp16 block scales can carry."""
    syncer, port = start_syncer(islands=3, quorum=2, outer_steps=1, inner_steps=1, sync_bits=4, straggler_timeout=30,
                                merge=merge)
    ls = [RawIsland(port, i) for i in range(3)]
    state = QuadraticIsland(0.0, 1).state
    layout = ls[0].found(state)
    for lrn in ls[1:]:
        parts, _ = lrn.hello_parts(state)
        assert lrn.ask(parts).type == "welcome"
    for lrn in ls:
        assert lrn.recv(want="round").header["round"] == 1
    frags = [{"index": 0, "numel": layout.numel, "bits": 32}]
    deltas = {0: np.full(layout.numel, 0.01, np.float32), 1: np.full(layout.numel, -0.02, np.float32),
              2: np.full(layout.numel, 3e38, np.float32)}
    deltas[2][::2] = -3e38
    for lid in (2, 0, 1):
        h = ls[lid].header(round=1, base_version=0, tokens=10, loss_tokens=5, inner_steps=1, loss=1.0, fragments=frags)
        assert ls[lid].ask(encode("delta", h, [deltas[lid].tobytes()]), bulk=True).type == "ack"
    return syncer, ls


def test_a_huge_finite_delta_is_refused_by_the_merge_and_the_round_goes_on(start_syncer, tmp_path):
    """The mean's sum overflows with it, so the merge cannot be broadcast: it is refused with a reason, on the tape;
    the round merges the others; the global never sees it."""
    syncer, ls = send_a_huge_delta_in_a_round_of_three(start_syncer, "mean")
    refused = ls[2].recv(want="error")
    assert refused.header["code"] == "refused" and "could not be merged" in refused.header["reason"]
    assert wait_until(lambda: syncer.version == 1)
    assert np.isfinite(syncer.global_).all() and np.abs(syncer.global_).max() < 1.0
    tape = tape_with(tmp_path / "syncer", "merge")
    merge = next(e for e in tape if e["event"] == "merge")
    assert merge["responders"] == [0, 1]
    assert any(e["event"] == "refuse_delta" and e["island"] == 2 for e in tape)
    assert audit(tape).ok, audit(tape).summary()
    for lrn in ls:
        lrn.close()


def test_rda_merges_a_huge_finite_delta_clipped_to_a_typical_length(start_syncer, tmp_path):
    """RDA sums unit directions and the (clipped) norms, never the huge values: the delta counts like any other."""
    syncer, ls = send_a_huge_delta_in_a_round_of_three(start_syncer, "rda")
    assert wait_until(lambda: syncer.version == 1)
    assert np.isfinite(syncer.global_).all() and np.abs(syncer.global_).max() < 1.0
    tape = tape_with(tmp_path / "syncer", "merge")
    merge = next(e for e in tape if e["event"] == "merge")
    assert merge["responders"] == [0, 1, 2] and list(merge["clip"]) == ["2"] and merge["clip"]["2"] < 1e-30
    assert not any(e["event"] == "refuse_delta" for e in tape)
    assert audit(tape).ok, audit(tape).summary()
    for lrn in ls:
        lrn.close()


def test_layout_mismatch_is_refused_naming_the_tensor(start_syncer):
    syncer, port = start_syncer(islands=2, quorum=1, outer_steps=1)
    a = RawIsland(port, 0)
    a.found(QuadraticIsland(0.0, 1).state)
    b = RawIsland(port, 1)
    parts, _ = b.hello_parts(QuadraticIsland(0.0, 1, shape_b=(4, 3)).state)
    reply = b.ask(parts)
    assert reply.type == "refuse" and reply.header["code"] == "layout_mismatch"
    reason = reply.header["reason"]
    assert NAMES[1] in reason and "[4, 2]" in reason and "[4, 3]" in reason
    assert 1 not in syncer.core.state.members


def test_a_island_whose_deltas_exceed_max_message_mb_is_refused_with_the_fix(start_syncer):
    syncer, port = start_syncer(islands=1, quorum=1, outer_steps=1, sync_bits=32, max_message_mb=1)
    big = {NAMES[0]: np.zeros((2, 4), np.float32), NAMES[1]: np.zeros((300_000, 2), np.float32)}  # 2.4 MB at 32 bits
    a = RawIsland(port, 0)
    parts, _ = a.hello_parts(big)
    reply = a.ask(parts)
    assert reply.type == "refuse" and reply.header["code"] == "too_large"
    assert "--max-message-mb" in reply.header["reason"]


def test_bridge_raises_a_clear_error_when_refused(start_syncer):
    syncer, port = start_syncer(islands=2, quorum=1, outer_steps=1)
    RawIsland(port, 0).found(QuadraticIsland(0.0, 1).state)
    with pytest.raises(YetoError, match="refused this island.*lora_B"):
        run_island(QuadraticIsland(0.0, 1, shape_b=(4, 3)), f"127.0.0.1:{port}", 1, log_fn=lambda s: None,
                   timeouts=FAST)


def test_a_round_short_of_quorum_waits_says_whom_it_waits_for_and_never_merges(start_syncer, tmp_path):
    syncer, port = start_syncer(islands=2, quorum=2, outer_steps=2, inner_steps=1, sync_bits=32, island_timeout=1.0,
                                quorum_timeout=20.0)
    s0, s1 = RawIsland(port, 0), RawIsland(port, 1)
    layout = s0.found(QuadraticIsland(0.0, 1).state)
    parts, _ = s1.hello_parts(QuadraticIsland(0.0, 1).state)
    assert s1.ask(parts).type == "welcome"
    frags = [{"index": 0, "numel": layout.numel, "bits": 32}]
    d = encode("delta", s0.header(round=1, base_version=0, tokens=4, loss_tokens=2, inner_steps=1, loss=0.5,
                                  fragments=frags), [np.ones(layout.numel, np.float32).tobytes()])
    s0.bulk.send_multipart(d)
    # island 1 goes silent: it is dropped after 1 s, but one responder is still short of quorum 2
    deadline = time.time() + 17
    waits = []
    while time.time() < deadline and not waits:
        s0.ctl.send_multipart(encode("ping", s0.header(version=0, pushed=None)))
        time.sleep(0.2)
        waits = [e for e in read_tape(tmp_path / "syncer") if e["event"] == "quorum_wait"]
    assert waits and waits[0]["responders"] == [0] and waits[0]["gone"] == [1] and waits[0]["short"]
    assert syncer.version == 0, "merged with fewer responders than the quorum"
    # island 1 comes back (a restart: a new session) and is counted again: the round merges with both
    s1b = RawIsland(port, 1, session="s2")
    parts, _ = s1b.hello_parts(QuadraticIsland(0.0, 1).state)
    welcome = s1b.ask(parts)
    assert welcome.type == "welcome" and welcome.header["open_round"]["round"] == 1
    s1b.bulk.send_multipart(encode("delta", s1b.header(round=1, base_version=0, tokens=4, loss_tokens=2, inner_steps=1,
                                                       loss=0.5, fragments=frags),
                                   [np.ones(layout.numel, np.float32).tobytes()]))
    assert wait_until(lambda: syncer.version == 1)
    merge = next(e for e in tape_with(tmp_path / "syncer", "merge") if e["event"] == "merge")
    assert merge["responders"] == [0, 1]


def test_a_round_that_truly_cannot_reach_quorum_gives_up_with_exit_3(start_syncer, tmp_path):
    syncer, port = start_syncer(islands=2, quorum=2, outer_steps=2, inner_steps=1, island_timeout=1.0,
                                quorum_timeout=2.0)
    s0, s1 = RawIsland(port, 0), RawIsland(port, 1)
    s0.found(QuadraticIsland(0.0, 1).state)
    parts, _ = s1.hello_parts(QuadraticIsland(0.0, 1).state)
    assert s1.ask(parts).type == "welcome"
    assert wait_until(lambda: syncer.finished, timeout=15)
    assert syncer.exit_code == 3 and syncer.version == 0
    events = [e["event"] for e in tape_with(tmp_path / "syncer", "quorum_timeout")]
    assert "merge" not in events


def test_islands_survive_a_syncer_crash(start_syncer, tmp_path):
    out = tmp_path / "syncer"
    syncer, port = start_syncer(islands=1, quorum=1, outer_steps=6, inner_steps=1, sync_bits=32, out=out)
    island = QuadraticIsland(1.0, 10, lr=0.1)
    results = {}
    orig_step = island.step

    def slow_step():
        time.sleep(0.15)
        return orig_step()

    island.step = slow_step
    t = island_thread(island, port, 0, results)
    assert wait_until(lambda: syncer.version >= 2)
    syncer.kill()  # the syncer vanishes mid-run, telling nobody ...
    time.sleep(0.5)
    version_at_kill = syncer.version
    syncer2, _ = start_syncer(islands=1, quorum=1, outer_steps=6, inner_steps=1, sync_bits=32, out=out, port=port)
    resumed = tape_with(out, "resume")  # ... and comes back from its checkpoint (the island may push at once)
    assert next(e for e in resumed if e["event"] == "resume")["version"] == version_at_kill
    t.join(40)
    assert isinstance(results.get(0), dict), results
    assert wait_until(lambda: syncer2.finished) and syncer2.version == 6
    events = read_tape(out)
    assert any(e["event"] == "resume" for e in events)
    assert sum(1 for e in events if e["event"] == "join") >= 2  # the island re-joined the restarted syncer
    assert audit(events).ok, audit(events).summary()


def test_a_restart_with_a_conflicting_config_is_refused_naming_the_field(start_syncer, tmp_path):
    out = tmp_path / "syncer"
    syncer, port = start_syncer(islands=1, quorum=1, outer_steps=2, inner_steps=1, sync_bits=32, out=out,
                                merge="mean")
    results = {}
    island_thread(QuadraticIsland(1.0, 10), port, 0, results).join(30)
    assert wait_until(lambda: syncer.finished)
    with pytest.raises(YetoError, match=r"--sync-bits 4 conflicts with the checkpoint.*sync_bits 32.*--sync-bits 32"):
        Syncer(SyncerConfig(port=free_port(), host="127.0.0.1", out=str(out), islands=1, quorum=1, outer_steps=2,
                            inner_steps=1, sync_bits=4))
    with pytest.raises(YetoError, match=r"--broadcast-bits 8 conflicts with the checkpoint.*--broadcast-bits 32"):
        Syncer(SyncerConfig(port=free_port(), host="127.0.0.1", out=str(out), islands=1, quorum=1, outer_steps=2,
                            inner_steps=1, sync_bits=32, broadcast_bits=8, merge="mean"))
    with pytest.raises(YetoError, match="--outer-steps 1 is below the checkpoint's version 2"):
        Syncer(SyncerConfig(port=free_port(), host="127.0.0.1", out=str(out), islands=1, quorum=1, outer_steps=1,
                            inner_steps=1, sync_bits=32, merge="mean"))
    with pytest.raises(YetoError, match=r"--merge rda conflicts with the checkpoint.*resume with --merge mean"):
        Syncer(SyncerConfig(port=free_port(), host="127.0.0.1", out=str(out), islands=1, quorum=1, outer_steps=2,
                            inner_steps=1, sync_bits=32, merge="rda"))
    # --merge left unset resumes the run's own rule (mean: the default when it began), and the tape says so
    resumed, _ = start_syncer(islands=1, quorum=1, outer_steps=2, inner_steps=1, sync_bits=32, out=out)
    assert resumed.cfg.merge == "mean"
    assert [e["config"]["merge"] for e in read_tape(out) if e["event"] == "start"] == ["mean", "mean"]


def test_time_window_rounds_default_to_the_mean_with_step_normalization():
    """Where islands of unequal speed take unequal steps (time windows) the measured defaults are the mean with step
    normalization (docs/benchmarks.md); fixed-step rounds keep rda; an explicit choice of either is kept, and a run
    begun under other defaults resumes as it began."""
    assert (SyncerConfig().merge, SyncerConfig().step_normalize) == ("rda", False)
    windows = SyncerConfig(round_seconds=20.0)
    assert (windows.merge, windows.step_normalize) == ("mean", True)
    assert SyncerConfig(round_seconds=20.0, merge="rda").step_normalize is False
    assert SyncerConfig(round_seconds=20.0, step_normalize=False).merge == "rda"
    assert SyncerConfig(step_normalize=True).merge == "mean"
    windows.check_resume({"merge": "rda", "step_normalize": False}, 0)
    assert (windows.merge, windows.step_normalize) == ("rda", False)
    older = SyncerConfig(round_seconds=20.0)
    older.check_resume({"merge": "rda"}, 0)  # a checkpoint from before the switch: it ran without
    assert (older.merge, older.step_normalize) == ("rda", False)
    oldest = SyncerConfig(round_seconds=20.0)
    oldest.check_resume({"sync_bits": 4}, 0)  # from before --merge too: the mean, without
    assert (oldest.merge, oldest.step_normalize) == ("mean", False)
    chosen = SyncerConfig(round_seconds=20.0, step_normalize=True)
    with pytest.raises(YetoError, match="--step-normalize True conflicts with the checkpoint.*resume with "
                                        "--no-step-normalize"):
        chosen.check_resume({"merge": "mean", "step_normalize": False}, 0)


def test_time_window_rounds_weight_a_slow_island_by_its_tokens_and_steps(start_syncer, tmp_path):
    syncer, port = start_syncer(islands=2, quorum=2, outer_steps=2, round_seconds=0.6, sync_bits=32)
    fast, slow = QuadraticIsland(1.0, 10, lr=0.1), QuadraticIsland(-1.0, 10, lr=0.1)
    results = {}
    threads = [island_thread(fast, port, 0, results, step_delay=0.02),
               island_thread(slow, port, 1, results, step_delay=0.2)]
    for t in threads:
        t.join(30)
    assert all(isinstance(r, dict) for r in results.values()), results
    events = read_tape(tmp_path / "syncer")
    deltas = {(e["round"], e["island"]): e for e in events if e["event"] == "delta"}
    for m in (e for e in events if e["event"] == "merge"):
        f, s = deltas[(m["round"], 0)], deltas[(m["round"], 1)]
        assert f["inner_steps"] > 2 * s["inner_steps"] >= 2  # the slow island still contributes what it did
        weights = dict(zip(m["responders"], m["weights"]))  # (responders are listed in the order they were summed)
        # what each counted for: its loss-token weight, times (step normalization, the time-window default) the
        # round's most steps / its own
        assert m["step_normalize"] and m["merge"] == "mean"
        # (as claimed: no keys on loopback, so both are trusted; a join-key pair's would be capped, test_security)
        counted = capped_claims([f["loss_tokens"], s["loss_tokens"]], [f["tier"], s["tier"]])
        assert counted == [f["loss_tokens"], s["loss_tokens"]]
        total, most = sum(counted), f["inner_steps"]
        assert [weights[0], weights[1]] == pytest.approx([counted[0] / total,
                                                          counted[1] / total * most / s["inner_steps"]])
