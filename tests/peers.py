"""Peers for tests against a real syncer on loopback: a numpy island, a hand-driven raw-protocol island.

`QuadraticIsland` is a real (numpy) `Island` whose expected merges can be computed
by hand; `RawIsland` speaks the wire protocol byte for byte over its two
connections (CURVE with a join key, or plain against an --insecure syncer).
"""

import threading
import time

import numpy as np
import zmq

from yeto.island.diloco import run_island
from yeto.sync.shell.gate import curve_client
from yeto.sync.shell.keys import JoinKey
from yeto.sync.core.contract import island_contract
from yeto.sync.core.island import LinkTimeouts
from yeto.sync.wire.layout import build_layout, flatten
from yeto.sync.wire.protocol import BULK_SUFFIX, decode, encode, encode_fragments
from yeto.sync.shell.tape import read_tape

NAMES = ["base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight",
         "base_model.model.model.layers.0.self_attn.q_proj.lora_B.default.weight"]
ADAPTER_CONFIG = {"peft_type": "LORA", "r": 2, "lora_alpha": 4, "target_modules": ["q_proj"], "task_type": "CAUSAL_LM"}
FAST = LinkTimeouts(heartbeat_s=0.2, dead_after_s=3.0, backoff_base_s=0.05, backoff_max_s=0.5)
SEND_TIMEOUT_MS = 10_000  # a send the syncer never lets through fails the test instead of hanging it


class QuadraticIsland:
    """A real (numpy) Island: each step moves the adapter toward its own target."""

    backend = "numpy"

    def __init__(self, target: float, loss_tokens: int, lr: float = 0.5, shape_b=(4, 2)):
        self.state = {NAMES[0]: np.zeros((2, 4), np.float32), NAMES[1]: np.zeros(shape_b, np.float32)}
        self.target, self.loss_tokens, self.lr = target, loss_tokens, lr
        self.step_count = 0
        self.horizons: list[int] = []  # the LR schedule's horizons the loop set, in order

    def adapter_state(self):
        return {k: v.copy() for k, v in self.state.items()}

    def load_adapter_state(self, state):
        self.state = {k: np.asarray(v, np.float32).copy() for k, v in state.items()}

    def step(self):
        for k in self.state:
            self.state[k] -= self.lr * (self.state[k] - self.target)
        self.step_count += 1
        loss = float(sum(((v - self.target) ** 2).mean() for v in self.state.values()))
        return {"loss": loss, "tokens": 2 * self.loss_tokens, "loss_tokens": self.loss_tokens}

    def adapter_config(self):
        return ADAPTER_CONFIG

    def record(self):  # declares at most 2 x loss_tokens tokens per step (its claims are checked against that)
        return {"backend": "numpy", "config": {"batch_size": 1, "seq_len": 2 * self.loss_tokens}}

    def set_total_steps(self, total):
        self.horizons.append(total)

    def use_shard(self, index, count):  # (no data to cut: every shard is the same target)
        pass


def wait_until(cond, timeout=10.0):
    deadline = time.time() + timeout
    while not cond() and time.time() < deadline:
        time.sleep(0.02)
    return cond()


def tape_with(out, event: str, timeout=10.0) -> list[dict]:
    """The tape once `event` is on it: the core changes state before its shell writes the record, so a test that
    saw the new version waits for the line too."""
    assert wait_until(lambda: any(e["event"] == event for e in read_tape(out)), timeout), f"no {event} on the tape"
    return read_tape(out)


class HeldIsland(QuadraticIsland):
    """Takes `steps_before` steps, then waits for `hold` (at most `hold_s`) before each next one: the run cannot finish
    before what the test does meanwhile (fill a disk, fuzz the port) is done, however fast the merges go."""

    def __init__(self, *args, steps_before: int, hold: threading.Event, hold_s: float = 60.0, **kwargs):
        super().__init__(*args, **kwargs)
        self.steps_before, self.hold, self.hold_s = steps_before, hold, hold_s

    def step(self):
        if self.step_count >= self.steps_before:
            self.hold.wait(self.hold_s)
        return super().step()


