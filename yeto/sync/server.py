"""The syncer: a long-running ZeroMQ ROUTER that runs DiLoCo outer rounds.

It never loads a model: the first learner to join defines the adapter layout
and the initial adapter; after that the syncer only sees flat fp32 vectors.
Each round it collects deltas (with their loss-bearing token counts), and once
the round closes with at least `quorum` responders it merges them
token-weighted, applies the outer Nesterov step, broadcasts the change of the
global adapter (at `--sync-bits`, with error feedback), checkpoints, and opens
the next round. Everything it does goes on the event tape.

State that must survive a restart (global adapter, momentum, broadcast
residual, version, layout) lives in `state.safetensors`, written atomically
after every merge; membership is soft state that learners re-establish by
re-joining. A malformed or hostile message is answered with an error and
recorded; it never changes state or stops the server.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Annotated, Any, Optional

import numpy as np
import typer
import zmq

from yeto import YetoError
from yeto.adapter import write_adapter
from yeto.sync.layout import Layout, layout_from_json, layout_mismatch, unflatten
from yeto.sync.outer import outer_update
from yeto.sync.protocol import (MAX_MESSAGE_BYTES, Message, ProtocolError, decode, decode_fragments, encode,
                                encode_fragments, encode_fragments_ef, message_bytes)
from yeto.sync.quant import BITS, ErrorFeedback
from yeto.tape import Tape

log = logging.getLogger("yeto.syncer")
STATE_FILE = "state.safetensors"


@dataclass
class SyncerConfig:
    port: int = 29400
    host: str = "0.0.0.0"
    learners: int = 1
    quorum: int = 1
    outer_lr: float = 0.7
    outer_momentum: float = 0.9
    outer_steps: int = 10
    inner_steps: int = 50
    round_seconds: float = 0.0
    sync_bits: int = 4
    out: str = "runs/syncer"
    straggler_timeout: float = 120.0
    quorum_timeout: float = 1800.0
    learner_timeout: float = 60.0
    max_message_mb: int = MAX_MESSAGE_BYTES >> 20

    def check(self) -> None:
        if self.sync_bits not in BITS:
            raise YetoError(f"--sync-bits must be one of {BITS}, got {self.sync_bits}")
        if self.learners < 1 or self.quorum < 1:
            raise YetoError("--learners and --quorum must be at least 1")
        if self.quorum > self.learners:
            raise YetoError(f"--quorum {self.quorum} exceeds --learners {self.learners}: no round could ever close")
        if self.outer_steps < 1 or self.inner_steps < 1:
            raise YetoError("--outer-steps and --inner-steps must be at least 1")
        if self.round_seconds < 0:
            raise YetoError("--round-seconds must be >= 0 (0: rounds of --inner-steps steps)")

    def policy(self) -> dict[str, Any]:
        return {"inner_steps": self.inner_steps, "round_seconds": self.round_seconds, "outer_steps": self.outer_steps,
                "sync_bits": self.sync_bits, "quorum": self.quorum}


@dataclass
class Member:
    learner: int
    identity: bytes
    backend: str
    joined_round: int
    last_seen: float
    active: bool = True


@dataclass
class Delta:
    """What a merge needs of an accepted delta (the rest of it is on the tape)."""

    flat: np.ndarray
    loss_tokens: int


class Syncer:
    def __init__(self, cfg: SyncerConfig):
        cfg.check()
        self.cfg = cfg
        self.out = Path(cfg.out)
        self.out.mkdir(parents=True, exist_ok=True)
        self.tape = Tape(self.out)
        self.layout: Optional[Layout] = None
        self.adapter_config: dict[str, Any] = {}
        self.provenance: dict[str, Any] = {}
        self.global_: Optional[np.ndarray] = None
        self.momentum: Optional[np.ndarray] = None
        self.ef: Optional[ErrorFeedback] = None
        self.version = 0  # number of merges applied to the global adapter
        self.round = 0  # the open round (or the last closed one)
        self.round_open = False
        self.round_members: set[int] = set()
        self.pending: dict[int, Delta] = {}
        self.opened_at = 0.0
        self.quorum_at: Optional[float] = None
        self.last_wait_log = 0.0
        self.members: dict[int, Member] = {}
        self.finished = False
        self.stopping = False  # set by SIGINT/SIGTERM or stop(): leave the loop, tell learners
        self.started = False
        self.exit_code = 0
        self.sock: Optional[zmq.Socket] = None
        self._resume()

    # ------------------------------------------------------------------ state

    def _resume(self) -> None:
        path = self.out / STATE_FILE
        if not path.exists():
            return
        from safetensors import safe_open

        with safe_open(str(path), framework="numpy") as f:
            meta = f.metadata()
            self.global_ = f.get_tensor("global")
            self.momentum = f.get_tensor("momentum")
            residual = f.get_tensor("residual")
        self.layout = layout_from_json(json.loads(meta["layout"]))
        self.adapter_config = json.loads(meta["adapter_config"])
        self.provenance = json.loads(meta.get("provenance", "{}"))
        self.version = int(meta["version"])
        self.round = self.version
        self.ef = ErrorFeedback(self.layout.numel)
        self.ef.residual = residual
        self.tape.append("resume", version=self.version, fingerprint=self.layout.fingerprint)
        log.info("resumed from %s at version %d", path, self.version)

    def checkpoint(self) -> None:
        """Atomically write the state, then the global adapter as a peft directory."""
        from safetensors.numpy import save_file

        assert self.layout is not None and self.global_ is not None
        meta = {"version": str(self.version), "layout": json.dumps(self.layout.to_json()),
                "adapter_config": json.dumps(self.adapter_config), "provenance": json.dumps(self.provenance),
                "config": json.dumps(asdict(self.cfg))}
        tmp = self.out / f".{STATE_FILE}.tmp"
        save_file({"global": self.global_, "momentum": self.momentum, "residual": self.ef.residual}, str(tmp), metadata=meta)
        os.replace(tmp, self.out / STATE_FILE)
        adapter = write_adapter(self.out / "adapter", unflatten(self.layout, self.global_), self.adapter_config,
                                {**self.provenance, "syncer_version": self.version, "merged_by": "syncer"})
        self.tape.append("checkpoint", version=self.version, path=str(adapter))
        self.tape.sync()

    # ------------------------------------------------------------------ wire

    def send(self, identity: bytes, msg_type: str, header: dict[str, Any] | None = None, frames=()) -> int:
        parts = encode(msg_type, header, frames)
        try:
            self.sock.send_multipart([identity, *parts], flags=zmq.NOBLOCK)
        except zmq.Again:
            log.warning("send queue full for %r, dropped %s", identity, msg_type)
        return message_bytes(parts)

    def _active(self) -> list[Member]:
        return [m for m in self.members.values() if m.active]

    def serve(self) -> int:
        ctx = zmq.Context.instance()
        self.sock = ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.ROUTER_HANDOVER, 1)  # a reconnecting learner takes over its identity
        self.sock.setsockopt(zmq.MAXMSGSIZE, self.cfg.max_message_mb << 20)
        self.sock.setsockopt(zmq.LINGER, 5000)
        self.sock.setsockopt(zmq.SNDHWM, 100)
        try:
            self.sock.bind(f"tcp://{self.cfg.host}:{self.cfg.port}")
        except zmq.ZMQError as e:
            raise YetoError(f"cannot listen on {self.cfg.host}:{self.cfg.port}: {e}") from e
        self.tape.append("start", config=asdict(self.cfg), version=self.version)
        log.info("syncer listening on %s:%d, waiting for %d learner(s)", self.cfg.host, self.cfg.port, self.cfg.learners)
        def on_signal(signum, frame):
            self.stopping = True

        main = threading.current_thread() is threading.main_thread()
        old = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)} if main else {}
        poller = zmq.Poller()
        poller.register(self.sock, zmq.POLLIN)
        try:
            while not self.finished and not self.stopping:
                if poller.poll(100):
                    while True:
                        try:
                            parts = self.sock.recv_multipart(flags=zmq.NOBLOCK)
                        except zmq.Again:
                            break
                        self.handle(parts[0], parts[1:])
                self.tick()
            if self.stopping and not self.finished:
                # Learners are not told to finish: they keep reconnecting, so a restarted
                # syncer (same --out) picks the run up from its last checkpoint.
                self.tape.append("stop", reason="signal", version=self.version)
                self.exit_code = 130
        finally:
            for s, h in old.items():
                signal.signal(s, h)
            self.tape.sync()
            self.sock.close()
        return self.exit_code

    def stop(self) -> None:
        self.stopping = True

    def handle(self, identity: bytes, parts: list[bytes]) -> None:
        """Decode and dispatch one message; nothing a peer sends can raise out of here."""
        try:
            msg = decode(parts)
            getattr(self, f"on_{msg.type}", self.on_unexpected)(identity, msg)
        except ProtocolError as e:
            self.tape.append("reject", peer=identity.decode(errors="replace"), reason=str(e))
            self.send(identity, "error", {"reason": str(e)})
        except Exception as e:  # a bug must not take the fleet down: record it, answer, go on
            log.exception("handler failed")
            self.tape.append("reject", peer=identity.decode(errors="replace"), reason=f"internal error: {e!r}")
            self.send(identity, "error", {"reason": f"syncer could not process the message: {e}"})

    def on_unexpected(self, identity: bytes, msg: Message) -> None:
        raise ProtocolError(f"{msg.type} is a syncer-to-learner message")

    def _member(self, identity: bytes, msg: Message) -> Member:
        m = self.members.get(msg.header["learner"])
        if m is None or not m.active or m.identity != identity:
            raise ProtocolError(f"learner {msg.header['learner']} has not joined: send hello first")
        m.last_seen = time.monotonic()
        return m

    # ------------------------------------------------------------------ handlers

    def on_hello(self, identity: bytes, msg: Message) -> None:
        h = msg.header
        lid = h["learner"]
        if lid < 0:
            raise ProtocolError("learner id must be >= 0")
        try:
            layout = layout_from_json(h["layout"])
        except (KeyError, TypeError, ValueError) as e:
            raise ProtocolError(f"hello: malformed layout ({e})") from e
        if self.layout is None:
            init = decode_fragments(layout, msg)  # the first learner's adapter starts the run
            self.layout, self.global_ = layout, init
            self.momentum = np.zeros_like(init)
            self.ef = ErrorFeedback(layout.numel)
            self.adapter_config = h["adapter_config"]
            self.provenance = h.get("provenance") or {}
            self.tape.append("layout", learner=lid, fingerprint=layout.fingerprint, tensors=len(layout.specs),
                             numel=layout.numel, fragments=len(layout.fragments))
        else:
            problem = layout_mismatch(self.layout, layout)
            if problem:
                self.tape.append("refuse", learner=lid, backend=h["backend"], reason=problem)
                self.send(identity, "refuse", {"reason": f"adapter layout differs from the run's: {problem}"})
                log.warning("refused learner %d: %s", lid, problem)
                return
        old = self.members.get(lid)
        if old is not None and old.active and old.identity != identity:
            self.send(old.identity, "refuse", {"reason": f"learner id {lid} was taken over by a new connection"})
        joined = self.round + 1 if self.round_open else max(self.round, self.version) + 1
        self.members[lid] = Member(lid, identity, h["backend"], joined, time.monotonic())
        if old is not None and old.active:
            self.round_members.discard(lid)  # a re-join restarts this learner's round
            self.pending.pop(lid, None)
        descs, frames = encode_fragments(self.layout, self.global_, 32)
        sent = self.send(identity, "welcome", {"version": self.version, "round": self.round, "policy": self.cfg.policy(),
                                               "fragments": descs, "first_round": joined}, frames)
        self.tape.append("join", learner=lid, backend=h["backend"], first_round=joined, rejoin=old is not None,
                         learner_version=h["version"], bytes_out=sent)
        log.info("learner %d joined (%s), first round %d; %d active", lid, h["backend"], joined, len(self._active()))
        self.maybe_open()

    def on_delta(self, identity: bytes, msg: Message) -> None:
        m = self._member(identity, msg)
        h = msg.header
        if not self.round_open or h["round"] != self.round or h["base_version"] != self.version:
            reason = f"stale delta for round {h['round']} (base version {h['base_version']}); the syncer is at round " \
                     f"{self.round} ({'open' if self.round_open else 'closed'}), version {self.version}"
            self.tape.append("reject", learner=m.learner, round=h["round"], reason=reason)
            self.send(identity, "error", {"reason": reason, "stale": True, "round": h["round"]})
            return
        if m.learner not in self.round_members:
            raise ProtocolError(f"learner {m.learner} joined late: its first round is {m.joined_round}")
        if m.learner in self.pending:
            self.send(identity, "ack", {"round": self.round, "duplicate": True})
            return
        if h["loss_tokens"] <= 0 or h["tokens"] <= 0 or h["inner_steps"] <= 0:
            raise ProtocolError(f"delta with no training behind it (tokens {h['tokens']}, loss tokens {h['loss_tokens']}, steps {h['inner_steps']})")
        flat = decode_fragments(self.layout, msg)  # validates sizes, bits and finiteness
        self.pending[m.learner] = Delta(flat, h["loss_tokens"])
        self.tape.append("delta", learner=m.learner, round=self.round, tokens=h["tokens"], loss_tokens=h["loss_tokens"],
                         inner_steps=h["inner_steps"], bytes=msg.nbytes, norm=float(np.linalg.norm(flat)), loss=float(h["loss"]),
                         bits=msg.header["fragments"][0]["bits"] if msg.header["fragments"] else None)
        self.send(identity, "ack", {"round": self.round})
        self.maybe_close()

    def on_ping(self, identity: bytes, msg: Message) -> None:
        self._member(identity, msg)
        self.send(identity, "pong", {"version": self.version, "round": self.round})

    def on_sync(self, identity: bytes, msg: Message) -> None:
        self._member(identity, msg)
        descs, frames = encode_fragments(self.layout, self.global_, 32)
        self.send(identity, "state", {"version": self.version, "round": self.round, "fragments": descs}, frames)

    def on_leave(self, identity: bytes, msg: Message) -> None:
        m = self._member(identity, msg)
        self._drop(m, msg.header["reason"])

    def _drop(self, m: Member, reason: str) -> None:
        m.active = False
        if m.learner not in self.pending:
            self.round_members.discard(m.learner)
        self.tape.append("leave", learner=m.learner, reason=reason, round=self.round)
        log.info("learner %d left (%s); %d active", m.learner, reason, len(self._active()))
        self.maybe_close()

    # ------------------------------------------------------------------ rounds

    def tick(self) -> None:
        now = time.monotonic()
        for m in self._active():
            if now - m.last_seen > self.cfg.learner_timeout:
                self._drop(m, f"silent for {self.cfg.learner_timeout:.0f}s")
        self.maybe_close()

    def maybe_open(self) -> None:
        if self.round_open or self.finished or self.layout is None:
            return
        if self.version >= self.cfg.outer_steps:
            self.finish("outer steps done")
            return
        if not self.started and len(self._active()) < self.cfg.learners:
            return  # the first round (also after a restart) waits for --learners
        self.open_round(self.version + 1)

    def open_round(self, r: int) -> None:
        self.started = True
        self.round, self.round_open = r, True
        self.pending = {}
        self.opened_at = time.monotonic()
        self.quorum_at = None
        self.round_members = {m.learner for m in self._active() if m.joined_round <= r}
        header = {"round": r, "version": self.version, "inner_steps": self.cfg.inner_steps, "round_seconds": self.cfg.round_seconds}
        for m in self._active():
            if m.learner in self.round_members:
                self.send(m.identity, "round", header)
        self.tape.append("round_open", round=r, version=self.version, members=sorted(self.round_members))
        log.info("round %d open with learners %s", r, sorted(self.round_members))

    def maybe_close(self) -> None:
        if not self.round_open:
            return
        now = time.monotonic()
        responders = set(self.pending)
        waiting = {lid for lid in self.round_members - responders if self.members[lid].active}
        q = self.cfg.quorum
        if len(responders) >= q:
            if self.quorum_at is None:
                self.quorum_at = now
            window_over = self.cfg.round_seconds > 0 and now - self.opened_at > self.cfg.round_seconds + min(30.0, self.cfg.straggler_timeout)
            if not waiting or now - self.quorum_at > self.cfg.straggler_timeout or window_over:
                self.close_round(sorted(waiting))
            return
        if now - self.opened_at > self.cfg.quorum_timeout:
            msg = f"round {self.round} did not reach quorum {q} within {self.cfg.quorum_timeout:.0f}s ({len(responders)} responded)"
            self.tape.append("quorum_timeout", round=self.round, responders=sorted(responders), quorum=q)
            log.error(msg)
            self.finish(msg, code=3)
        elif len(responders) + len(waiting) < q and now - self.last_wait_log > 15:
            # short of quorum even if everyone still training answers: say so, loudly
            self.last_wait_log = now
            self.tape.append("quorum_wait", round=self.round, responders=sorted(responders), waiting=sorted(waiting), quorum=q)
            log.warning("round %d cannot reach quorum %d with the learners present (%d responded, waiting for %s); "
                        "waiting up to %.0fs more for learners to (re)join", self.round, q, len(responders),
                        sorted(waiting) or "none", self.cfg.quorum_timeout - (now - self.opened_at))
        elif now - self.last_wait_log > 60 and now - self.opened_at > 60:
            self.last_wait_log = now
            log.info("round %d: %d/%d responders so far, waiting for %s", self.round, len(responders), q, sorted(waiting))

    def close_round(self, stragglers: list[int]) -> None:
        t0 = time.perf_counter()
        ids = sorted(self.pending)
        ds = [self.pending[i] for i in ids]
        new_global, self.momentum, weights = outer_update(self.global_, self.momentum, [d.flat for d in ds],
                                                          [d.loss_tokens for d in ds], self.cfg.outer_lr, self.cfg.outer_momentum)
        descs, payloads, sent = encode_fragments_ef(self.layout, new_global - self.global_, self.cfg.sync_bits, self.ef)
        self.global_ = self.global_ + sent
        self.version += 1
        self.round_open = False
        merge_s = time.perf_counter() - t0
        self.tape.append("merge", round=self.round, version=self.version, responders=ids, weights=[float(w) for w in weights],
                         loss_tokens=[d.loss_tokens for d in ds], stragglers=stragglers, update_norm=float(np.linalg.norm(sent)),
                         seconds=round(merge_s, 6))
        header = {"version": self.version, "round": self.round, "responders": ids, "weights": [float(w) for w in weights], "fragments": descs}
        to, nbytes = [], 0
        for m in self._active():
            nbytes = self.send(m.identity, "broadcast", header, payloads)
            to.append(m.learner)
        self.tape.append("broadcast", round=self.round, version=self.version, to=to, bytes=nbytes, bits=self.cfg.sync_bits)
        log.info("round %d merged %s weights %s; version %d", self.round, ids, [round(float(w), 3) for w in weights], self.version)
        self.pending = {}
        self.checkpoint()
        self.maybe_open()

    def finish(self, reason: str, code: int = 0) -> None:
        for m in self._active():
            self.send(m.identity, "finish", {"version": self.version, "reason": reason})
        self.tape.append("finish", version=self.version, reason=reason, code=code)
        if self.global_ is not None and code == 0:
            self.checkpoint()
        self.finished = True
        self.exit_code = code


# ---------------------------------------------------------------------- CLI

_D = SyncerConfig()


def syncer_command(
    port: Annotated[int, typer.Option(help="TCP port to listen on.")] = _D.port,
    host: Annotated[str, typer.Option(help="Interface to bind (0.0.0.0: all; 127.0.0.1: this machine only).")] = _D.host,
    learners: Annotated[int, typer.Option(help="Wait until this many learners have joined before round 1.")] = _D.learners,
    quorum: Annotated[int, typer.Option(help="Never merge a round with fewer responders than this.")] = _D.quorum,
    outer_lr: Annotated[float, typer.Option(help="Outer (DiLoCo) learning rate.")] = _D.outer_lr,
    outer_momentum: Annotated[float, typer.Option(help="Outer Nesterov momentum.")] = _D.outer_momentum,
    outer_steps: Annotated[int, typer.Option(help="Merges to run; then every learner is told to finish.")] = _D.outer_steps,
    inner_steps: Annotated[int, typer.Option(help="Round policy: every learner does H inner steps per round.")] = _D.inner_steps,
    round_seconds: Annotated[float, typer.Option(help="Round policy: time windows of S seconds; each learner contributes what it did (overrides --inner-steps).")] = _D.round_seconds,
    sync_bits: Annotated[int, typer.Option(help="Wire precision of deltas and broadcasts: 4, 8, 16 or 32.")] = _D.sync_bits,
    out: Annotated[str, typer.Option(help="Directory for the tape, the state checkpoint and the merged adapter.")] = _D.out,
    straggler_timeout: Annotated[float, typer.Option(help="Once quorum is reached, wait at most this long for the remaining learners.")] = _D.straggler_timeout,
    quorum_timeout: Annotated[float, typer.Option(help="Give up (exit 3) if a round has not reached quorum after this many seconds.")] = _D.quorum_timeout,
    learner_timeout: Annotated[float, typer.Option(help="Drop a learner that has been silent this long.")] = _D.learner_timeout,
    max_message_mb: Annotated[int, typer.Option(help="Largest inbound message accepted (MiB).")] = _D.max_message_mb,
) -> None:
    """Run the syncer: wait for learners, run outer rounds, merge, broadcast, checkpoint."""
    cfg = SyncerConfig(**{k: v for k, v in locals().items() if k in SyncerConfig.__dataclass_fields__})
    logging.basicConfig(level=logging.INFO, format="%(asctime)s syncer %(levelname)s %(message)s", datefmt="%H:%M:%S")
    code = Syncer(cfg).serve()
    print(f"syncer: merged adapter {Path(cfg.out) / 'adapter'}, tape {Path(cfg.out) / 'tape.jsonl'}", flush=True)
    raise typer.Exit(code)


def main() -> None:
    from yeto.cli import run_typer

    run_typer(syncer_command)


if __name__ == "__main__":
    main()
