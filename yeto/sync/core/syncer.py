"""The syncer's core: rounds, membership, quorum, merges and recovery as a deterministic state machine.

This module is the event dispatcher, and the driver of the open round. Events in: `start(now, durable)` (a process
start, with whatever survived on disk), `receive(peer, parts, now)` (a message from a learner's connection),
`tick(now)` (a timer), `stop(now, ...)` (a signal), `set_keys` and `give_up` (the run's keys and the fleet controller
changed). Actions out: `Send`, `Record` (append to the tape), `SaveCheckpoint`, `SaveDelta`, `DropDeltas`, `Log` and
`Exit`. The shell executes them in order; every durable action makes the tape durable first, so the tape is never
behind the disk. `SyncerCore` combines the concerns, each in its own module: `config` (the flags and their checks),
`state` (what the core holds), `admission` (hello, identity, founding), `deltas` (a delta's intake), `rounds` (the
round's phases and when it closes), `merging` (the merge transaction) and `recovery` (the start).

The round protocol, in the terms used below:
- Round r trains from global version r-1 and, once merged, produces version r.
- A round's expected members are the live members (plus, right after a
  restart, members that were known before it for one `--learner-timeout`).
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
  fail is refused (on the tape, to its learner) and the merge is retried
  without it; state changes only once the merge completed.
- Durability order: record the accepted delta, save it, then ack it; record the
  merge, save the checkpoint, then broadcast. A restart resumes at the
  checkpoint, rolls back recorded merges it does not hold, restores the saved
  deltas of the open round and discards (on the tape) those that were not saved.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Optional

from yeto.sync.core.actions import Action, Durable, Exit, SaveCheckpoint
from yeto.sync.core.admission import Admission
from yeto.sync.core.config import SyncerConfig
from yeto.sync.core.merging import Merging
from yeto.sync.core.recovery import Recovery
from yeto.sync.core.rounds import (ClosePolicy, OpenRound, Pace, RoundMembers, RoundPhase, RoundPhaseError, Verdict,
                                   close_decision)
from yeto.sync.core.state import RATE_WINDOW_S, STATE_REQUESTS_PER_WINDOW
from yeto.sync.merge.rules import counts_toward_quorum
from yeto.sync.wire.protocol import CLOCK_JUMP_S, Code, Message, ProtocolError, decode, encode_fragments, truncate

__all__ = ["SyncerConfig", "SyncerCore"]  # (the config is the core's: `SyncerCore(SyncerConfig(...), ...)`)

QUORUM_WAIT_LOG_S = 15.0  # how often a round short of quorum says whom it waits for
PROGRESS_LOG_S = 60.0  # how often a slow round says whom it waits for
MERGE_TIME_EMA = 0.5  # weight of the newest merge's time in the running estimate the grace leaves room for
FINISH_LINGER_TIMEOUTS = 10  # after the finish, serve stragglers at most this many --learner-timeouts
INTERNAL_ERROR_EXIT = 70  # sysexits' EX_SOFTWARE: the core reached a state it does not have (resumable)
# ... and longer, up to this many, while a learner that still answers has not got the final adapter (a slow reader:
# a 70B-class adapter down a home line takes most of an hour)
FINISH_MAX_LINGER_TIMEOUTS = 60
FINISH_GRACE_TIMEOUTS = 3  # ... and wait for a learner gone silent (asleep?) until it is silent this many
STOP_LINGER_S = 10.0  # after a signal, wait at most this long for learners to say goodbye


class SyncerCore(Recovery, Admission, Merging):
    """The syncer's state machine: `SyncerCore(cfg, incarnation).start(now, durable)`, then one call per event, each
    returning the actions to execute."""

    # ------------------------------------------------------ events

    def start(self, now: float, durable: Durable) -> list[Action]:
        """A process start: the run resumed from what survived on disk (`Recovery`), and its round opened if it can."""
        self.out = []
        if self._recover(now, durable):
            self._maybe_open(now)
        return self._flush()

    def receive(self, peer: str, parts: list[bytes], now: float, principal: Optional[str] = None) -> list[Action]:
        """One message from a learner connection; nothing a peer sends can raise out of here (a `RoundPhaseError`, the
        core's own state gone wrong, halts the syncer: see `_halt`). `principal`: who the connection authenticated as
        (the ZAP User-Id: "join" or "learner:<id>"); None without security."""
        self.out = []
        try:
            if principal is not None and principal in self.revoked:
                raise ProtocolError(f"the key of {principal} was revoked", Code.REVOKED)
            msg = decode(parts, self.max_message_bytes)
            self.principal = principal
            self._handlers().get(msg.type, self._on_unexpected)(peer, msg, now)
        except RoundPhaseError as e:  # the core's own state is wrong: never go on from it
            self._halt("receive", e)
        except ProtocolError as e:
            self._reject(peer, str(e), e.code, now)
        except Exception as e:  # a bug must not take the fleet down: record it, answer, go on
            self._reject(peer, f"syncer could not process the message: {e!r}", Code.INTERNAL, now)
        return self._flush()

    def _handlers(self) -> dict[str, Callable[[str, Message, float], None]]:
        """Each message a learner sends (protocol.LEARNER_TYPES) and the handler it goes to."""
        return {"hello": self._on_hello, "init": self._on_init,  # Admission: who joins, who founds the run
                "delta": self._on_delta,  # Deltas: a round's contribution
                "ping": self._on_ping, "sync": self._on_sync, "leave": self._on_leave}  # here: membership

    def tick(self, now: float) -> list[Action]:
        self.out = []
        try:
            self._tick(now)
        except RoundPhaseError as e:
            self._halt("tick", e)
        except Exception as e:  # a bug must not take the fleet down: record it (once per kind), go on
            key = f"{type(e).__name__}: {e}"
            if key not in self.internal_errors:
                self.internal_errors.add(key)
                self._record("internal_error", where="tick", error=truncate(key))
                self._log("error", f"internal error on the timer path (the run goes on): {key}")
        return self._flush()

    def _halt(self, where: str, error: RoundPhaseError) -> None:
        """Stop at once on a state the design does not have: recorded, nothing checkpointed or sent, exit
        INTERNAL_ERROR_EXIT; the same command resumes from the tape's last durable state, and learners reconnect."""
        self.out = []
        self._record("internal_error", where=where, error=truncate(str(error)), fatal=True)
        self._log("error", f"{error}; stopping (restart the syncer with the same --out: it resumes from its tape)")
        self.exit_code = INTERNAL_ERROR_EXIT
        self.out.append(Exit(INTERNAL_ERROR_EXIT))

    def _tick(self, now: float) -> None:
        gap = now - self.last_tick
        self.last_tick = now
        if gap > CLOCK_JUMP_S:  # this process was not running (suspended): that is not its learners' silence
            for m in self.members.values():
                m.last_seen += gap
        for m in self._active():
            if now - m.last_seen > self.cfg.learner_timeout:
                self._drop(m, f"silent for {self.cfg.learner_timeout:g}s", now)
        self._expire_silent_ids(now)
        if self.finished_at is not None:
            lingered = now >= self.linger_until and not (self.linger_for_fetchers and self._fetching_final(now))
            if self._all_gone(now) or lingered or now >= self.finished_at + FINISH_MAX_LINGER_TIMEOUTS * \
                    self.cfg.learner_timeout:
                self._exit()
            return
        self._ask_founder()
        self._maybe_open(now)
        self._maybe_close(now)

    def stop(self, now: float, reason: str, code: int) -> list[Action]:
        """A signal: checkpoint, tell every learner to finish (saving its adapter), then exit with `code`."""
        self.out = []
        if self.finished_at is None:
            self._record("stop", reason=reason, version=self.version)
            if self.run is not None:
                self.out.append(SaveCheckpoint(self._checkpoint()))
            self._finish(reason, now, code=code, complete=False,
                         linger_s=min(STOP_LINGER_S, self.cfg.learner_timeout))
        else:
            self._exit()
        return self._flush()

    def set_keys(self, bound_ids: set[int], revoked: set[str], now: float) -> list[Action]:
        """The run's learner keys changed (yeto keys add/revoke): members holding a revoked key are cut off."""
        self.out = []
        self.bound_ids, self.revoked = set(bound_ids), set(revoked)
        for m in self._active():
            if m.principal is not None and m.principal in self.revoked:
                self._send(m.peer, "refuse", {"code": str(Code.REVOKED), "reason": f"the key of {m.principal} was "
                                                                                   "revoked"})
                self._record("revoked", learner=m.learner, principal=m.principal)
                self._drop(m, "its key was revoked", now)
        self._maybe_close(now)
        return self._flush()

    def give_up(self, learners: dict[int, str], now: float) -> list[Action]:
        """The fleet controller stopped relaunching these learners (`yeto launch --recover-timeout`): the run goes on
        without them, its quorum and round-1 gate lowered by as many (never below 1). A learner that comes back anyway
        is welcome; it does not raise the quorum again."""
        self.out = []
        for lid, reason in sorted(learners.items()):
            if not 0 <= lid < self.cfg.learners:  # only a learner the run counts on lowers the quorum
                if lid not in self.given_up:
                    self.given_up[lid] = reason  # (remembered, so this is said once)
                    self._log("warning", f"given-up learner {lid} ignored: not one of --learners {self.cfg.learners}")
                continue
            if lid not in self.given_up:
                self.given_up[lid] = reason
                self._record("given_up", learner=lid, reason=truncate(reason), quorum=self._quorum())
                self._log("warning", f"learner {lid} given up ({reason}); quorum now {self._quorum()}")
        self._maybe_open(now)
        self._maybe_close(now)
        return self._flush()

    def observe_merge(self, seconds: float) -> None:
        """The shell measured how long a merge took: the grace leaves that much of the cap for it."""
        if math.isfinite(seconds) and seconds >= 0:
            self.merge_s = MERGE_TIME_EMA * seconds + (1 - MERGE_TIME_EMA) * self.merge_s

    # ------------------------------------------------------ messages (hello, init: `Admission`; delta: `Deltas`)

    def _on_ping(self, peer: str, msg: Message, now: float) -> None:
        m = self._member(peer, msg, now)
        m.held_version = msg.header["version"]
        pushed = msg.header["pushed"]
        mine = self.pending.get(m.learner)
        have = bool(pushed and mine is not None and mine.ref() == pushed[:3])
        r = self.round
        window = {"seconds_left": self._round_header(r, now)["seconds_left"]} if r and self.cfg.round_seconds else {}
        self._send(m.peer, "pong", {"incarnation": self.incarnation, "version": self.version,
                                    "round": r.number if r else self.version, "round_open": r is not None,
                                    "have_delta": have, "contributed": r is not None and mine is not None,
                                    "finished": self.finished_at is not None, "answer": m.last_answer, "heard": m.heard,
                                    **window})
        if self.finish_header is not None:
            self._send(m.peer, "finish", self.finish_header_for_wire())  # it may have missed the first one

    def _on_sync(self, peer: str, msg: Message, now: float) -> None:
        m = self._member(peer, msg, now)
        m.held_version = msg.header["version"]
        if not self.state_requests.allow(m.learner, now):  # each answer is a whole adapter: bounded per learner
            raise ProtocolError(f"more than {STATE_REQUESTS_PER_WINDOW} state requests in {RATE_WINDOW_S:g}s; "
                                "retry later", Code.RATE_LIMITED)
        run = self.run
        b = self.last_broadcast
        if b is not None and b.version == run.version and msg.header["version"] == run.version - 1:
            self._send(m.peer, "broadcast", b.header, b.frames)
            return
        descs, frames = encode_fragments(run.layout, run.global_, 32)
        self._send(m.peer, "state", {"version": run.version, "digest": run.digest,
                                     "merged": self.merged.get(m.learner, []), "fragments": descs},
                   tuple(frames))

    def _on_leave(self, peer: str, msg: Message, now: float) -> None:
        m = self._member(peer, msg, now)
        m.left = True
        self._drop(m, msg.header["reason"], now)
        self._maybe_close(now)

    def _on_unexpected(self, peer: str, msg: Message, now: float) -> None:
        raise ProtocolError(f"{msg.type} is a syncer-to-learner message")

    # ------------------------------------------------------ the round

    def _maybe_open(self, now: float) -> None:
        """Open the next round (or finish, after the last): once the run is founded, and round 1 once its gate passed;
        every live member without a delta in is sent the round."""
        run = self.run
        if run is None or self.round is not None or self.finished_at is not None:
            return
        if run.version >= self.cfg.outer_steps:
            self._finish("outer steps done", now, code=0, complete=True)
            return
        if not self.started and not self._gate_passed(now):
            return
        self.started = True
        self.round = OpenRound(run.version + 1, run.version, now,
                               ends_at=now + self.cfg.round_seconds if self.cfg.round_seconds else math.inf)
        header = self._round_header(self.round, now)
        members = []
        for m in self._live():
            if m.learner not in self.pending:
                self._send(m.peer, "round", header)
                members.append(m.learner)
        self._record("round_open", round=self.round.number, version=run.version, members=sorted(members),
                     restored=sorted(self.pending))
        self._log("info", f"round {self.round.number} open with learners {sorted(members)}")
        self._take_ahead(now)
        self._maybe_close(now)

    def _gate_passed(self, now: float) -> bool:
        """Round 1 waits for --learners (less those given up), or for quorum plus --straggler-timeout."""
        live = len(self._live())
        if live < self._quorum():
            self.gate_since = None
            return False
        if self.gate_since is None:
            self.gate_since = now
        return live >= self.cfg.learners - self._given_up_count() or now - self.gate_since >= self.cfg.straggler_timeout

    def _round_header(self, r: OpenRound, now: float) -> dict[str, Any]:
        """What a learner trains the open round by. A time-window round's window is the round's, not the learner's:
        `seconds_left` (relative, so no clocks need agree) ends every member's window together, however late it
        started (a learner whose stale delta was just acked trains what is left), so deltas land fresh together
        instead of each island's window drifting with its own start."""
        header = {"round": r.number, "version": r.base_version, "inner_steps": self.cfg.inner_steps,
                  "round_seconds": self.cfg.round_seconds}
        if self.cfg.round_seconds:
            header["seconds_left"] = round(max(0.0, r.ends_at - now), 3)
        return header

    def _round_members(self, now: float) -> RoundMembers:
        """The open round's responders, and whom it expects: the live members that have not answered, and (for a
        --learner-timeout after a restart) the members known before it that may still come back."""
        live = self._live()
        waiting = {m.learner: Pace(m.since, m.round_s, m.step_s)
                   for m in sorted(live, key=lambda m: m.learner) if m.learner not in self.pending}
        absent: tuple[int, ...] = ()
        if now < self.absent_until:
            here = {m.learner for m in live}
            absent = tuple(sorted(lid for lid in self.seen if lid not in here and lid not in self.pending))
        counting = [d for d in self.pending.values() if counts_toward_quorum(d.tier)]
        return RoundMembers(tuple(sorted(self.pending)), sum(1 for d in counting if d.lag == 0), waiting, absent,
                            len(counting))

    def _close_policy(self) -> ClosePolicy:
        cfg = self.cfg
        return ClosePolicy(self._quorum(), cfg.grace_cap_s, cfg.straggler_timeout, cfg.quorum_timeout,
                           cfg.round_seconds, self.merge_s)

    def _maybe_close(self, now: float) -> None:
        """Apply the round's `close_decision`: merge it, keep waiting, or give the run up short of quorum."""
        r = self.round
        if r is None:
            return
        members = self._round_members(now)
        d = close_decision(r, members, now, self._close_policy())
        r.quorum_at, r.fresh_at = d.quorum_at, d.fresh_at
        r.enter(RoundPhase.OPEN if d.verdict in (Verdict.SHORT, Verdict.QUORUM_TIMEOUT) else RoundPhase.GRACE)
        if d.verdict is Verdict.CLOSE:
            self._close_round(now, stragglers=list(d.waiting_for))
        elif d.verdict is Verdict.QUORUM_TIMEOUT:
            self._give_up_round(r, members, now)
        elif d.verdict is Verdict.SHORT:
            self._log_wait(r, members, now)

    def _give_up_round(self, r: OpenRound, members: RoundMembers, now: float) -> None:
        q = self._quorum()
        responders = list(members.responders)
        self._record("quorum_timeout", round=r.number, responders=responders, quorum=q)
        self._log("error", f"round {r.number} did not reach quorum {q} within {self.cfg.quorum_timeout:g}s "
                           f"({len(responders)} responded): giving up")
        self._finish(f"round {r.number} did not reach quorum {q}", now, code=3, complete=False)

    def _log_wait(self, r: OpenRound, members: RoundMembers, now: float) -> None:
        """Say, now and then, whom a round short of quorum waits for; on the tape too when those present cannot
        reach it (the run is stuck until someone (re)joins)."""
        q = self._quorum()
        responders, waiting = list(members.responders), list(members.waiting)
        short = len(responders) + len(members.expected) < q
        if now - max(r.opened_at, r.last_wait_log) < (QUORUM_WAIT_LOG_S if short else PROGRESS_LOG_S):
            return
        r.last_wait_log = now
        if not short:
            self._log("info", f"round {r.number}: {len(responders)}/{q} responders so far, waiting for {waiting}")
            return
        gone = sorted(lid for lid in self.seen if lid not in {m.learner for m in self._live()}
                      and lid not in self.pending)
        self._record("quorum_wait", round=r.number, responders=responders, waiting=waiting, gone=gone,
                     quorum=q, short=short)
        self._log("warning", f"round {r.number} cannot reach quorum {q} with the learners present "
                             f"({len(responders)} responded {responders}, training {waiting}, gone {gone}); "
                             f"waiting up to {self.cfg.quorum_timeout - (now - r.opened_at):.0f}s more for "
                             "learners to (re)join")

    # ------------------------------------------------------ the finish

    def _finish(self, reason: str, now: float, code: int, complete: bool, linger_s: Optional[float] = None) -> None:
        self.finished_at = now
        self.linger_until = now + (FINISH_LINGER_TIMEOUTS * self.cfg.learner_timeout if linger_s is None else linger_s)
        self.linger_for_fetchers = linger_s is None
        if self.round is not None:
            self.round.advance(RoundPhase.ABANDONED)
        self.round = None
        self.ahead = {}
        self.finish_header = {"version": self.version, "reason": reason, "complete": complete, "code": code}
        for m in self._active():
            self._send(m.peer, "finish", self.finish_header_for_wire())
        self._record("finish", version=self.version, reason=reason, code=code, complete=complete,
                     outstanding=sorted(self.pending))
        if self._all_gone(now):
            self._exit()

    def _fetching_final(self, now: float) -> bool:
        """A live learner (heard within --learner-timeout) still says it holds an older version than the final one."""
        return any(m.held_version < self.version and now - m.last_seen <= self.cfg.learner_timeout
                   for m in self._active())

    def _all_gone(self, now: float) -> bool:
        """After the finish: has every learner had its chance to get it (and the final adapter)? Each one left, or
        has been silent for a while (a learner asleep when the run ended comes back for it), and right after a
        restart the learners known before it had their grace to say hello."""
        grace = FINISH_GRACE_TIMEOUTS * self.cfg.learner_timeout
        not_back = [lid for lid in self.seen if lid not in self.members]
        return (not not_back or now >= self.absent_until) and all(
            m.left or now - m.last_seen >= grace for m in self.members.values()) and all(
            now - t >= grace for t in self.knocking.values())