def island_thread(island, port, lid, results, log_fn=lambda s: None, **kw):
    def target():
        try:
            results[lid] = run_island(island, f"127.0.0.1:{port}", lid, log_fn=log_fn, timeouts=FAST, **kw)
        except Exception as e:  # surfaced by the test
            results[lid] = e

    t = threading.Thread(target=target, daemon=True)
    t.start()
    return t


class RawIsland:
    """A hand-driven island: its two connections and the messages it sends, byte for byte."""

    def __init__(self, port, lid, session="s1", key: JoinKey | None = None, identity=None, ident=None):
        self.lid, self.session = lid, session
        self.identity = identity or f"identity-of-island-{lid:04d}"
        self.key = key
        ident = ident or f"island-{lid}-{session}".encode()
        self.ctl = self._socket(port, ident)
        self.bulk = self._socket(port, ident + BULK_SUFFIX)

    def _socket(self, port, ident):
        s = zmq.Context.instance().socket(zmq.DEALER)
        if self.key is not None:
            curve_client(s, self.key)
        s.setsockopt(zmq.ROUTING_ID, ident)
        s.setsockopt(zmq.LINGER, 0)
        s.setsockopt(zmq.SNDTIMEO, SEND_TIMEOUT_MS)
        s.connect(f"tcp://127.0.0.1:{port}")
        return s

    def header(self, **h):
        return {"island": self.lid, "session": self.session, **h}

    def recv(self, timeout=3.0, want=None):
        """The next message on either connection (skipping pongs, and anything but `want` if given)."""
        deadline = time.time() + timeout
        poller = zmq.Poller()
        poller.register(self.ctl, zmq.POLLIN)
        poller.register(self.bulk, zmq.POLLIN)
        while time.time() < deadline:
            for sock, _ in poller.poll(50):
                msg = decode(sock.recv_multipart())
                if msg.type != "pong" and (want is None or msg.type == want):
                    return msg
        raise AssertionError(f"the syncer sent no {want or 'message'} within {timeout}s")

    def ask(self, parts, bulk=False, timeout=3.0, want=None):
        (self.bulk if bulk else self.ctl).send_multipart(parts)
        return self.recv(timeout, want)

    def hello_parts(self, state, adapter_config=ADAPTER_CONFIG, provenance=None, tokens_per_step=0):
        layout = build_layout(state)
        provenance = provenance or {}
        contract = island_contract(adapter_config, provenance, layout, tokens_per_step)
        return encode("hello", self.header(backend="numpy", layout=layout.to_json(), adapter_config=adapter_config,
                                           provenance=provenance, version=-1, digest="", identity=self.identity,
                                           contract=contract)), layout

    def found(self, state, timeout=3.0):
        """hello, then upload the initial adapter when asked; returns the layout. `timeout`: for the syncer's first
        answer (a syncer process just started may still be importing)."""
        parts, layout = self.hello_parts(state)
        req = self.ask(parts, timeout=timeout)
        assert req.type == "init_request", req
        descs, frames = encode_fragments(layout, flatten(layout, state), req.header["bits"])
        self.bulk.send_multipart(encode("init", self.header(fragments=descs), frames))
        assert self.recv(want="welcome").header["version"] == 0
        return layout

    def delta_parts(self, layout, rnd, base_version, flat, tokens=20, loss_tokens=10, steps=1, loss=1.0, bits=32,
                    **extra):
        descs, frames = encode_fragments(layout, flat, bits)
        return encode("delta", self.header(round=rnd, base_version=base_version, tokens=tokens, loss_tokens=loss_tokens,
                                           inner_steps=steps, loss=loss, fragments=descs, **extra), frames)

    def close(self):
        self.ctl.close()
        self.bulk.close()


