"""The syncer's core: rounds, membership, quorum, merges and recovery as a deterministic state machine.

This module is the event dispatcher, and the driver of the open round. Events in: `start(now, durable)` (a process
start, with whatever survived on disk), `receive(peer, parts, now)` (a message from an island's connection),
`tick(now)` (a timer), `stop(now, ...)` (a signal), `set_keys` and `give_up` (the run's keys and the fleet controller
changed). Actions out: `Send`, `Record` (append to the tape), `SaveCheckpoint`, `SaveDelta`, `DropDeltas`, `Log` and
`Exit`. The shell executes them in order; every durable action makes the tape durable first, so the tape is never
behind the disk. `SyncerCore` owns the run's state (`state.SyncerState`) and one object per concern, each in its own
module and each handed the state, the outbox and only the collaborators it calls: `admission` (hello, identity,
founding), `deltas` (a delta's intake), `merging` (the merge transaction), `recovery` (the start) and `driver` (the
open round's opening, closing and the finish, by the pure rules of `rounds`). Every message goes to its handler
through one table (`SyncerCore._handlers`); `config` holds the flags and their checks.

The round protocol, in the terms used below:
- Round r trains from global version r-1 and, once merged, produces version r.
- A round's expected members are the live members (plus, right after a
  restart, members that were known before it for one `--island-timeout`).
  It closes when quorum responded and either nobody else is expected, or the
  grace after quorum passed: the time until the last expected member's predicted
  push (its last push plus its observed round time), counting only those
  predicted within the cap (`--grace`, less the time merges take, at most
  `--straggler-timeout`); a member not yet measured is waited for up to the cap.
- A delta trained from an older version (the global moved on while it trained)
  is merged in the round open when it arrives, if its base is at most
  `--max-base-lag` versions back (and is the run's, not one rolled back),
  scaled by (1 + lag)^-`--staleness-exponent`. A round whose quorum holds
  stale deltas waits for the members still training (up to
  `--straggler-timeout`, instead of the grace): a slow island's late delta
  joins the merge the others make instead of ending their round early.
- A merge is a transaction: it is computed on copies; a delta that makes it
  fail is refused (on the tape, to its island) and the merge is retried
  without it; state changes only once the merge completed.
- Durability order: record the accepted delta, save it, then ack it; record the
  merge, save the checkpoint, then broadcast. A restart resumes at the
  checkpoint, rolls back recorded merges it does not hold, restores the saved
  deltas of the open round and discards (on the tape) those that were not saved.
"""

from __future__ import annotations

import math
from typing import Callable, Optional

from yeto.sync.core.actions import Action, Checkpoint, Durable, Exit, SaveCheckpoint
from yeto.sync.core.admission import Admission
from yeto.sync.core.config import SyncerConfig
from yeto.sync.core.contract import InitAdapter
from yeto.sync.core.deltas import Deltas
from yeto.sync.core.driver import RoundDriver
from yeto.sync.core.limits import RateLimit
from yeto.sync.core.merging import Merging
from yeto.sync.core.recovery import Recovery
from yeto.sync.core.rounds import RoundPhaseError, round_header
from yeto.sync.core.state import RATE_WINDOW_S, STATE_REQUESTS_PER_WINDOW, Member, SyncerOutbox, SyncerState
from yeto.sync.wire.protocol import CLOCK_JUMP_S, Code, Message, ProtocolError, decode, encode_fragments, truncate

__all__ = ["SyncerConfig", "SyncerCore"]  # (the config is the core's: `SyncerCore(SyncerConfig(...), ...)`)

MERGE_TIME_EMA = 0.5  # weight of the newest merge's time in the running estimate the grace leaves room for
INTERNAL_ERROR_EXIT = 70  # sysexits' EX_SOFTWARE: the core reached a state it does not have (resumable)
STOP_LINGER_S = 10.0  # after a signal, wait at most this long for islands to say goodbye


