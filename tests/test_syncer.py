"""The syncer as a real ZeroMQ server on loopback: robustness, quorum, exact merge math, restart.

Islands here are a minimal numpy backend (gradient steps on a quadratic) so the
expected global adapter can be computed by hand; the torch learner processes are
in test_fleet.py.
"""

import json
import threading
import time

import numpy as np
import pytest
import zmq

from yeto import YetoError
from yeto.diloco import run_island
from yeto.launch.local import free_port
from yeto.sync.layout import build_layout, flatten
from yeto.sync.outer import merge_weights, nesterov_step
from yeto.sync.protocol import decode, encode, encode_fragments
from yeto.sync.server import Syncer, SyncerConfig
from yeto.tape import read_tape

NAMES = ["base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight",
         "base_model.model.model.layers.0.self_attn.q_proj.lora_B.default.weight"]
ADAPTER_CONFIG = {"peft_type": "LORA", "r": 2, "lora_alpha": 4, "target_modules": ["q_proj"], "task_type": "CAUSAL_LM"}


class QuadraticIsland:
    """A real (numpy) Island: each step moves the adapter toward its own target."""

    backend = "numpy"

    def __init__(self, target: float, loss_tokens: int, lr: float = 0.5, shape_b=(4, 2)):
        self.state = {NAMES[0]: np.zeros((2, 4), np.float32), NAMES[1]: np.zeros(shape_b, np.float32)}
        self.target, self.loss_tokens, self.lr = target, loss_tokens, lr
        self.steps = 0

    def adapter_state(self):
        return {k: v.copy() for k, v in self.state.items()}

    def load_adapter_state(self, state):
        self.state = {k: np.asarray(v, np.float32).copy() for k, v in state.items()}

    def step(self):
        for k in self.state:
            self.state[k] -= self.lr * (self.state[k] - self.target)
        self.steps += 1
        loss = float(sum(((v - self.target) ** 2).mean() for v in self.state.values()))
        return {"loss": loss, "tokens": 2 * self.loss_tokens, "loss_tokens": self.loss_tokens}

    def adapter_config(self):
        return ADAPTER_CONFIG

    def record(self):
        return {"backend": "numpy"}

    def set_total_steps(self, total):
        pass


@pytest.fixture
def start_syncer(tmp_path):
    running = []

    def start(**kw):
        port = kw.pop("port", None) or free_port()
        cfg = SyncerConfig(port=port, host="127.0.0.1", out=str(kw.pop("out", tmp_path / "syncer")), **kw)
        s = Syncer(cfg)
        t = threading.Thread(target=s.serve, daemon=True)
        t.start()
        running.append((s, t))
        time.sleep(0.1)
        return s, port

    yield start
    for s, t in running:
        s.stop()
        t.join(5)


def wait_until(cond, timeout=10.0):
    deadline = time.time() + timeout
    while not cond() and time.time() < deadline:
        time.sleep(0.02)
    return cond()


def island_thread(island, port, lid, results, **kw):
    def target():
        try:
            results[lid] = run_island(island, f"127.0.0.1:{port}", lid, log_fn=lambda s: None,
                                      client_kwargs={"heartbeat_s": 0.2, "dead_after_s": 3.0, "backoff_base_s": 0.05,
                                                     "backoff_max_s": 0.5}, **kw)
        except Exception as e:  # surfaced by the test
            results[lid] = e

    t = threading.Thread(target=target, daemon=True)
    t.start()
    return t


def test_two_islands_merge_exactly_as_computed_by_hand(start_syncer, tmp_path):
    syncer, port = start_syncer(learners=2, quorum=2, outer_steps=3, inner_steps=2, sync_bits=32, outer_lr=0.7, outer_momentum=0.9)
    islands = {0: QuadraticIsland(1.0, 300), 1: QuadraticIsland(-2.0, 100)}
    results = {}
    threads = [island_thread(isl, port, lid, results) for lid, isl in islands.items()]
    for t in threads:
        t.join(30)
    assert all(isinstance(r, dict) for r in results.values()), results

    # replay by hand: both start from island 0's (zero) adapter; each round is 2 steps toward its target
    layout = build_layout(islands[0].state)
    g = np.zeros(layout.numel, np.float32)
    m = np.zeros_like(g)
    w = merge_weights([600, 200])  # loss-bearing tokens per round: 2 steps x 300 and 2 x 100
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

    tape = read_tape(tmp_path / "syncer")
    merges = [e for e in tape if e["event"] == "merge"]
    assert [e["responders"] for e in merges] == [[0, 1]] * 3
    assert all(e["weights"] == pytest.approx([0.75, 0.25]) for e in merges)
    assert wait_until(lambda: syncer.finished) and syncer.exit_code == 0
    assert (tmp_path / "syncer" / "adapter" / "adapter_model.safetensors").is_file()


