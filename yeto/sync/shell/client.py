"""An island's link to the syncer: two DEALER connections served by an I/O thread, around `IslandCore`.

The I/O thread owns the sockets: it receives and sends, feeds the core every
message, every connection break (from ZeroMQ's socket monitor) and a timer tick,
and carries out what the core decides (send, reconnect after a backoff). So
heartbeats go out and the syncer's messages are handled whatever the training
thread is doing: a ten-minute inner step, or a delta uploading over a slow link,
never looks like a dead island or a dead syncer.

The training thread talks to the same core through `next_task`, `after_step`
and `push`, under one lock; its sends are queued for the I/O thread.

Connections: control (`island-<id>-<session>-<nonce>`: hello, pings, acks,
round announcements) and bulk (the same id plus `/bulk`: deltas, broadcasts,
states), so a heartbeat never waits behind an adapter on the same TCP stream.
Both are CURVE clients with the run's join key (`yeto.sync.shell.keys`); a handshake
the syncer refuses for the key ends the island with a line that says what to fix,
while a busy syncer's temporary refusal is retried (libzmq reconnects, with backoff).
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
from collections import deque
from dataclasses import replace
from typing import Callable, Optional

import numpy as np
import zmq
from zmq.utils.monitor import recv_monitor_message

from yeto import YetoError
from yeto.sync.core.checks import check_address
from yeto.sync.shell.gate import HANDSHAKE_IVL_MS, ZAP_TEMPORARY, curve_client
from yeto.sync.shell.keys import JOIN_KEY_ENV, JOIN_KEY_FILE, JoinKey
from yeto.sync.core.actions import IslandAction, Log, Out, Reconnect
from yeto.sync.core.island import Done, IslandCore, RoundCounts, Task, StepVerdict, Wait
from yeto.sync.wire.protocol import BULK_SUFFIX, ProtocolError, decode, encode, is_bulk, message_bytes

log = logging.getLogger("yeto.client")
IO_TICK_S = 0.05  # the I/O thread's poll timeout: timer resolution, and the longest a queued send waits
RECONNECT_IVL_MS = 200  # ZeroMQ's own reconnect interval after a TCP break (it reconnects by itself)
CLOSE_LINGER_MS = 2000  # on close, give the goodbye this long to leave
HANDSHAKE_FAILURES_TO_GIVE_UP = 5  # without a join key, handshake failures in a row before saying one is needed
CUT_HANDSHAKES_WARN_EVERY = 10  # cut handshakes (no answer saying why) are reported at 1, 10, 100, ... of them
ZMTP_MECHANISM_MISMATCH = 0x11000002  # ZMQ_PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH: one side secure, the other not
# A syncer that cannot read our key (another syncer's key) drops the handshake at once; one that is full answers
# ZAP 300, which CurveZMQ turns into a silent drop at the syncer's handshake timeout (libzmq 4.3 shows the client no
# HANDSHAKE_FAILED_AUTH for it, only for 400): a failure this long after connecting is a busy syncer, retried.
BUSY_AFTER_S = HANDSHAKE_IVL_MS / 1000 / 2
ZAP_TEMPORARY_STATUS = int(ZAP_TEMPORARY)  # the value of HANDSHAKE_FAILED_AUTH for a temporary refusal
MONITORED = (zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED | zmq.EVENT_HANDSHAKE_SUCCEEDED
             | zmq.EVENT_HANDSHAKE_FAILED_AUTH | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
             | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL)


def _is_power_of(n: int, base: int) -> bool:
    while n % base == 0:
        n //= base
    return n == 1


def parse_address(address: str) -> str:
    """'host:port' (or 'tcp://host:port') -> a ZeroMQ endpoint."""
    host, port = check_address(address)
    return f"tcp://{host}:{port}"


class SyncerLink:
    def __init__(self, address: str, core: IslandCore, log_fn: Callable[[str], None] = log.info,
                 join_key: Optional[JoinKey] = None):
        """`join_key`: the run's credentials (None: --insecure, a loopback syncer without security)."""
        self.endpoint = parse_address(address)
        self.join_key = join_key
        self.nonce = secrets.token_hex(8)  # in the routing id: a connection id nobody else can guess
        self.handshake_failures = 0
        self.welcomed = False  # a handshake succeeded once: this key is the run's, later failures are temporary
        self.busy_logged = False
        self.connected_at: dict[zmq.Socket, float] = {}  # monitor -> when its connection's TCP connect succeeded
        self.core = core
        self.log_fn = log_fn
        self.lock = threading.Lock()
        self.changed = threading.Condition(self.lock)
        self.outbox: deque[Out] = deque()  # sends decided on the training thread
        self.ctx = zmq.Context.instance()
        self.ctl: Optional[zmq.Socket] = None
        self.bulk: Optional[zmq.Socket] = None
        self.monitors: list[zmq.Socket] = []
        self.reconnect_at: Optional[float] = None
        self.stopping = False
        self.bytes_sent = 0
        self.bytes_received = 0
        self.thread = threading.Thread(target=self._run, name=f"yeto-link-{core.island_id}", daemon=True)

    # ------------------------------------------------------------------ the training thread's side

    def start(self) -> "SyncerLink":
        self.thread.start()
        return self

    def next_task(self, timeout_s: Optional[float] = None) -> Task:
        """Block until the core has something for the training loop (a round to train, or the end)."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        with self.changed:
            while True:
                task = self.core.next_task(time.monotonic())
                if isinstance(task, Done) and task.error and not self.core.refused:
                    return replace(task, reason=task.reason + self._unreachable_note())
                if not isinstance(task, Wait) or (deadline is not None and time.monotonic() >= deadline):
                    return task
                if not self.thread.is_alive():
                    raise YetoError("the link to the syncer stopped unexpectedly")
                self.changed.wait(IO_TICK_S)

    def after_step(self, steps_done: int, window_steps: Optional[int] = None) -> StepVerdict:
        with self.lock:
            return self.core.after_step(steps_done, time.monotonic(), window_steps)

    def carrying(self) -> bool:
        """A round's work is carried onto the next global, which has not come yet (StepVerdict.CARRY)."""
        with self.lock:
            if not self.thread.is_alive():
                raise YetoError("the link to the syncer stopped unexpectedly")
            return self.core.carrying

    def push(self, local: np.ndarray, counts: RoundCounts) -> int:
        """Queue the round's delta; returns its size on the wire (0 if the round was abandoned meanwhile)."""
        with self.lock:
            actions = self.core.push(local, counts)
            self._queue(actions)
        return sum(message_bytes(encode(a.type, a.header, a.frames)) for a in actions
                   if isinstance(a, Out) and a.type == "delta")

    def awaiting_merge(self) -> bool:
        """Our pushed delta has not been merged (nor refused) yet (for --overlap)."""
        with self.lock:
            c = self.core
            return c.pushed is not None and c.pushed.base_version == c.version and c.finish is None and not c.refused

    def latest_round_in_flight(self) -> int:
        """The latest round of our deltas in flight (0: none), while the run goes on (for --pipeline)."""
        with self.lock:
            c = self.core
            flying = c.in_flight()
            return max(p.round for p in flying) if flying and c.finish is None and not c.refused else 0

    def counted_residual(self) -> np.ndarray:
        """The error-feedback residual of the deltas that count: a delta still unsettled gives its part back."""
        with self.lock:
            return self.core.counted_residual()

    def take_given_back(self) -> set[int]:
        """The fragments whose latest push never counted, since the last call (the streamed start's references)."""
        with self.lock:
            return self.core.take_given_back()

    def global_flat(self) -> Optional[np.ndarray]:
        with self.lock:
            return None if self.core.global_ is None else self.core.global_.copy()

    def close(self, reason: str) -> None:
        """Say goodbye (if connected) and stop the I/O thread."""
        with self.lock:
            if self.core.connected:
                self._queue(self.core.leave(reason))
            self.stopping = True
        self.thread.join(timeout=CLOSE_LINGER_MS / 1000 + 5)

    def _queue(self, actions: list[IslandAction]) -> None:
        for a in actions:
            if isinstance(a, Out):
                self.outbox.append(a)
            elif isinstance(a, Log):
                self._log(a)

    def _log(self, a: Log) -> None:
        if a.level in ("warning", "error"):
            self.log_fn(f"{a.level}: {a.text}")
        else:
            self.log_fn(a.text)

    # ------------------------------------------------------------------ the I/O thread

    def _run(self) -> None:
        try:
            self._connect()
            with self.lock:
                self._do(self.core.connected_now(time.monotonic()))
            while True:
                with self.lock:
                    if self.stopping:
                        self._flush_outbox()
                        break
                if self.reconnect_at is not None and time.monotonic() >= self.reconnect_at:
                    self.reconnect_at = None
                    self._connect()
                    with self.lock:
                        self._do(self.core.connected_now(time.monotonic()))
                self._poll()
                with self.changed:
                    self._do(self.core.tick(time.monotonic()))
                    self._flush_outbox()
                    self.changed.notify_all()
        except Exception as e:  # never die silently: the training thread sees the thread gone and raises
            log.exception("the link's I/O thread failed")
            self.log_fn(f"error: the link to the syncer failed: {e!r}")
        finally:
            self._close_sockets(CLOSE_LINGER_MS)
            with self.changed:
                self.changed.notify_all()

    def _poll(self) -> None:
        if self.ctl is None:
            time.sleep(IO_TICK_S)
            return
        poller = zmq.Poller()
        for s in (self.ctl, self.bulk, *self.monitors):
            poller.register(s, zmq.POLLIN)
        ready = dict(poller.poll(int(IO_TICK_S * 1000)))
        for mon in self.monitors:
            if mon in ready:
                while mon.poll(0):
                    event = recv_monitor_message(mon)
                    now = time.monotonic()
                    if event["event"] == zmq.EVENT_CONNECTED:
                        self.connected_at[mon] = now
                    elif event["event"] == zmq.EVENT_DISCONNECTED:
                        with self.lock:  # (monitors in _connect's order: control, then bulk)
                            self._do(self.core.link_lost(now, bulk=mon is self.monitors[-1]))
                    else:
                        self._handshake(event["event"], event["value"], now - self.connected_at.get(mon, now))
        for sock in (self.ctl, self.bulk):
            if sock is None or sock not in ready:
                continue
            while True:
                try:
                    parts = sock.recv_multipart(flags=zmq.NOBLOCK)
                except zmq.Again:
                    break
                self.bytes_received += message_bytes(parts)
                try:
                    msg = decode(parts)
                except ProtocolError as e:
                    self.log_fn(f"warning: ignoring a malformed message from the syncer: {e}")
                    continue
                with self.changed:
                    self._do(self.core.receive(msg, time.monotonic()))
                    self.changed.notify_all()
                if self.ctl is None:  # the core asked to reconnect
                    return

    def _handshake(self, event: int, value: int, after_s: float) -> None:
        """A CURVE handshake's outcome, `after_s` after its connection was made: a refusal of the key ends the
        island with what to fix (lock taken here); a busy syncer is waited for (libzmq reconnects with backoff)."""
        if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
            self.handshake_failures = 0
            self.welcomed, self.busy_logged = True, False
            return
        where = self._where
        temporary = event == zmq.EVENT_HANDSHAKE_FAILED_AUTH and value == ZAP_TEMPORARY_STATUS
        unexplained = event != zmq.EVENT_HANDSHAKE_FAILED_AUTH and not (
            event == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL and value == ZMTP_MECHANISM_MISMATCH)
        if temporary or (unexplained and (self.welcomed or after_s >= BUSY_AFTER_S)):
            if not self.busy_logged:  # a key that worked, or a syncer that kept us waiting: busy, never a wrong key
                self.busy_logged = True
                self.log_fn(f"warning: {where} did not finish the handshake (busy, at its connection cap, or "
                            "restarting): retrying")
            return
        if event == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
            reason = (f"{where} refused this island's key (not this run's join key, or a revoked island key): pass "
                      f"the run's key with --join-key FILE or {JOIN_KEY_ENV} (the syncer writes <its --out>/"
                      f"{JOIN_KEY_FILE})")
        else:  # a plain island at a secure syncer sees a mechanism mismatch, or just its connection cut
            mismatch = event == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL and value == ZMTP_MECHANISM_MISMATCH
            self.handshake_failures += 1
            if not mismatch and self.handshake_failures < HANDSHAKE_FAILURES_TO_GIVE_UP:
                return
            if self.join_key is None:
                reason = (f"{where} requires a join key: pass --join-key FILE or {JOIN_KEY_ENV} (the syncer writes "
                          f"<its --out>/{JOIN_KEY_FILE})")
            elif mismatch:
                reason = (f"{where} runs without security (--insecure): start this island with --insecure too, or "
                          "the syncer without it")
            else:  # cut with no answer: the network, a stranger's sockets from our address crowding the syncer's
                # handshake cap (the shared-NAT case), or a key of another syncer. Nobody said which: retried, as
                # long as --give-up-after allows, and said when the island gives up (`next_task`)
                n = self.handshake_failures
                if _is_power_of(n, CUT_HANDSHAKES_WARN_EVERY):
                    self.log_fn(f"warning: {where} cut {n} handshake(s) before they finished, none finished yet "
                                "(the network, many connections from this address, or a join key made for another "
                                "syncer): retrying until --give-up-after")
                return
        with self.changed:
            self.core.link_refused(reason)
            self.stopping = True
            self.changed.notify_all()

    @property
    def _where(self) -> str:
        return f"the syncer at {self.endpoint.removeprefix('tcp://')}"

    def _unreachable_note(self) -> str:
        """What the island saw of a syncer it never reached, for its last line (no blame the syncer did not give)."""
        if self.welcomed or not self.handshake_failures or self.join_key is None:
            return ""
        where = self._where
        return (f" ({where} cut {self.handshake_failures} handshake(s) before they finished and none finished: if it "
                "is up and reachable, check that the join key is this run's (a join.key from another run names "
                "another syncer key))")

    def _do(self, actions: list[IslandAction]) -> None:
        """Carry out the core's actions (on the I/O thread, lock held)."""
        for a in actions:
            if isinstance(a, Out):
                self.outbox.append(a)
            elif isinstance(a, Reconnect):
                self.outbox.clear()  # what was queued goes with the old connections; the core re-sends what matters
                self._close_sockets(0)
                self.reconnect_at = time.monotonic() + a.delay_s
            elif isinstance(a, Log):
                self._log(a)
        self._flush_outbox()

    def _flush_outbox(self) -> None:
        while self.outbox and self.ctl is not None:
            a = self.outbox.popleft()
            parts = encode(a.type, a.header, a.frames)
            (self.bulk if is_bulk(a.type) else self.ctl).send_multipart(parts, copy=False)
            self.bytes_sent += message_bytes(parts)

    def _connect(self) -> None:
        ident = f"island-{self.core.island_id}-{self.core.session}-{self.nonce}".encode()
        socks = []
        for suffix in (b"", BULK_SUFFIX):
            s = self.ctx.socket(zmq.DEALER)
            if self.join_key is not None:
                curve_client(s, self.join_key)
            s.setsockopt(zmq.ROUTING_ID, ident + suffix)
            s.setsockopt(zmq.LINGER, CLOSE_LINGER_MS)
            s.setsockopt(zmq.RECONNECT_IVL, RECONNECT_IVL_MS)
            s.setsockopt(zmq.RECONNECT_IVL_MAX, int(self.core.t.backoff_max_s * 1000))
            self.monitors.append(s.get_monitor_socket(MONITORED))
            s.connect(self.endpoint)
            socks.append(s)
        self.ctl, self.bulk = socks

    def _close_sockets(self, linger_ms: int) -> None:
        for s in (self.ctl, self.bulk):
            if s is not None:
                try:
                    s.disable_monitor()
                except zmq.ZMQError:
                    pass
                s.close(linger=linger_ms)
        for m in self.monitors:
            m.close(linger=0)
        self.monitors = []
        self.connected_at.clear()
        self.ctl = self.bulk = None
