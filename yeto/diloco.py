"""The DiLoCo bridge: where every backend meets the syncer.

A backend (torch + peft, MLX, ...) only has to offer an `Island`: its adapter
as a `{canonical peft name: fp32 numpy array}` view, a way to load such a view
back, and one inner optimizer step. The bridge does the rest: join with the
layout fingerprint, compute the pseudo-gradient against the last global
adapter, quantize it with error feedback, push it, apply broadcasts, survive
syncer restarts and dropped connections, and keep the inner AdamW state across
rounds (it never touches the optimizer).

Overlap (`overlap=True`): after pushing round r's delta the island keeps
training instead of waiting; when round r's merged adapter arrives, the
progress made since the push is kept on top of it (θ ← g_r + (θ − θ_push)),
as in one-step-delayed / streaming DiLoCo. Those steps count toward round r+1.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Protocol

import numpy as np

from yeto import YetoError
from yeto.sync.client import SyncerClient
from yeto.sync.layout import DEFAULT_FRAGMENT_NUMEL, Layout, build_layout, flatten, unflatten
from yeto.sync.protocol import Message, decode_fragments, encode_fragments, encode_fragments_ef
from yeto.sync.quant import ErrorFeedback

log = logging.getLogger("yeto.diloco")


class Island(Protocol):
    backend: str

    def adapter_state(self) -> dict[str, np.ndarray]: ...
    def load_adapter_state(self, state: dict[str, np.ndarray]) -> None: ...
    def step(self) -> dict[str, Any]: ...
    def adapter_config(self) -> dict[str, Any]: ...
    def record(self) -> dict[str, Any]: ...
    def set_total_steps(self, total: int) -> None: ...


class Finished(Exception):
    """The syncer said the run is over."""


@dataclass
class RoundStats:
    round: int
    steps: int = 0
    tokens: int = 0
    loss_tokens: int = 0
    loss_sum: float = 0.0
    compute_s: float = 0.0

    def add(self, s: dict[str, Any], dt: float) -> None:
        self.steps += 1
        self.tokens += s["tokens"]
        self.loss_tokens += s["loss_tokens"]
        self.loss_sum += s["loss"] * s["loss_tokens"]
        self.compute_s += dt

    @property
    def loss(self) -> float:
        return self.loss_sum / max(1, self.loss_tokens)


@dataclass
class BridgeStats:
    rounds: int = 0
    compute_s: float = 0.0
    stall_s: float = 0.0  # wall time the inner loop spent waiting on the syncer
    bytes_sent: int = 0
    bytes_received: int = 0
    delta_bytes: list[int] = field(default_factory=list)


class DiLoCoBridge:
    def __init__(self, client: SyncerClient, backend: str, fragment_numel: int = DEFAULT_FRAGMENT_NUMEL,
                 log_fn: Callable[[str], None] = log.info):
        self.client = client
        self.backend = backend
        self.fragment_numel = fragment_numel
        self.log = log_fn
        self.layout: Optional[Layout] = None
        self.global_: Optional[np.ndarray] = None
        self.version = -1
        self.policy: dict[str, Any] = {}
        self.ef: Optional[ErrorFeedback] = None
        self.open_round: Optional[dict[str, Any]] = None  # the latest 'round' message not yet trained
        self.finish: Optional[dict[str, Any]] = None
        self.joined = False
        self._hello_args: tuple = ()
        self._residual_before_push: Optional[np.ndarray] = None
        self._last_push: Optional[tuple[int, int, dict[str, Any], list[bytes]]] = None
        self.stats = BridgeStats()

    # ------------------------------------------------------------------ joining

    def join(self, state: dict[str, np.ndarray], adapter_config: dict[str, Any], provenance: dict[str, Any],
             timeout_s: float = 600.0) -> dict[str, np.ndarray]:
        """Say hello (layout + our initial adapter); return the run's global adapter to load."""
        self.layout = build_layout(state, self.fragment_numel)
        self.ef = ErrorFeedback(self.layout.numel)
        self._hello_args = (flatten(self.layout, state), adapter_config, provenance)
        self._hello()
        deadline = time.monotonic() + timeout_s
        while not self.joined:
            if time.monotonic() > deadline:
                raise YetoError(f"no answer from the syncer at {self.client.endpoint} within {timeout_s:.0f}s")
            self.pump(self.client.heartbeat_s)
            if not self.joined and self.client.peer_dead:
                self.client.reconnect()
                self._hello()
        return unflatten(self.layout, self.global_)

    def _hello(self) -> None:
        flat, adapter_config, provenance = self._hello_args
        descs, frames = encode_fragments(self.layout, flat, 32)
        self.client.send("hello", {"backend": self.backend, "layout": self.layout.to_json(), "adapter_config": adapter_config,
                                   "version": self.version, "fragments": descs, "provenance": provenance}, frames)

    # ------------------------------------------------------------------ messages

    def pump(self, timeout_s: float) -> bool:
        """Handle at most the messages that arrive within `timeout_s`; True if any did."""
        msg = self.client.recv(timeout_s)
        if msg is None:
            if self.joined and self.client.peer_dead:
                self._recover()
            return False
        self._dispatch(msg)
        while True:  # drain what is already queued
            more = self.client.recv(0)
            if more is None:
                return True
            self._dispatch(more)

    def _recover(self) -> None:
        """The syncer went silent (restart, network): reconnect with backoff and join again."""
        self.joined = False
        self.client.reconnect()
        self._hello()

    def _dispatch(self, msg: Message) -> None:
        h = msg.header
        if msg.type == "welcome":
            self.global_ = decode_fragments(self.layout, msg)
            self.version = h["version"]
            self.policy = h["policy"]
            self.joined = True
            self.log(f"joined syncer at version {self.version}; first round {h.get('first_round')}; policy {self.policy}")
        elif msg.type == "refuse":
            raise YetoError(f"the syncer refused this learner: {h['reason']}")
        elif msg.type == "round":
            last = self._last_push
            if last is not None and h["round"] == last[0] and h["version"] == last[1] == self.version:
                # the syncer re-opened the round we already pushed (it restarted): send it again
                self.client.send("delta", last[2], last[3])
                return
            self.open_round = h
            if h["version"] != self.version:  # we missed a broadcast: ask for the full state
                self.client.send("sync")
        elif msg.type == "broadcast":
            if h["version"] == self.version + 1:
                update = decode_fragments(self.layout, msg)
                self.global_ = self.global_ + update
                self.version = h["version"]
            elif h["version"] > self.version + 1:
                self.client.send("sync")
        elif msg.type == "state":
            self.global_ = decode_fragments(self.layout, msg)
            self.version = h["version"]
        elif msg.type == "finish":
            self.finish = h
        elif msg.type == "error":
            reason = h["reason"]
            if h.get("stale"):
                if self._residual_before_push is not None:
                    self.ef.residual = self._residual_before_push  # that payload never counted
            elif "has not joined" in reason and self.joined:
                self.joined = False
                self._hello()
            else:
                self.log(f"syncer error: {reason}")
        # ack and pong carry nothing the bridge needs: any message proves the syncer alive

    # ------------------------------------------------------------------ rounds

    def next_round(self) -> dict[str, Any]:
        """Block until a round opens for us (raises Finished when the run is over)."""
        t0 = time.perf_counter()
        while True:
            if self.finish is not None:
                raise Finished(self.finish["reason"])
            r = self.open_round
            if r is not None and r["version"] == self.version and self.joined:
                self.open_round = None
                self.stats.stall_s += time.perf_counter() - t0
                return r
            self.pump(self.client.heartbeat_s)

    def push(self, state: dict[str, np.ndarray], rnd: RoundStats, base_version: int) -> np.ndarray:
        """Send this round's pseudo-gradient (local minus global), quantized with error feedback;
        returns the flat local adapter it was computed from."""
        local = flatten(self.layout, state)
        bits = int(self.policy.get("sync_bits", 4))
        self._residual_before_push = self.ef.residual.copy()
        descs, payloads, _ = encode_fragments_ef(self.layout, local - self.global_, bits, self.ef)
        header = {"round": rnd.round, "base_version": base_version, "tokens": rnd.tokens, "loss_tokens": rnd.loss_tokens,
                  "inner_steps": rnd.steps, "loss": rnd.loss, "compute_s": round(rnd.compute_s, 4), "fragments": descs}
        self._last_push = (rnd.round, base_version, header, payloads)
        n = self.client.send("delta", header, payloads)
        self.stats.delta_bytes.append(n)
        return local

    def merged(self, base_version: int) -> bool:
        """True once the global adapter has moved past the version our delta was computed on
        (our delta merged, or the round closed without it)."""
        return self.version > base_version

    def wait_merged(self, base_version: int) -> None:
        t0 = time.perf_counter()
        while not self.merged(base_version):
            if self.finish is not None and self.finish["version"] <= self.version:
                break
            self.pump(self.client.heartbeat_s)
        self.stats.stall_s += time.perf_counter() - t0

    def global_state(self) -> dict[str, np.ndarray]:
        return unflatten(self.layout, self.global_)

    def leave(self, reason: str) -> None:
        try:
            self.client.send("leave", {"reason": reason})
        finally:
            self.client.close()