def raw_socket(port, identity=b"stranger"):
    s = zmq.Context.instance().socket(zmq.DEALER)
    s.setsockopt(zmq.ROUTING_ID, identity)
    s.setsockopt(zmq.LINGER, 0)
    s.connect(f"tcp://127.0.0.1:{port}")
    return s


def ask(sock, parts, timeout=3.0):
    sock.send_multipart(parts)
    assert sock.poll(int(timeout * 1000)), "the syncer did not answer"
    return decode(sock.recv_multipart())


def hello_parts(lid, state, backend="numpy"):
    layout = build_layout(state)
    descs, frames = encode_fragments(layout, flatten(layout, state), 32)
    return encode("hello", {"learner": lid, "backend": backend, "layout": layout.to_json(), "adapter_config": ADAPTER_CONFIG,
                            "version": -1, "fragments": descs}, frames), layout


def test_malformed_messages_are_answered_and_change_nothing(start_syncer, tmp_path):
    syncer, port = start_syncer(learners=1, quorum=1, outer_steps=1, inner_steps=1, sync_bits=32)
    s = raw_socket(port, b"learner-5")
    bad = [
        [b"\xff\xfe not json"],
        [json.dumps([1, 2]).encode()],
        [json.dumps({"v": 99, "type": "ping", "learner": 5}).encode()],
        [json.dumps({"v": 1, "type": "teleport"}).encode()],
        [json.dumps({"v": 1, "type": "delta", "learner": 5}).encode()],
        [json.dumps({"v": 1, "type": "hello", "learner": "five", "backend": "x", "layout": {}, "adapter_config": {},
                     "version": -1, "fragments": []}).encode()],
        encode("ping", {"learner": 5}),  # before hello
        encode("welcome", {"version": 0, "round": 0, "policy": {}, "fragments": []}),  # wrong direction
    ]
    for parts in bad:
        reply = ask(s, parts)
        assert reply.type == "error" and reply.header["reason"]
    state = QuadraticIsland(0.0, 1).state
    parts, layout = hello_parts(5, state)
    truncated = parts[:-1] + [parts[-1][:-4]]
    assert ask(s, truncated).type == "error"
    assert syncer.layout is None  # a bad hello did not define the run
    assert ask(s, parts).type == "welcome"
    rnd = decode(s.recv_multipart()) if s.poll(3000) else None
    assert rnd is not None and rnd.type == "round"
    # deltas with NaN, wrong size, wrong round, zero tokens: all refused, the global untouched
    before = syncer.global_.copy()
    nan = np.zeros(layout.numel, np.float32)
    nan[3] = np.nan
    base = {"round": 1, "base_version": 0, "tokens": 10, "loss_tokens": 5, "inner_steps": 1, "loss": 1.0, "learner": 5}
    frags = [{"index": 0, "numel": layout.numel, "bits": 32}]
    for header, payload in [
        (base, nan.tobytes()),
        (base, b"\0" * (4 * layout.numel - 4)),
        (dict(base, round=7), np.zeros(layout.numel, np.float32).tobytes()),
        (dict(base, loss_tokens=0), np.zeros(layout.numel, np.float32).tobytes()),
    ]:
        reply = ask(s, encode("delta", dict(header, fragments=frags), [payload]))
        assert reply.type == "error", reply
    np.testing.assert_array_equal(syncer.global_, before)
    assert syncer.version == 0 and not syncer.finished
    rejects = [e for e in read_tape(tmp_path / "syncer") if e["event"] == "reject"]
    assert len(rejects) >= len(bad) + 5
    assert any("non-finite" in e["reason"] for e in rejects)
    # and the run still works: a good delta is merged
    good = np.full(layout.numel, 0.01, np.float32)
    assert ask(s, encode("delta", dict(base, fragments=frags), [good.tobytes()])).type == "ack"
    deadline = time.time() + 5
    while not syncer.finished and time.time() < deadline:
        time.sleep(0.05)
    assert syncer.version == 1 and np.isfinite(syncer.global_).all()
    s.close()


def test_layout_mismatch_is_refused_naming_the_tensor(start_syncer):
    syncer, port = start_syncer(learners=2, quorum=1, outer_steps=1)
    a = raw_socket(port, b"learner-0")
    parts, _ = hello_parts(0, QuadraticIsland(0.0, 1).state)
    assert ask(a, parts).type == "welcome"
    b = raw_socket(port, b"learner-1")
    parts, _ = hello_parts(1, QuadraticIsland(0.0, 1, shape_b=(4, 3)).state)
    reply = ask(b, parts)
    assert reply.type == "refuse"
    assert NAMES[1] in reply.header["reason"] and "[4, 2]" in reply.header["reason"] and "[4, 3]" in reply.header["reason"]
    assert 1 not in syncer.members


