"""The syncer process: a thin I/O shell around `SyncerCore`.

It owns what the core must not: the ZeroMQ ROUTER socket, the clock, the disk
(`DiskStore`) and signals. Each message and each timer tick goes into the core;
the actions that come out are executed in order: durable writes first where the
core put them first, sends last. The core never sees a socket, so the same
logic runs here and in the simulator (`yeto.sync.sim`).

Security (docs/SECURITY.md): the socket is a CURVE server; every handshake is
answered by the `Gatekeeper` (ZAP) with the run's keys, so a peer without a
valid join key never gets a message to the core. Each message carries the
identity its connection proved (ZAP User-Id), which the core binds to island
ids. `--insecure` (no encryption, no authentication) is refused off loopback.

Delivery: the socket is `ROUTER_MANDATORY`, so a message to an island whose
pipe is full or not connected raises instead of vanishing; it is kept and
retried for a while, then dropped with a `send_dropped` event on the tape (the
island notices from versions and asks again). Adapter-carrying messages (broadcast,
state) are handed to ZeroMQ one at a time per island: the next waits here until
ZeroMQ has released the previous one (written to the kernel, a `MessageTracker`), so a
slow reader holds at most one adapter in ZeroMQ's queue and one waiting here, and a
newer global replaces an older one still waiting (`send_superseded` on the tape): a
slow reader catches up from the latest global, never from a queue of old versions.
The loop never blocks on one peer (every send is NOBLOCK). SIGINT/SIGTERM: checkpoint, tell
every island to finish (each saves its adapter), exit 130/143 (128 + the signal,
whenever it comes, the final linger included).

Disk failures are handled by what was being written, never by the exception's
type: derived data (the peft adapter) is recorded and survived; a failed write of
the run's state (tape, checkpoint, saved deltas) stops the syncer at once and
cleanly: nothing more is written or acknowledged, every island is told `finish`
with the reason, one error line names the path and its free space, and the exit
code is DISK_FAILED_EXIT. The checkpoint on disk stays whole: the same command
resumes once space is freed.
"""

from __future__ import annotations

import contextlib
import logging
import secrets
import shutil
import signal
import threading
import time
from dataclasses import asdict
from pathlib import Path
from typing import Callable, Optional

import zmq

from yeto import YetoError
from yeto.sync.core.checks import check_out_dir
from yeto.sync.shell.gate import Gatekeeper, curve_server
from yeto.sync.shell.keys import KEYS_EVENT, KEYS_RESCAN_S, Keyring, require_loopback
from yeto.sync.core.actions import (Action, ClearGivenUp, DropDeltas, Exit, Log, Record, SaveCheckpoint, SaveDelta,
                                    Send)
from yeto.sync.core.delivery import GLOBAL_TYPES, Delivery, Outgoing, Undeliverable
from yeto.sync.core.syncer import SyncerConfig, SyncerCore
from yeto.sync.shell.given_up import clear_given_up, read_given_up
from yeto.sync.wire.protocol import BULK_SUFFIX, MAX_HEADER_BYTES, encode, is_bulk, message_size
from yeto.sync.shell.store import PENDING_DIR, STATE_FILE, DiskStore
from yeto.sync.shell.tracking import MergeTracking
from yeto.report.trackers import Trackers

log = logging.getLogger("yeto.syncer")
TICK_S = 0.05  # timer resolution of the core (poll timeout)
SNDHWM = 64  # messages queued per island connection before ZeroMQ says "full" (and we keep them ourselves)
RCVHWM = 16  # inbound messages queued per connection: with the message size limit, what one peer can make us hold
LINGER_MS = 5000  # on exit, give queued messages (the finish) this long to leave
DISK_FAILED_EXIT = 74  # sysexits' EX_IOERR: the run's state could not be written (resumable once fixed)