class SyncerCore:
    """The syncer's state machine: `SyncerCore(cfg, incarnation).start(now, durable)`, then one call per event, each
    returning the actions to execute. It owns the state and the concerns; no concern reaches another but through
    what it was handed here."""

    def __init__(self, cfg: SyncerConfig, incarnation: str, init: Optional[InitAdapter] = None):
        """`init`: the adapter a new run starts from (--init-adapter), instead of the founding island's."""
        self.state = SyncerState(cfg, incarnation, init)
        self.outbox = SyncerOutbox()
        self.deltas = Deltas(self.state, self.outbox)
        self.merging = Merging(self.state, self.outbox, self.deltas)
        self.driver = RoundDriver(self.state, self.outbox, self.deltas, self.merging)
        self.admission = Admission(self.state, self.outbox, open_round=self.driver.maybe_open)
        self.recovery = Recovery(self.state, self.outbox, self.deltas)
        self.state_requests = RateLimit(STATE_REQUESTS_PER_WINDOW, RATE_WINDOW_S)
        self.internal_errors: set[str] = set()
        self.last_tick = math.inf  # (no jump before the first tick)

    # ------------------------------------------------------ what the shell reads

    @property
    def cfg(self) -> SyncerConfig:
        return self.state.cfg

    @property
    def incarnation(self) -> str:
        return self.state.incarnation

    @property
    def run(self) -> Optional[Checkpoint]:
        return self.state.run

    @property
    def version(self) -> int:
        return self.state.version

    @property
    def done(self) -> bool:
        return self.state.done

    @property
    def exit_code(self) -> Optional[int]:
        return self.state.exit_code

    @property
    def given_up(self) -> dict[int, str]:
        return self.state.given_up

    # ------------------------------------------------------ events

    def start(self, now: float, durable: Durable) -> list[Action]:
        """A process start: the run resumed from what survived on disk (`Recovery`), and its round opened if it can."""
        self.outbox.clear()
        if self.recovery.recover(now, durable):
            self.driver.maybe_open(now)
        return self.outbox.flush()

    def receive(self, peer: str, parts: list[bytes], now: float, principal: Optional[str] = None) -> list[Action]:
        """One message from an island connection; nothing a peer sends can raise out of here (a `RoundPhaseError`, the
        core's own state gone wrong, halts the syncer: see `_halt`). `principal`: who the connection authenticated as
        (the ZAP User-Id: "join" or "island:<id>"); None without security."""
        self.outbox.clear()
        try:
            if principal is not None and principal in self.state.revoked:
                raise ProtocolError(f"the key of {principal} was revoked", Code.REVOKED)
            msg = decode(parts, self.state.max_message_bytes)
            self.state.principal = principal
            self._handlers().get(msg.type, self._on_unexpected)(peer, msg, now)
        except RoundPhaseError as e:  # the core's own state is wrong: never go on from it
            self._halt("receive", e)
        except ProtocolError as e:
            self.outbox.reject(peer, str(e), e.code, now)
        except Exception as e:  # a bug must not take the fleet down: record it, answer, go on
            self.outbox.reject(peer, f"syncer could not process the message: {e!r}", Code.INTERNAL, now)
        return self.outbox.flush()

    def _handlers(self) -> dict[str, Callable[[str, Message, float], None]]:
        """Each message an island sends (protocol.ISLAND_TYPES) and the handler it goes to."""
        return {"hello": self.admission.on_hello, "init": self.admission.on_init,  # who joins, who founds the run
                "delta": self._on_delta,  # a round's contribution (Deltas), then the round may close
                "ping": self._on_ping, "sync": self._on_sync, "leave": self._on_leave}  # here: membership

    def tick(self, now: float) -> list[Action]:
        self.outbox.clear()
        try:
            self._tick(now)
        except RoundPhaseError as e:
            self._halt("tick", e)
        except Exception as e:  # a bug must not take the fleet down: record it (once per kind), go on
            key = f"{type(e).__name__}: {e}"
            if key not in self.internal_errors:
                self.internal_errors.add(key)
                self.outbox.record("internal_error", where="tick", error=truncate(key))
                self.outbox.log("error", f"internal error on the timer path (the run goes on): {key}")
        return self.outbox.flush()

    def _halt(self, where: str, error: RoundPhaseError) -> None:
        """Stop at once on a state the design does not have: recorded, nothing checkpointed or sent, exit
        INTERNAL_ERROR_EXIT; the same command resumes from the tape's last durable state, and islands reconnect."""
        self.outbox.clear()
        self.outbox.record("internal_error", where=where, error=truncate(str(error)), fatal=True)
        self.outbox.log("error", f"{error}; stopping (restart the syncer with the same --out: it resumes from "
                                 "its tape)")
        self.state.exit_code = INTERNAL_ERROR_EXIT
        self.outbox.add(Exit(INTERNAL_ERROR_EXIT))

    def _tick(self, now: float) -> None:
        s = self.state
        gap = now - self.last_tick
        self.last_tick = now
        if gap > CLOCK_JUMP_S:  # this process was not running (suspended): that is not its islands' silence
            for m in s.members.values():
                m.last_seen += gap
        for m in s.active():
            if now - m.last_seen > s.cfg.island_timeout:
                self._drop(m, f"silent for {s.cfg.island_timeout:g}s", now)
        self.admission.expire_silent_ids(now)
        if s.finished_at is not None:
            self.driver.end_when_done(now)
            return
        self.admission.ask_founder()
        self.driver.maybe_open(now)
        self.driver.maybe_close(now)

    def stop(self, now: float, reason: str, code: int) -> list[Action]:
        """A signal: checkpoint, tell every island to finish (saving its adapter), then exit with `code`."""
        self.outbox.clear()
        s = self.state
        if s.finished_at is None:
            self.outbox.record("stop", reason=reason, version=s.version)
            if s.run is not None:
                self.outbox.add(SaveCheckpoint(s.checkpoint()))
            self.driver.finish(reason, now, code=code, complete=False, linger_s=min(STOP_LINGER_S,
                                                                                    s.cfg.island_timeout))
        else:
            self.driver.exit()
        return self.outbox.flush()

    def set_keys(self, bound_ids: set[int], revoked: set[str], now: float) -> list[Action]:
        """The run's island keys changed (yeto keys add/revoke): members holding a revoked key are cut off."""
        self.outbox.clear()
        s = self.state
        s.bound_ids, s.revoked = set(bound_ids), set(revoked)
        for m in s.active():
            if m.principal is not None and m.principal in s.revoked:
                self.outbox.send(m.peer, "refuse", {"code": str(Code.REVOKED),
                                                    "reason": f"the key of {m.principal} was revoked"})
                self.outbox.record("revoked", island=m.island, principal=m.principal)
                self._drop(m, "its key was revoked", now)
        self.driver.maybe_close(now)
        return self.outbox.flush()

    def give_up(self, islands: dict[int, str], now: float) -> list[Action]:
        """The fleet controller stopped relaunching these islands (`yeto launch --recover-timeout`): the run goes on
        without them, its quorum and round-1 gate lowered by as many (never below 1). An island that comes back anyway
        takes its give-up back (`yeto.sync.core.admission`: the quorum rises again by the same rule)."""
        self.outbox.clear()
        s = self.state
        for lid, reason in sorted(islands.items()):
            if not 0 <= lid < s.cfg.islands:  # only an island the run counts on lowers the quorum
                if lid not in s.given_up:
                    s.given_up[lid] = reason  # (remembered, so this is said once)
                    self.outbox.log("warning", f"given-up island {lid} ignored: not one of --islands "
                                               f"{s.cfg.islands}")
                continue
            if lid not in s.given_up:
                s.given_up[lid] = reason
                self.outbox.record("given_up", island=lid, reason=truncate(reason), quorum=s.quorum())
                self.outbox.log("warning", f"island {lid} given up ({reason}); quorum now {s.quorum()}")
        self.driver.maybe_open(now)
        self.driver.maybe_close(now)
        return self.outbox.flush()

    def observe_merge(self, seconds: float) -> None:
        """The shell measured how long a merge took: the grace leaves that much of the cap for it."""
        if math.isfinite(seconds) and seconds >= 0:
            self.state.merge_s = MERGE_TIME_EMA * seconds + (1 - MERGE_TIME_EMA) * self.state.merge_s

    # ------------------------------------------------------ messages (hello, init: `Admission`)

    def _on_delta(self, peer: str, msg: Message, now: float) -> None:
        self.deltas.on_delta(peer, msg, now)
        self.driver.maybe_close(now)

    def _on_ping(self, peer: str, msg: Message, now: float) -> None:
        s = self.state
        m = s.member(peer, msg, now)
        m.held_version = msg.header["version"]
        pushed = msg.header["pushed"]
        mine = s.pending.get(m.island)
        have = bool(pushed and mine is not None and mine.ref() == pushed[:3])
        r = s.round
        window = {"seconds_left": round_header(s.cfg, r, now)["seconds_left"]} if r and s.cfg.round_seconds else {}
        self.outbox.send(m.peer, "pong", {"incarnation": s.incarnation, "version": s.version,
                                          "round": r.number if r else s.version, "round_open": r is not None,
                                          "have_delta": have, "contributed": r is not None and mine is not None,
                                          "finished": s.finished_at is not None, "answer": m.last_answer,
                                          "heard": m.heard, **window})
        if s.finish_header is not None:
            self.outbox.send(m.peer, "finish", s.finish_header_for_wire())  # it may have missed the first one

    def _on_sync(self, peer: str, msg: Message, now: float) -> None:
        s = self.state
        m = s.member(peer, msg, now)
        m.held_version = msg.header["version"]
        if not self.state_requests.allow(m.island, now):  # each answer is a whole adapter: bounded per island
            raise ProtocolError(f"more than {STATE_REQUESTS_PER_WINDOW} state requests in {RATE_WINDOW_S:g}s; "
                                "retry later", Code.RATE_LIMITED)
        run = s.run
        b = s.last_broadcast
        if b is not None and b.version == run.version and msg.header["version"] == run.version - 1:
            self.outbox.send(m.peer, "broadcast", b.header, b.frames)
            return
        descs, frames = encode_fragments(run.layout, run.global_, 32)
        self.outbox.send(m.peer, "state", {"version": run.version, "digest": run.digest,
                                           "merged": s.merged.get(m.island, []), "fragments": descs}, tuple(frames))

    def _on_leave(self, peer: str, msg: Message, now: float) -> None:
        m = self.state.member(peer, msg, now)
        m.left = True
        self._drop(m, msg.header["reason"], now)
        self.driver.maybe_close(now)

    def _on_unexpected(self, peer: str, msg: Message, now: float) -> None:
        raise ProtocolError(f"{msg.type} is a syncer-to-island message")

    def _drop(self, m: Member, reason: str, now: float) -> None:
        m.active = False
        self.state.ahead.pop(m.island, None)
        self.outbox.record("leave", island=m.island, reason=truncate(reason), version=self.state.version)
        self.outbox.log("info", f"island {m.island} left ({reason}); {len(self.state.active())} active")