def test_bridge_raises_a_clear_error_when_refused(start_syncer):
    syncer, port = start_syncer(learners=2, quorum=1, outer_steps=1)
    a = raw_socket(port, b"learner-0")
    parts, _ = hello_parts(0, QuadraticIsland(0.0, 1).state)
    assert ask(a, parts).type == "welcome"
    with pytest.raises(YetoError, match="refused this learner.*lora_B"):
        run_island(QuadraticIsland(0.0, 1, shape_b=(4, 3)), f"127.0.0.1:{port}", 1, log_fn=lambda s: None)


def test_a_round_short_of_quorum_waits_and_never_merges(start_syncer, tmp_path):
    syncer, port = start_syncer(learners=2, quorum=2, outer_steps=2, inner_steps=1, sync_bits=32, learner_timeout=1.0,
                                quorum_timeout=3.0)
    s0, s1 = raw_socket(port, b"learner-0"), raw_socket(port, b"learner-1")
    p0, layout = hello_parts(0, QuadraticIsland(0.0, 1).state)
    p1, _ = hello_parts(1, QuadraticIsland(0.0, 1).state)
    assert ask(s0, p0).type == "welcome" and ask(s1, p1).type == "welcome"
    frags = [{"index": 0, "numel": layout.numel, "bits": 32}]
    d = encode("delta", {"learner": 0, "round": 1, "base_version": 0, "tokens": 4, "loss_tokens": 2, "inner_steps": 1,
                         "loss": 0.5, "fragments": frags}, [np.ones(layout.numel, np.float32).tobytes()])
    s0.send_multipart(d)
    # learner 1 goes silent: it is dropped after 1 s, but one responder is still short of quorum 2
    deadline = time.time() + 6
    while not syncer.finished and time.time() < deadline:
        s0.send_multipart(encode("ping", {"learner": 0}))
        time.sleep(0.2)
    assert syncer.version == 0, "merged with fewer responders than the quorum"
    events = [e["event"] for e in read_tape(tmp_path / "syncer")]
    assert "merge" not in events and "leave" in events and "quorum_timeout" in events
    assert syncer.exit_code == 3


def test_islands_survive_a_syncer_restart(start_syncer, tmp_path):
    out = tmp_path / "syncer"
    syncer, port = start_syncer(learners=1, quorum=1, outer_steps=6, inner_steps=1, sync_bits=32, out=out)
    island = QuadraticIsland(1.0, 10, lr=0.1)
    results = {}
    orig_step = island.step

    def slow_step():
        time.sleep(0.15)
        return orig_step()

    island.step = slow_step
    t = island_thread(island, port, 0, results)
    deadline = time.time() + 10
    while syncer.version < 2 and time.time() < deadline:
        time.sleep(0.02)
    syncer.stop()  # the syncer goes away mid-run ...
    time.sleep(0.5)
    version_at_stop = syncer.version
    syncer2, _ = start_syncer(learners=1, quorum=1, outer_steps=6, inner_steps=1, sync_bits=32, out=out, port=port)
    assert syncer2.version == version_at_stop  # ... and comes back from its checkpoint
    t.join(40)
    assert isinstance(results.get(0), dict), results
    assert wait_until(lambda: syncer2.finished) and syncer2.version == 6
    events = read_tape(out)
    assert any(e["event"] == "resume" for e in events)
    joins = [e for e in events if e["event"] == "join"]
    assert len(joins) >= 2  # the island re-joined the restarted syncer


def test_time_window_rounds_weight_a_slow_island_by_its_tokens(start_syncer, tmp_path):
    syncer, port = start_syncer(learners=2, quorum=2, outer_steps=2, round_seconds=0.6, sync_bits=32)
    fast, slow = QuadraticIsland(1.0, 10, lr=0.1), QuadraticIsland(-1.0, 10, lr=0.1)
    results = {}
    threads = [island_thread(fast, port, 0, results, step_delay=0.02), island_thread(slow, port, 1, results, step_delay=0.2)]
    for t in threads:
        t.join(30)
    assert all(isinstance(r, dict) for r in results.values()), results
    events = read_tape(tmp_path / "syncer")
    deltas = {(e["round"], e["learner"]): e for e in events if e["event"] == "delta"}
    for m in (e for e in events if e["event"] == "merge"):
        f, s = deltas[(m["round"], 0)], deltas[(m["round"], 1)]
        assert f["inner_steps"] > 2 * s["inner_steps"] >= 2  # the slow island still contributes what it did
        assert m["weights"] == pytest.approx([f["loss_tokens"] / (f["loss_tokens"] + s["loss_tokens"]),
                                              s["loss_tokens"] / (f["loss_tokens"] + s["loss_tokens"])])