class Syncer:
    """`Syncer(cfg).serve()` runs until the run finishes or a signal stops it; returns the exit code."""

    def __init__(self, cfg: SyncerConfig, before_checkpoint: Optional[Callable[[int], None]] = None):
        """`before_checkpoint(version)` runs before each checkpoint is written (the entry point's fault hook)."""
        cfg.check()
        check_out_dir(cfg.out)
        self.cfg = cfg
        self.before_checkpoint = before_checkpoint
        if cfg.insecure:
            require_loopback(cfg.host, "the syncer's --host")
            self.keys: Keyring | None = None
        else:
            self.keys = Keyring.ensure(cfg.out, cfg.join_key)
        self.store = DiskStore(cfg.out)
        durable = self.store.load()
        if self.keys is not None and cfg.island_keys and durable.checkpoint is None:  # (the run's first start)
            self.keys.issue_expected(cfg.islands)
        init = None
        if cfg.init_adapter and durable.checkpoint is None:  # (a resumed run has its version 0 already)
            from yeto.sync.shell.store import load_init_adapter

            init = load_init_adapter(cfg.init_adapter)
        self.core = SyncerCore(cfg, incarnation=secrets.token_hex(4), init=init)
        self._start_actions = self.core.start(time.monotonic(), durable)  # may refuse (config conflict)
        self.sock: zmq.Socket | None = None
        self.delivery = Delivery(self._hand_over, self._noted)  # the send rules (core.delivery), over ZeroMQ
        self.stopping: tuple[str, int] | None = None
        self.signals = 0
        self.killed = False
        self.kill_code = 137
        self.signal_code: Optional[int] = None  # 128 + the last signal received, whenever it came
        self.disk_failure: Optional[str] = None  # why the run's state could not be written (then the syncer stops)
        self.tracking: Optional[MergeTracking] = None  # --report-to's trackers (`report_to`)

    def report_to(self, trackers: Trackers) -> None:
        """Log every merge to `trackers` (yeto.report.trackers), with the run's config; they never hold up a merge."""
        self.tracking = MergeTracking(trackers)
        trackers.log_config({"syncer": asdict(self.cfg)})

    # views for tests and logs
    @property
    def version(self) -> int:
        return self.core.version

    @property
    def exit_code(self) -> int:
        """DISK_FAILED_EXIT if the run's state could not be written; 128+signal if a signal came (before, during or
        after the finish); else the core's exit code once the run ended; 0 while running."""
        if self.disk_failure is not None:
            return DISK_FAILED_EXIT
        if self.core.exit_code:
            return self.core.exit_code
        if self.signal_code is not None:  # (a signal after a complete run, during the final linger: still 128+sig)
            return self.signal_code
        if self.core.exit_code is not None:
            return 0
        return self.kill_code if self.killed else 0

    def queued_bytes(self, island: int) -> int:
        """Bytes this syncer holds for an island's connections: parked here, or handed to ZeroMQ and not sent."""
        prefix = f"island-{island}-".encode()
        return self.delivery.held_bytes(lambda dest: dest.startswith(prefix))

    @property
    def finished(self) -> bool:
        return self.core.done

    @property
    def global_(self):
        return self.core.run.global_ if self.core.run is not None else None

    def serve(self) -> int:
        ctx = zmq.Context()  # its own: the ZAP endpoint is per context, and tests run several syncers in a process
        self.sock = sock = ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # never drop silently: unroutable or full raises
        # an island reconnecting with its routing id takes over its old pipe; the id carries 64 random bits its
        # owner never sends in clear, and a message is only believed on the connection that said hello (the core)
        sock.setsockopt(zmq.ROUTER_HANDOVER, 1)
        self.max_message = self._message_limit()
        sock.setsockopt(zmq.MAXMSGSIZE, self.max_message)
        sock.setsockopt(zmq.SNDHWM, SNDHWM)
        sock.setsockopt(zmq.RCVHWM, RCVHWM)
        sock.setsockopt(zmq.LINGER, LINGER_MS)
        self.gate = None
        if self.keys is not None:
            curve_server(sock, self.keys)
            self.gate = Gatekeeper(ctx, self.keys, self.cfg.max_connections)
            self.gate.watch(sock)
            self._execute(self.core.set_keys(self.keys.bound_ids(), self.keys.revoked_principals(), time.monotonic()))
        try:
            sock.bind(f"tcp://{self.cfg.host}:{self.cfg.port}")
        except zmq.ZMQError as e:
            if self.gate is not None:
                self.gate.close()
            raise YetoError(f"cannot listen on {self.cfg.host}:{self.cfg.port}: {e}") from e
        log.info("syncer listening on %s:%d (incarnation %s; %s)", self.cfg.host, self.cfg.port,
                 self.core.incarnation, "INSECURE: no encryption, no authentication" if self.gate is None else
                 f"CURVE; {self.keys.who_joins_with_what(self.cfg.islands)}")
        old = {}
        if threading.current_thread() is threading.main_thread():  # (kept until the last message has left)
            old = {s: signal.signal(s, self._on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            self._serve_loop(sock)
        finally:
            if self.disk_failure is None:
                self._durable(self.store.out, self.store.close)
            else:
                with contextlib.suppress(Exception):  # (after a failure: a file handle to release, no state to keep)
                    self.store.close()
            sock.close(linger=0 if self.killed else LINGER_MS)
            if self.gate is not None:
                self.gate.close()
            ctx.term()
            for s, h in old.items():
                signal.signal(s, h)
            if self.tracking is not None:
                self.tracking.finish()
        return self.exit_code

    def _serve_loop(self, sock: zmq.Socket) -> None:
        self._execute(self._start_actions)
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        for s in self.gate.sockets() if self.gate is not None else []:
            poller.register(s, zmq.POLLIN)
        next_tick = next_scan = 0.0
        while not self.core.done and not self.killed:
            ready = dict(poller.poll(int(TICK_S * 1000)))
            now = time.monotonic()
            if self.gate is not None:
                self.gate.handle(now)  # (handshakes first: an island's hello waits on its ZAP answer)
                self._record_refusals()
            if now >= next_scan:
                next_scan = now + KEYS_RESCAN_S
                if self.keys is not None and self.keys.rescan():
                    self._execute(self.core.set_keys(self.keys.bound_ids(), self.keys.revoked_principals(), now))
                    self._append(KEYS_EVENT, self.keys.summary())  # (`yeto keys add/revoke` waits for it)
                given_up = read_given_up(self.cfg.out)
                if given_up.keys() - self.core.given_up.keys():
                    self._execute(self.core.give_up(given_up, now))
            if sock in ready:
                self._drain()
            now = time.monotonic()
            if self.stopping is not None:
                reason, code = self.stopping
                self.stopping = None
                self._execute(self.core.stop(now, reason, code))
            if now >= next_tick:
                next_tick = now + TICK_S
                self._run_timed(self.core.tick)
                limit = self._message_limit()
                if limit != self.max_message:  # the run is founded: its layout bounds every message
                    self.max_message = limit
                    sock.setsockopt(zmq.MAXMSGSIZE, limit)  # (for connections made from now on)
            self.delivery.retry(now)

    def _message_limit(self) -> int:
        """--max-message-mb until the run's layout is known; then what its largest message can be (a delta, or a
        hello, whose header alone may take MAX_HEADER_BYTES)."""
        run = self.core.run
        limit = self.cfg.max_message_mb << 20
        return limit if run is None else min(limit, max(message_size(run.layout, self.cfg.sync_bits),
                                                        MAX_HEADER_BYTES))

    def _record_refusals(self) -> None:
        refused, more = self.gate.drain()
        for r in refused:
            if r.address:  # refused by the gatekeeper (ZAP): the peer's address is known
                self._append("auth_refused", {"address": r.address, "reason": r.reason})
            else:  # refused by libzmq before any key was shown
                self._append("handshake_failed", {"reason": r.reason})
            log.warning("refused a connection from %s: %s", r.address or "a peer", r.reason)
        if more:
            self._append("auth_refused_more", {"count": more})

    # ------------------------------------------------------------------ the disk

    def _append(self, event: str, fields: dict) -> None:
        self._durable(self.store.tape.path, lambda: self.store.append(event, fields))
        if self.tracking is not None:
            self.tracking.on_event(event, fields)

    def _durable(self, path: Path, write: Callable[[], object]) -> bool:
        """Write the run's state; on any failure (a full disk raises OSError from a file, SafetensorError from
        safetensors, ...) stop the syncer cleanly instead of running on with state it cannot keep. False if it
        failed (now or before: nothing is written after a failure)."""
        if self.disk_failure is not None:
            return False
        try:
            write()
            return True
        except Exception as e:  # (by what was written, not by type: see the module docstring)
            self._disk_failed(path, e)
            return False

    def _disk_failed(self, path: Path, error: Exception) -> None:
        try:
            free = f"{shutil.disk_usage(Path(path).parent if not Path(path).is_dir() else path).free / 2**20:.1f} MiB"
        except OSError:
            free = "unknown"
        self.disk_failure = (f"could not write {path} ({type(error).__name__}: {str(error)[:200]}); {free} free on "
                             "its disk. Free space (or fix the disk), then restart with the same --out: the run "
                             "resumes from its last checkpoint")
        log.error("%s", self.disk_failure)
        if self.stopping is None:
            self.stopping = ("the syncer could not write its state (disk full?); it stops, resumable",
                             DISK_FAILED_EXIT)

    def _on_signal(self, signum: int, frame) -> None:
        self.signal_code = 128 + signum
        self.signals += 1
        if self.signals > 1:
            self.killed = True  # a second signal: leave now, without waiting for goodbyes
            self.kill_code = 128 + signum
        self.stopping = (signal.Signals(signum).name, 128 + signum)

    def stop(self) -> None:
        """Stop as on SIGTERM (checkpoint, finish every island); thread-safe."""
        self.stopping = ("stop", 143)

    def kill(self) -> None:
        """Vanish as on SIGKILL: no goodbye, nothing flushed (tests)."""
        self.killed = True

    def _drain(self) -> None:
        while not self.killed:
            try:
                frames = self.sock.recv_multipart(flags=zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            principal = frames[0].get("User-Id") if self.gate is not None else None  # what its handshake proved
            ident, payload = frames[0].bytes, [f.bytes for f in frames[1:]]
            peer = ident.removesuffix(BULK_SUFFIX).decode(errors="replace")
            self._run_timed(lambda now: self.core.receive(peer, payload, now, principal))

    # ------------------------------------------------------------------ actions

    def _run_timed(self, event: Callable[[float], list[Action]]) -> None:
        """Handle one event; when it merged a round, tell the core how long that took (checkpoint and sends
        included): its grace after quorum leaves the merge that much room."""
        t = time.monotonic()
        actions = event(t)
        self._execute(actions)
        if any(isinstance(a, Record) and a.event == "merge" for a in actions):
            seconds = time.monotonic() - t
            self.core.observe_merge(seconds)
            if self.tracking is not None:
                self.tracking.merged(seconds)

    def _execute(self, actions: list[Action]) -> None:
        """The core's actions in order. Once the run's state could not be written, the rest of that batch is
        dropped (no ack for a delta that is not saved) and later batches only log and say `finish` (no version the
        disk does not hold reaches an island)."""
        failed_before = self.disk_failure is not None
        for a in actions:
            if self.disk_failure is not None and not (failed_before and (
                    isinstance(a, (Log, Exit)) or (isinstance(a, Send) and a.type == "finish"))):
                continue
            if isinstance(a, Send):
                dest = a.peer.encode() + (BULK_SUFFIX if is_bulk(a.type) else b"")
                version = a.header.get("version", -1) if a.type in GLOBAL_TYPES else -1
                parts = encode(a.type, a.header, a.frames)
                self.delivery.send(Outgoing(dest, parts, time.monotonic(), a.type, version))
            elif isinstance(a, Record):
                self._append(a.event, a.fields)
            elif isinstance(a, SaveCheckpoint):
                if self.before_checkpoint is not None:
                    self.before_checkpoint(a.checkpoint.version)
                if self._durable(self.store.out / STATE_FILE, lambda: self.store.save_checkpoint(a.checkpoint)):
                    self._write_adapter(a.checkpoint)
            elif isinstance(a, SaveDelta):
                self._durable(self.store.delta_path(a.delta.round, a.delta.island),
                              lambda: self.store.save_delta(a.delta))
            elif isinstance(a, DropDeltas):
                self._durable(self.store.out / PENDING_DIR,
                              lambda: self.store.drop_deltas(a.through_round, a.round, a.island))
            elif isinstance(a, ClearGivenUp):
                clear_given_up(self.cfg.out, a.island)
            elif isinstance(a, Log):
                getattr(log, a.level)(a.text)
            elif isinstance(a, Exit):
                self._durable(self.store.tape.path, self.store.tape.sync)

    def _write_adapter(self, ck) -> None:
        """The peft adapter is derived from the checkpoint: a failure to write it is recorded and survived."""
        try:
            self.store.write_adapter(ck)
        except Exception as e:  # (any: a full disk raises SafetensorError from safetensors, not OSError)
            log.warning("could not write the merged adapter of version %d: %s", ck.version, e)
            self._append("adapter_write_failed", {"version": ck.version, "reason": f"{type(e).__name__}: "
                                                                              f"{str(e)[:300]}"})

    def _hand_over(self, p: Outgoing) -> Optional[Callable[[], bool]]:
        """Send now (NOBLOCK); an adapter-carrying message is tracked until ZeroMQ has written it out."""
        try:
            if not is_bulk(p.type):
                self.sock.send_multipart([p.dest, *p.parts], flags=zmq.NOBLOCK, copy=False)
                return None
            frames = [zmq.Frame(part, track=True) for part in p.parts]  # (not copied; released once written)
            self.sock.send_multipart([p.dest, *frames], flags=zmq.NOBLOCK, copy=False)
            tracker = zmq.MessageTracker(*frames)
            return lambda: tracker.done
        except zmq.ZMQError as e:  # EAGAIN: its pipe is full; EHOSTUNREACH: not connected (yet, or any more)
            if e.errno == zmq.EHOSTUNREACH:
                raise Undeliverable("not connected") from e
            if e.errno == zmq.EAGAIN:
                raise Undeliverable("its connection is full") from e
            raise

    def _noted(self, event: str, fields: dict) -> None:
        """The send rules' news, on the tape (a dropped message is worth a warning: its island catches up)."""
        if event != "send_dropped":
            self._append(event, fields)
            return
        self.store.append(event, fields)
        log.warning("dropped a %s to %s (%s); the island catches up from versions", fields["type"], fields["peer"],
                    fields["reason"])