def inner_step(island: Island, rnd: RoundStats, bridge: DiLoCoBridge, step_delay: float = 0.0) -> None:
    t = time.perf_counter()
    s = island.step()
    if step_delay:
        time.sleep(step_delay)  # a simulated slow island: the delay counts as its compute
    dt = time.perf_counter() - t
    rnd.add(s, dt)
    bridge.stats.compute_s += dt


def run_island(island: Island, syncer: str, learner_id: int, overlap: bool = False,
               progress: Callable[[dict[str, Any]], None] | None = None, log_fn: Callable[[str], None] = print,
               client_kwargs: dict[str, Any] | None = None, max_inner_steps: int = 0, step_delay: float = 0.0) -> dict[str, Any]:
    """Train `island` as one DiLoCo island of the run at `syncer` until the syncer says finish."""
    client = SyncerClient(syncer, learner_id, **(client_kwargs or {}))
    bridge = DiLoCoBridge(client, island.backend, log_fn=log_fn)
    t_start = None  # utilization is measured from the first round on (not the wait for others to join)
    island.load_adapter_state(bridge.join(island.adapter_state(), island.adapter_config(), island.record()))
    policy = bridge.policy
    if not policy.get("round_seconds"):
        island.set_total_steps(int(policy["outer_steps"]) * int(policy["inner_steps"]))
    carry: Optional[RoundStats] = None  # overlapped steps that belong to the next round
    rounds_done = 0
    try:
        while True:
            header = bridge.next_round()
            if t_start is None:
                t_start = time.perf_counter()
                bridge.stats.stall_s = 0.0
            r, base = header["round"], header["version"]
            rnd = carry if carry is not None else RoundStats(r)
            rnd.round, carry = r, None
            t_open = time.monotonic()

            def round_over() -> bool:
                if max_inner_steps and rnd.steps >= max_inner_steps:
                    return True
                if header["round_seconds"]:
                    return rnd.steps >= 1 and time.monotonic() - t_open >= header["round_seconds"]
                return rnd.steps >= header["inner_steps"]

            while not round_over():
                inner_step(island, rnd, bridge, step_delay)
                bridge.pump(0)  # heartbeats, and notice a finish or a restart early
                if bridge.finish is not None:
                    raise Finished(bridge.finish["reason"])
            pushed = bridge.push(island.adapter_state(), rnd, base)
            if progress:
                progress({"round": r, "steps": rnd.steps, "loss": rnd.loss, "tokens": rnd.tokens})
            if overlap:
                nxt = RoundStats(r + 1)
                limit = max_inner_steps or (header["inner_steps"] if not header["round_seconds"] else 10**9)
                while not bridge.merged(base) and nxt.steps < limit and bridge.finish is None:
                    inner_step(island, rnd=nxt, bridge=bridge, step_delay=step_delay)
                    bridge.pump(0)
                bridge.wait_merged(base)
                progress_since_push = flatten(bridge.layout, island.adapter_state()) - pushed
                island.load_adapter_state(unflatten(bridge.layout, bridge.global_ + progress_since_push))
                carry = nxt if nxt.steps else None
            else:
                bridge.wait_merged(base)
                island.load_adapter_state(bridge.global_state())
            rounds_done += 1
    except Finished as f:
        log_fn(f"syncer finished the run: {f}")
        island.load_adapter_state(bridge.global_state())  # end on the merged global adapter
    except KeyboardInterrupt:
        bridge.leave("interrupted")
        raise
    wall = time.perf_counter() - t_start if t_start is not None else 0.0
    try:
        bridge.leave("done")
    except Exception:
        pass
    return {
        "rounds": rounds_done,
        "version": bridge.version,
        "wall_s": wall,
        "compute_s": bridge.stats.compute_s,
        "stall_s": bridge.stats.stall_s,
        "utilization": bridge.stats.compute_s / wall if wall else 0.0,
        "bytes_sent": client.bytes_sent,
        "bytes_received": client.bytes_received,
        "delta_bytes": bridge.stats.delta_bytes,
    }
