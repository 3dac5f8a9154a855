"""The syncer's core: rounds, membership, quorum, merges and recovery as a deterministic state machine.

Events in: `receive(peer, parts, now)` (a message from a learner's connection),
`tick(now)` (a timer), `stop(now, ...)` (a signal), and `start(now, durable)`
(a process start, with whatever survived on disk). Actions out: `Send`,
`Record` (append to the tape), `SaveCheckpoint`, `SaveDelta`, `DropDeltas`,
`Log` and `Exit`. The shell executes them in order; every durable action makes
the tape durable first, so the tape is never behind the disk.

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

import json
import math
from collections import deque
from dataclasses import asdict, dataclass
from typing import Any, Optional

import numpy as np

from yeto.sync.aggregate import (NORM_HISTORY_ROUNDS, RoundSum, clip_factors,
                                  clip_reference, clipped_merge, effective_weight, trimmed_mean)
from yeto.sync.core.actions import (AcceptedDelta, Action, Checkpoint, DropDeltas, Durable, Exit, Log, Record,
                                    SaveCheckpoint, SaveDelta, Send)
from yeto.sync.core.config import SyncerConfig
from yeto.sync.core.contract import (InitAdapter, contract_mismatch, contract_problem, init_adapter_problem,
                                     run_contract)
from yeto.sync.core.fold import TapeFold
from yeto.sync.core.limits import RateLimit
from yeto.sync.core.quorum import quorum_after_give_ups
from yeto.sync.core.rounds import (ClosePolicy, OpenRound, Pace, RoundMembers, RoundPhase, RoundPhaseError, Verdict,
                                   close_decision)
from yeto.sync.layout import Layout, flatten, layout_from_json, layout_mismatch
from yeto.sync.merge import (DeltaCounts, MergeTerms, merge_terms,
                             product_merge, staleness_factor, weight_of)
from yeto.sync.outer import nesterov_step
from yeto.sync.protocol import (CLOCK_JUMP_S, PROTOCOL_VERSION, Code, Message, ProtocolError,
                                array_digest, decode, decode_fragments, digest_bytes, encode_fragments,
                                encode_fragments_ef, identity_proof, message_size, session_start, truncate)
from yeto.sync.quant import ErrorFeedback, QuantError, dequantize

QUORUM_WAIT_LOG_S = 15.0  # how often a round short of quorum says whom it waits for
PROGRESS_LOG_S = 60.0  # how often a slow round says whom it waits for
ROUND_TIME_EMA = 0.5  # weight of a member's newest round time in its running estimate
MERGE_TIME_EMA = 0.5
FINISH_LINGER_TIMEOUTS = 10  # after the finish, serve stragglers at most this many --learner-timeouts
FINISH_GRACE_TIMEOUTS = 3  # ... and wait for a learner gone silent (asleep?) until it is silent this many
STOP_LINGER_S = 10.0  # after a signal, wait at most this long for learners to say goodbye
MAX_TOKENS_PER_DELTA = 1 << 40  # beyond any real round: a larger claim is refused
MAX_INNER_STEPS_PER_DELTA = 10**7
MAX_ADAPTER_CONFIG_BYTES = 64 << 10
MAX_PROVENANCE_BYTES = 256 << 10
MAX_SESSION_CHARS = 64
MAX_BACKEND_CHARS = 32
MAX_LEARNER_ID = (1 << 31) - 1
MAX_KNOCKING = 4096  # learner ids remembered as trying to rejoin
MAX_REFUSED_REMEMBERED = 4096  # digests of deltas a merge refused
MAX_RETIRED_SESSIONS = 8  # per learner id: older sessions that get "superseded" instead of "say hello"
MERGED_HISTORY = 16  # per learner id, its latest merged deltas: one back from a long absence learns which counted
MAX_LOSS = 1e4  # a reported mean loss above this is no loss of a language model
STATE_REQUESTS_PER_WINDOW = 20  # full-state (or broadcast) resends per learner per RATE_WINDOW_S
REPLIES_PER_WINDOW = 30  # refusals/errors answered and written to the tape per peer per RATE_WINDOW_S
RATE_WINDOW_S = 60.0
FRESH_IDS_PER_WINDOW = 32  # learner ids beyond --learners one key holder may bring in per RATE_WINDOW_S


# ---------------------------------------------------------------------------------------------- state


@dataclass
class Member:
    learner: int
    session: str
    peer: str
    backend: str
    last_seen: float
    active: bool = True
    welcomed: bool = False
    left: bool = False  # said goodbye (not just went silent)
    principal: Optional[str] = None  # who its connection authenticated as (ZAP User-Id); None: --insecure
    tokens_per_step: int = 0  # declared at join: bounds its token claims
    round_s: Optional[float] = None  # its observed compute time per round (running estimate)
    step_s: Optional[float] = None  # ... and per inner step (time windows: how far its push may trail the window)
    since: float = 0.0  # when it (last) started training: a round's open, or the ack of its delta


@dataclass
class Founding:
    """The run has a layout but no initial adapter yet: one member is asked to upload it."""

    layout: Layout
    adapter_config: dict[str, Any]
    provenance: dict[str, Any]
    contract: dict[str, Any]
    asked: Optional[int] = None  # learner id asked for the adapter


@dataclass
class Broadcast:
    version: int
    header: dict[str, Any]
    frames: tuple[bytes, ...]


class MergeError(Exception):
    pass


# ---------------------------------------------------------------------------------------------- the core


class SyncerCore:
    def __init__(self, cfg: SyncerConfig, incarnation: str, init: Optional[InitAdapter] = None):
        """`init`: the adapter a new run starts from (--init-adapter), instead of the founding learner's."""
        cfg.check()
        self.cfg = cfg
        self.incarnation = incarnation
        self.init = init
        self.max_message_bytes = cfg.max_message_mb << 20
        self.founding: Optional[Founding] = None
        self.founder: Optional[int] = None  # who uploaded the initial adapter (this process)
        self.run: Optional[Checkpoint] = None  # the committed run state (None until founded)
        self.ef: Optional[ErrorFeedback] = None
        self.members: dict[int, Member] = {}
        self.retired: dict[int, list[str]] = {}  # learner id -> its sessions that a newer one took over
        self.knocking: dict[int, float] = {}  # learner id of this run -> when it last got "not joined"
        self.seen: set[int] = set()
        self.owners: dict[int, str] = {}  # learner id -> proof of the identity that holds it (hash of its secret)
        self.bound_ids: set[int] = set()  # learner ids only their own key may speak for (yeto keys add)
        self.revoked: set[str] = set()  # principals whose keys were revoked
        self.given_up: dict[int, str] = {}  # learner id -> why the fleet controller stopped bringing it back
        self.replies = RateLimit(REPLIES_PER_WINDOW, RATE_WINDOW_S)
        self.state_requests = RateLimit(STATE_REQUESTS_PER_WINDOW, RATE_WINDOW_S)
        self.fresh_ids = RateLimit(FRESH_IDS_PER_WINDOW, RATE_WINDOW_S)  # per principal (or connection, insecure)
        self.sum: Optional[RoundSum] = None  # the open round's running sum of accepted deltas
        self.norm_history: deque[float] = deque(maxlen=NORM_HISTORY_ROUNDS * 4)
        self.merged: dict[int, list] = {}  # learner id -> its latest merged deltas, [[round, digest], ...]
        self.round: Optional[OpenRound] = None
        self.pending: dict[int, AcceptedDelta] = {}
        self.digests: dict[int, str] = {}  # recent committed versions -> global digest: a stale delta's base is checked
        self.merge_s = 0.0  # how long merges take (the shell measures it): the grace leaves room for it
        self.refused_digests: dict[str, None] = {}  # deltas a merge refused (oldest first): never accepted again
        self.last_broadcast: Optional[Broadcast] = None
        self.started = False  # round 1 has opened (the --learners gate is behind us)
        self.gate_since: Optional[float] = None
        self.absent_until = -math.inf  # after a restart: members known before it are expected until then
        self.finished_at: Optional[float] = None
        self.linger_until = math.inf
        self.finish_header: Optional[dict[str, Any]] = None
        self.exit_code: Optional[int] = None
        self.internal_errors: set[str] = set()
        self.last_tick = math.inf  # (no jump before the first tick)
        self.principal: Optional[str] = None  # of the message being handled
        self.out: list[Action] = []

    # ------------------------------------------------------------------ events

    def start(self, now: float, durable: Durable) -> list[Action]:
        """A process start: resume from what survived, reconciling the tape with the disk."""
        self.out = []
        ck = durable.checkpoint
        if ck is not None:  # (first: the start record shows the config the run goes on with)
            self.cfg.check_resume(ck.config, ck.version)
        self._record("start", config=asdict(self.cfg), incarnation=self.incarnation)
        self.out.extend(durable.notes)
        fold = TapeFold()
        for e in durable.tape:
            fold.feed(e)
            if e.get("event") == "refuse_delta" and isinstance(e.get("digest"), str):
                self._remember_refused(e["digest"])
        rolled_back = [v for v in range(fold.version, (ck.version if ck else -1), -1)]
        for v in rolled_back:
            self._record("rollback", version=v, reason="its checkpoint was not durable when the syncer stopped")
            fold.rollback(v)
        if ck is None:  # nothing durable: a fresh run (anything the tape accepted before is void)
            for (rnd, lid), ev in sorted(fold.outstanding.items()):
                self._record("discard", learner=lid, round=rnd, digest=ev["digest"], reason="the run restarted from "
                             "scratch: no checkpoint was durable")
            if durable.deltas:
                self.out.append(DropDeltas(through_round=max(d.round for d in durable.deltas)))
            return self._flush()
        self.run = ck
        self.ef = ErrorFeedback(ck.layout.numel)
        self.ef.residual = ck.residual
        # who the run waits for after a restart: the checkpoint's members, and those who joined since (on the tape)
        self.seen = set(ck.members) | fold.joined
        self.merged = {int(k): v for k, v in ck.merged.items()}
        self.retired = {int(k): list(v) for k, v in ck.retired.items()}
        self.owners = dict(ck.owners)
        self.sum = RoundSum.for_rule(ck.layout, self.cfg.merge)
        self.digests = {v: d for v, d in fold.digests.items() if ck.version - self.cfg.max_base_lag <= v < ck.version}
        self.digests[ck.version] = ck.digest
        open_round = ck.version + 1
        saved = {(d.round, d.learner): d for d in durable.deltas}
        for (rnd, lid), ev in sorted(fold.outstanding.items()):
            d = saved.get((rnd, lid))
            if rnd != open_round or d is None or d.digest != ev["digest"]:
                self._record("discard", learner=lid, round=rnd, digest=ev["digest"],
                             reason="not saved when the syncer stopped; its learner sends it again")
        restored = []
        for (rnd, lid), d in sorted(saved.items()):
            ev = fold.outstanding.get((rnd, lid))
            if rnd != open_round or not 0 <= ck.version - d.base_version <= self.cfg.max_base_lag or (
                    ev is None and fold.resolved(rnd, lid, d.digest)):
                continue
            if ev is not None and ev["digest"] != d.digest:
                continue
            try:
                flat = self._decode(d)
            except ProtocolError as e:  # a file that does not fit this run: its learner sends the delta again
                if ev is not None:
                    self._record("discard", learner=lid, round=rnd, digest=d.digest, reason=truncate(str(e)))
                continue
            self._measure(d, flat)
            if ev is None:  # saved, but its tape line was lost: account for it now
                self._record("delta", **self._delta_fields(d), norm=d.norm, recovered=True)
            self.pending[lid] = d
            self.sum.add(lid, flat, self._weight(d), self._scale(d))
            restored.append(lid)
        self.out.append(DropDeltas(through_round=ck.version))
        for (rnd, lid), d in saved.items():
            if rnd == open_round and lid not in self.pending:
                self.out.append(DropDeltas(round=rnd, learner=lid))
        self.started = ck.version > 0 or bool(self.pending)
        self.absent_until = now + self.cfg.learner_timeout
        self._record("resume", version=ck.version, digest=ck.digest, restored=restored, rolled_back=rolled_back)
        self._log("info", f"resumed at version {ck.version} ({len(restored)} delta(s) of round {open_round} restored)")
        self._maybe_open(now)
        return self._flush()

    def receive(self, peer: str, parts: list[bytes], now: float, principal: Optional[str] = None) -> list[Action]:
        """One message from a learner connection; nothing a peer sends can raise out of here. `principal`: who the
        connection authenticated as (the ZAP User-Id: "join" or "learner:<id>"); None without security."""
        self.out = []
        try:
            if principal is not None and principal in self.revoked:
                raise ProtocolError(f"the key of {principal} was revoked", Code.REVOKED)
            msg = decode(parts, self.max_message_bytes)
            self.principal = principal
            getattr(self, f"_on_{msg.type}", self._on_unexpected)(peer, msg, now)
        except RoundPhaseError:  # the core's own state is wrong: stop (a restart resumes from the tape), never go on
            raise
        except ProtocolError as e:
            self._reject(peer, str(e), e.code, now)
        except Exception as e:  # a bug must not take the fleet down: record it, answer, go on
            self._reject(peer, f"syncer could not process the message: {e!r}", Code.INTERNAL, now)
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

    def _given_up_count(self) -> int:
        return sum(1 for lid in self.given_up if 0 <= lid < self.cfg.learners)

    def _quorum(self) -> int:
        return quorum_after_give_ups(self.cfg.quorum, self.cfg.learners, self._given_up_count())

    def tick(self, now: float) -> list[Action]:
        self.out = []
        try:
            self._tick(now)
        except RoundPhaseError:
            raise
        except Exception as e:  # a bug must not take the fleet down: record it (once per kind), go on
            key = f"{type(e).__name__}: {e}"
            if key not in self.internal_errors:
                self.internal_errors.add(key)
                self._record("internal_error", where="tick", error=truncate(key))
                self._log("error", f"internal error on the timer path (the run goes on): {key}")
        return self._flush()

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
            if self._all_gone(now) or now >= self.linger_until:
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

    @property
    def version(self) -> int:
        return self.run.version if self.run is not None else -1

    @property
    def done(self) -> bool:
        return self.exit_code is not None

    # ------------------------------------------------------------------ helpers

    def _flush(self) -> list[Action]:
        out, self.out = self.out, []
        return out

    def _record(self, event: str, **fields: Any) -> None:
        self.out.append(Record(event, fields))

    def _log(self, level: str, text: str) -> None:
        self.out.append(Log(level, text))

    def _send(self, peer: str, msg_type: str, header: dict[str, Any], frames: tuple[bytes, ...] = ()) -> None:
        self.out.append(Send(peer, msg_type, header, frames))

    def _reject(self, peer: str, reason: str, code: Code, now: float) -> None:
        if not self._may_reply(peer, now):
            return
        reason = truncate(reason)
        self._record("reject", peer=truncate(peer, 80), code=str(code), reason=reason)
        self._send(peer, "error", {"code": str(code), "reason": reason})

    def _refuse(self, peer: str, lid: int, code: Code, reason: str, now: float, **fields: Any) -> None:
        if not self._may_reply(peer, now):
            return
        reason = truncate(reason)
        self._record("refuse", learner=lid, code=str(code), reason=reason, **fields)
        self._send(peer, "refuse", {"code": str(code), "reason": reason})
        self._log("warning", f"refused learner {lid}: {reason}")

    def _may_reply(self, peer: str, now: float) -> bool:
        """One peer's refusals cost at most REPLIES_PER_WINDOW tape lines and answers per window; the excess is
        counted on the tape once the next window opens."""
        ok = self.replies.allow(peer, now)
        skipped = self.replies.expired_refusals.pop(peer, 0)
        if skipped:
            self._record("replies_suppressed", peer=truncate(peer, 80), count=skipped)
        return ok

    def _exit(self) -> None:
        if self.exit_code is None:
            self.exit_code = int(self.finish_header.get("code", 0)) if self.finish_header else 0
            self.out.append(Exit(self.exit_code))

    def _active(self) -> list[Member]:
        return [m for m in self.members.values() if m.active]

    def _live(self) -> list[Member]:
        """Members that can train: active and welcomed."""
        return [m for m in self.members.values() if m.active and m.welcomed]

    def _member(self, peer: str, msg: Message, now: float) -> Member:
        lid, session = msg.header["learner"], msg.header["session"]
        m = self.members.get(lid)
        if session in self.retired.get(lid, ()):
            raise ProtocolError(f"learner {lid} has a newer session; this one ({truncate(session, 20)}) is over",
                                Code.SUPERSEDED)
        said_goodbye = m is not None and m.session == session and m.left  # (its late messages are no knock)
        if m is not None and m.session == session and (peer != m.peer or self.principal != m.principal):
            raise ProtocolError(f"this connection did not join as learner {lid}: a message is only accepted on the "
                                "connection that said hello", Code.IDENTITY)
        if m is not None and m.session != session:
            m = None  # a session we have not met: it must say hello (its hello may have been lost)
        if m is None or not m.active or (not m.welcomed and msg.type not in ("init", "leave", "ping")):
            if lid in self.seen and not said_goodbye and len(self.knocking) < MAX_KNOCKING:
                self.knocking[lid] = now  # a learner of this run trying to get back in: a finished run waits for it
            raise ProtocolError(f"learner {lid} has not joined: send hello first", Code.NOT_JOINED)
        m.last_seen = now
        return m

    def _all_gone(self, now: float) -> bool:
        """After the finish: has every learner had its chance to get it (and the final adapter)? Each one left, or
        has been silent for a while (a learner asleep when the run ended comes back for it), and right after a
        restart the learners known before it had their grace to say hello."""
        grace = FINISH_GRACE_TIMEOUTS * self.cfg.learner_timeout
        not_back = [lid for lid in self.seen if lid not in self.members]
        return (not not_back or now >= self.absent_until) and all(
            m.left or now - m.last_seen >= grace for m in self.members.values()) and all(
            now - t >= grace for t in self.knocking.values())

    def _drop(self, m: Member, reason: str, now: float) -> None:
        m.active = False
        self._record("leave", learner=m.learner, reason=truncate(reason), version=self.version)
        self._log("info", f"learner {m.learner} left ({reason}); {len(self._active())} active")

    def _checkpoint(self) -> Checkpoint:
        assert self.run is not None and self.ef is not None
        r = self.run
        return Checkpoint(r.version, r.layout, r.adapter_config, r.provenance, r.global_, r.momentum, self.ef.residual,
                          r.digest, asdict(self.cfg), sorted(self.seen), {k: list(v) for k, v in self.merged.items()},
                          {k: list(v) for k, v in self.retired.items()}, r.contract,
                          dict(self.owners))  # (copies: they keep changing)

    # ------------------------------------------------------------------ handlers

    def _on_unexpected(self, peer: str, msg: Message, now: float) -> None:
        raise ProtocolError(f"{msg.type} is a syncer-to-learner message")

    def _on_hello(self, peer: str, msg: Message, now: float) -> None:
        h = msg.header
        lid, session, backend = h["learner"], h["session"], h["backend"]
        if self.run is None and self.finished_at is not None:
            self._send(peer, "finish", self.finish_header_for_wire())
            return
        if not 0 <= lid <= MAX_LEARNER_ID:
            raise ProtocolError(f"learner id must be between 0 and {MAX_LEARNER_ID}")
        if session in self.retired.get(lid, ()):
            raise ProtocolError(f"learner {lid}'s session {truncate(session, 20)} was taken over by a newer one",
                                Code.SUPERSEDED)
        if not 0 < len(session) <= MAX_SESSION_CHARS or len(backend) > MAX_BACKEND_CHARS:
            raise ProtocolError(f"hello: session must be 1-{MAX_SESSION_CHARS} characters and backend at most "
                                f"{MAX_BACKEND_CHARS}")
        try:
            layout = layout_from_json(h["layout"])
        except (KeyError, TypeError, ValueError, OverflowError) as e:
            raise ProtocolError(f"hello: malformed layout ({truncate(str(e), 200)})") from e
        problem = _config_problem(h["adapter_config"], h.get("provenance", {})) or contract_problem(h["contract"])
        if problem:
            return self._refuse(peer, lid, Code.BAD_CONFIG, problem, now, backend=backend)
        bound = self._principal_problem(lid)
        if bound:
            return self._refuse(peer, lid, Code.IDENTITY, bound, now, principal=self.principal)
        run_layout = self.run.layout if self.run else self.founding.layout if self.founding else None
        if run_layout is not None:
            problem = layout_mismatch(run_layout, layout)
            if problem:
                return self._refuse(peer, lid, Code.LAYOUT, f"adapter layout differs from the run's: {problem}", now,
                                    backend=backend)
        contract = self.run.contract if self.run else self.founding.contract if self.founding else self.cfg.pinned()
        problem = contract_mismatch(contract, h["contract"])
        if problem:
            return self._refuse(peer, lid, Code.CONTRACT, f"this learner does not match the run's contract: {problem}"
                                f"; start it with the run's settings", now, backend=backend)
        if self.run is None and self.init is not None:
            problem = init_adapter_problem(self.init, layout, h["adapter_config"], h["contract"])
            if problem:
                return self._refuse(peer, lid, Code.CONTRACT, f"the syncer's --init-adapter {self.init.source} cannot "
                                    f"start this run: {problem}; start the learners with its settings, or the "
                                    "syncer with another adapter", now, backend=backend)
        need = message_size(layout, self.cfg.sync_bits)
        if need > self.max_message_bytes:
            return self._refuse(peer, lid, Code.TOO_LARGE,
                                f"this adapter's deltas ({layout.numel:,} values at {self.cfg.sync_bits} bits) need "
                                f"messages of {need / 2**20:.0f} MiB, above --max-message-mb "
                                f"{self.cfg.max_message_mb}: "
                                "restart the syncer with a larger --max-message-mb", now, backend=backend)
        proof = identity_proof(h["identity"])
        old = self.members.get(lid)
        owner = self.owners.get(lid)
        if owner is not None and owner != proof and (
                (old is not None and old.active) or (old is None and lid in self.seen and now < self.absent_until)):
            # another identity claims a held id: refused while its holder is live (or expected back after a
            # restart); a relaunched learner on a new machine gets the id once the old holder is gone
            raise ProtocolError(f"learner id {lid} is held by a live learner with another identity; retrying until it "
                                "goes silent (two learners with the same --learner-id?)", Code.ID_TAKEN)
        if old is None and lid not in self.seen:
            self._admit_fresh(peer, lid, now)
        if old is None and len(self.members) >= self.cfg.max_learners and not self._evict_member():
            raise ProtocolError(f"the run holds --max-learners {self.cfg.max_learners} live learners; retrying",
                                Code.BUSY)
        if old is not None and old.session != session and old.active and session_start(session) < session_start(
                old.session):  # a hello from an older process (delayed, or one that woke up): never the newer's id
            if self.finish_header is not None:
                self._send(peer, "finish", self.finish_header_for_wire())  # the run is over anyway: it may stop
                return
            raise ProtocolError(f"learner id {lid} is held by a live session that started later; retrying until it "
                                "goes silent (another process with this --learner-id is running?)", Code.BUSY)
        if old is not None and old.session != session:
            if session_start(session) >= session_start(old.session):  # an older one (it was silent) is not retired:
                retired = self.retired.setdefault(lid, [])  # it takes the id back when it returns
                retired.append(old.session)
                del retired[:-MAX_RETIRED_SESSIONS]
            if old.active:
                self._send(old.peer, "refuse", {"code": str(Code.SUPERSEDED),
                                                "reason": f"learner id {lid} was taken over by a new session"})
            self._record("supersede", learner=lid, old_session=old.session, session=session)
        rejoin = old is not None or lid in self.seen
        m = Member(lid, session, peer, backend, now, principal=self.principal,
                   tokens_per_step=h["contract"]["tokens_per_step"])
        self.members[lid] = m
        if owner != proof:
            self.owners[lid] = proof
        if self.run is None:
            if self.founding is None:
                contract = run_contract(h["contract"], self.cfg.pinned())
                contract["num_learners"] = contract.get("num_learners") or self.cfg.learners  # (the shard count)
                self.founding = Founding(layout, h["adapter_config"], _run_provenance(h.get("provenance") or {},
                                                                                       contract), contract)
                self._record("layout", learner=lid, fingerprint=layout.fingerprint, tensors=len(layout.specs),
                             numel=layout.numel, fragments=len(layout.fragments))
                self._record("contract", learner=lid, **contract, sync_bits=self.cfg.sync_bits,
                             protocol=PROTOCOL_VERSION)
            if self.init is not None:  # version 0 is the given adapter, exact (no upload, no quantization)
                self._found(lid, flatten(layout, self.init.tensors), now, source=self.init.source)
                return
            self._record("join", learner=lid, backend=backend, session=session, rejoin=rejoin, waiting_for="init")
            self._ask_founder(again_from=lid)
            return
        self._welcome(m, now, rejoin=rejoin, learner_version=h["version"])
        self._maybe_open(now)

    def _principal_problem(self, lid: int) -> Optional[str]:
        """Why this connection's key may not speak for learner `lid`, or None."""
        p = self.principal
        if p is not None and p.startswith("learner:") and p != f"learner:{lid}":
            return f"this connection's key belongs to {p}; it cannot join as learner {lid}"
        if p == "join" and lid in self.bound_ids:
            return f"learner {lid} has its own key (yeto keys add): join with that key, not the shared join key"
        return None

    def _admit_fresh(self, peer: str, lid: int, now: float) -> None:
        """A learner id new to the run: one connection speaks for one id, and ids beyond --learners (the ones the run
        does not expect) come at most FRESH_IDS_PER_WINDOW per key holder per window and never fill the share of
        --max-learners kept for the expected ones, so a flood of fresh ids leaves room for a real learner."""
        if any(m.peer == peer and m.active for m in self.members.values()):
            raise ProtocolError("this connection already speaks for another learner id: one connection per learner",
                                Code.IDENTITY)
        if lid < self.cfg.learners:
            return
        if not self.fresh_ids.allow(self.principal or peer, now):
            raise ProtocolError(f"more than {FRESH_IDS_PER_WINDOW} new learner ids beyond --learners from this key in "
                                f"{RATE_WINDOW_S:g}s; retrying", Code.BUSY)
        unexpected = sum(1 for m in self.members.values() if m.active and m.learner >= self.cfg.learners)
        if unexpected >= self.cfg.max_learners - self.cfg.learners:
            raise ProtocolError(f"the run holds {unexpected} live learners beyond --learners {self.cfg.learners} "
                                f"(the rest of --max-learners {self.cfg.max_learners} is kept for those); retrying",
                                Code.BUSY)

    def _expire_silent_ids(self, now: float) -> None:
        """Ids beyond --learners that joined, never delivered a delta and are gone are forgotten (from `seen`,
        `owners` and so the checkpoint): a flood of fresh ids leaves nothing behind."""
        for lid in [x for x in self.seen if x >= self.cfg.learners and x not in self.merged and x not in self.pending]:
            m = self.members.get(lid)
            if m is None or (not m.active and now - m.last_seen > self.cfg.learner_timeout):
                self.seen.discard(lid)
                self.owners.pop(lid, None)
                self.members.pop(lid, None)

    def _evict_member(self) -> bool:
        """Make room for a new learner id by forgetting the longest-gone member; False if every member is live."""
        gone = [m for m in self.members.values() if not m.active]
        if not gone:
            return False
        del self.members[min(gone, key=lambda m: m.last_seen).learner]
        return True

    def _welcome(self, m: Member, now: float, rejoin: bool, learner_version: int) -> None:
        assert self.run is not None
        m.welcomed = True
        m.since = now
        self.seen.add(m.learner)
        self.knocking.pop(m.learner, None)  # it got back in: from here on its member record says when it is done
        r = self.round
        mine = self.pending.get(m.learner)
        contributed = r is not None and mine is not None
        open_round = None if r is None else self._round_header(r, now)
        self._send(m.peer, "welcome", {"incarnation": self.incarnation, "version": self.run.version,
                                       "digest": self.run.digest, "policy": self.cfg.policy(),
                                       "open_round": open_round, "contributed": contributed,
                                       "pending": mine.ref() if contributed else None,
                                       "merged": self.merged.get(m.learner, []),
                                       "finished": self.finished_at is not None,
                                       "shard": self._shard(m.learner)})
        self._record("join", learner=m.learner, backend=m.backend, session=m.session, rejoin=rejoin,
                     learner_version=learner_version, version=self.run.version,
                     round=r.number if r is not None else None, contributed=contributed)
        self._log("info", f"learner {m.learner} {'re' if rejoin else ''}joined ({m.backend}) at version "
                          f"{self.run.version}; {len(self._live())} live")
        if self.finish_header is not None:
            self._send(m.peer, "finish", self.finish_header_for_wire())

    def _shard(self, lid: int) -> list[int]:
        """[index, count]: the data shard learner `lid` trains on. The count is the run's (the founding learner's
        --num-learners, else --learners); a learner beyond it shares the shard of `lid` mod count."""
        assert self.run is not None
        count = int(self.run.contract.get("num_learners") or self.cfg.learners)
        return [lid % count, count]

    def _ask_founder(self, again_from: Optional[int] = None) -> None:
        """Ask one live member for the initial adapter: another one if the one asked is gone, the same one
        again when it says hello or pings again (the request, or its upload, was lost)."""
        f = self.founding
        if f is None or self.run is not None:
            return
        asked = self.members.get(f.asked) if f.asked is not None else None
        if asked is not None and asked.active:
            if again_from == f.asked:
                self._send(asked.peer, "init_request", {"bits": self.cfg.sync_bits})
            return
        candidates = sorted(m.learner for m in self._active())
        if not candidates:
            f.asked = None
            return
        f.asked = candidates[0]
        self._send(self.members[f.asked].peer, "init_request", {"bits": self.cfg.sync_bits})
        self._record("init_request", learner=f.asked, bits=self.cfg.sync_bits)

    def _on_init(self, peer: str, msg: Message, now: float) -> None:
        m = self._member(peer, msg, now)
        f = self.founding
        if self.run is not None and self.founder == m.learner:
            return  # a repeat of the upload that founded the run
        if self.run is not None or f is None or f.asked != m.learner:
            raise ProtocolError("an initial adapter nobody asked for", Code.WRONG_PHASE)
        flat = decode_fragments(f.layout, msg)
        self._found(m.learner, flat, now, bits=sorted({d["bits"] for d in msg.header["fragments"]}), bytes=msg.nbytes)

    def _found(self, founder: int, flat: np.ndarray, now: float, **fields: Any) -> None:
        """Commit version 0 (`flat`: the founding learner's upload, or --init-adapter) and welcome everyone."""
        f = self.founding
        assert f is not None
        self.founder = founder
        digest = array_digest(flat)
        self.ef = ErrorFeedback(f.layout.numel)
        self.run = Checkpoint(0, f.layout, f.adapter_config, f.provenance, flat, np.zeros_like(flat),
                              self.ef.residual, digest, asdict(self.cfg), [], {}, {}, f.contract)
        self.sum = RoundSum.for_rule(f.layout, self.cfg.merge)
        self.digests = {0: digest}
        self.founding = None
        known = set(self.seen)
        self.seen.update(x.learner for x in self._active())  # (saved with checkpoint 0: a restart waits for them)
        self._record("init", learner=founder, digest=digest, **fields)
        self.out.append(SaveCheckpoint(self._checkpoint()))
        self._record("checkpoint", version=0, digest=digest)
        for other in self._active():
            self._welcome(other, now, rejoin=other.learner in known, learner_version=-1)
        self._maybe_open(now)

    def _on_delta(self, peer: str, msg: Message, now: float) -> None:
        m = self._member(peer, msg, now)
        h = msg.header
        where = {"round": h["round"], "base_version": h["base_version"]}
        r = self.round
        digest = digest_bytes(msg.frames)
        if [h["round"], digest] in self.merged.get(m.learner, []):  # sent again after a lost ack: it counted
            self._send(m.peer, "ack", {**where, "digest": digest, "duplicate": True, "merged": True})
            return
        lag = r.base_version - h["base_version"] if r is not None else -1
        if r is None or h["round"] != h["base_version"] + 1 or not 0 <= lag <= self.cfg.max_base_lag:
            state = f"round {r.number} is open on version {r.base_version}" if r else f"no round is open (version " \
                                                                                     f"{self.version})"
            return self._refuse_delta(m, h, digest, Code.STALE, f"stale delta for round {h['round']} on version "
                                    f"{h['base_version']}: {state} (--max-base-lag {self.cfg.max_base_lag})", now)
        if lag and h.get("base_digest") != self.digests.get(h["base_version"]):
            return self._refuse_delta(m, h, digest, Code.REFUSED, f"delta trained from version {h['base_version']} "
                                      "as it was before the syncer rolled it back (or one it no longer knows): "
                                      "train from the current version", now)
        problem = _claims_problem(h, m.tokens_per_step, 0 if self.cfg.round_seconds else self.cfg.inner_steps)
        if problem:
            return self._refuse_delta(m, h, digest, Code.REFUSED, problem, now)
        if digest in self.refused_digests:  # a copy of a delta a merge already refused (stale copies come back)
            return self._refuse_delta(m, h, digest, Code.REFUSED, "this delta was refused by a merge", now)
        mine = self.pending.get(m.learner)
        if mine is not None:
            if mine.ref() == [h["round"], h["base_version"], digest]:
                self._send(m.peer, "ack", {**where, "digest": digest, "duplicate": True, "merge_round": r.number})
            else:
                self._refuse_delta(m, h, digest, Code.DUPLICATE, f"learner {m.learner} already contributed to round "
                                                         f"{r.number} (delta {mine.digest})", now)
            return
        try:
            flat = decode_fragments(self.run.layout, msg)  # sizes, bits and finiteness
        except ProtocolError as e:
            return self._refuse_delta(m, h, digest, Code.REFUSED, str(e), now)
        d = AcceptedDelta(m.learner, m.session, r.number, h["base_version"], h["tokens"], h["loss_tokens"],
                          h["inner_steps"], float(h["loss"]), digest, list(h["fragments"]), tuple(msg.frames),
                          carried_steps=h.get("carried_steps", 0))
        self._measure(d, flat)
        compute_s = h.get("compute_s")
        compute_s = float(compute_s) if isinstance(compute_s, (int, float)) and math.isfinite(compute_s) and \
            0 <= compute_s <= self.cfg.quorum_timeout else None
        self._record("delta", **self._delta_fields(d), bytes=msg.nbytes, norm=d.norm, compute_s=compute_s)
        self.out.append(SaveDelta(d))
        self.pending[m.learner] = d
        self.sum.add(m.learner, flat, self._weight(d), self._scale(d))  # the decoded copy is dropped
        self._send(m.peer, "ack", {**where, "digest": digest, "duplicate": False, "merge_round": r.number})
        if compute_s is not None:  # what the grace predicts its next push from
            m.round_s = compute_s if m.round_s is None else (ROUND_TIME_EMA * compute_s +
                                                             (1 - ROUND_TIME_EMA) * m.round_s)
            step_s = compute_s / max(1, d.inner_steps)
            m.step_s = step_s if m.step_s is None else ROUND_TIME_EMA * step_s + (1 - ROUND_TIME_EMA) * m.step_s
        m.since = now
        self._maybe_close(now)

    def _weight(self, d: AcceptedDelta) -> float:
        """The delta's unnormalised merge weight (--merge-weight)."""
        return weight_of(self._counts(d), self.cfg.merge_weight)

    def _scale(self, d: AcceptedDelta) -> float:
        """What a delta is scaled by before the rule: its staleness discount (--staleness-exponent; 1 when fresh)
        and, with --step-normalize, 1/its inner steps (the merge multiplies the result by the round's length)."""
        s = staleness_factor(d.lag, self.cfg.staleness_exponent)
        return s / max(1, d.inner_steps) if self.cfg.step_normalize else s

    def _fresh(self) -> int:
        """Pending deltas trained from the open round's base."""
        return sum(1 for d in self.pending.values() if d.lag == 0)

    @staticmethod
    def _counts(d: AcceptedDelta) -> DeltaCounts:
        return DeltaCounts(d.loss_tokens, d.tokens, d.inner_steps)

    @staticmethod
    def _delta_fields(d: AcceptedDelta) -> dict[str, Any]:
        return {"learner": d.learner, "round": d.round, "base_version": d.base_version, "digest": d.digest,
                "tokens": d.tokens, "loss_tokens": d.loss_tokens, "inner_steps": d.inner_steps, "loss": d.loss,
                "bits": sorted({x["bits"] for x in d.descs}), "lag": d.lag, "round_steps": d.round_steps}

    def _decode(self, d: AcceptedDelta) -> np.ndarray:
        return decode_fragments(self.run.layout, Message("delta", {"fragments": d.descs}, list(d.frames)))

    def _decode_fragment(self, d: AcceptedDelta, k: int) -> np.ndarray:
        return dequantize(d.frames[k], self.run.layout.fragments[k].numel, d.descs[k]["bits"])

    @staticmethod
    def _measure(d: AcceptedDelta, flat: np.ndarray) -> None:
        d.peak = float(np.abs(flat).max()) if flat.size else 0.0
        d.norm = float(np.linalg.norm(flat.astype(np.float64)))

    def _refuse_delta(self, m: Member, h: dict[str, Any], digest: str, code: Code, reason: str, now: float) -> None:
        """Not accepted: the error names the delta (round, base version, digest), so a learner that has pushed
        that round again since knows it is not about its newer delta."""
        if not self._may_reply(m.peer, now):
            return
        reason = truncate(reason)
        self._record("reject", learner=m.learner, round=h["round"], base_version=h["base_version"], digest=digest,
                     code=str(code), reason=reason)
        self._send(m.peer, "error", {"code": str(code), "reason": reason, "round": h["round"],
                                     "base_version": h["base_version"], "digest": digest, "version": self.version})

    def _on_ping(self, peer: str, msg: Message, now: float) -> None:
        m = self._member(peer, msg, now)
        pushed = msg.header["pushed"]
        mine = self.pending.get(m.learner)
        have = bool(pushed and mine is not None and mine.ref() == pushed[:3])
        r = self.round
        window = {"seconds_left": self._round_header(r, now)["seconds_left"]} if r and self.cfg.round_seconds else {}
        self._send(m.peer, "pong", {"incarnation": self.incarnation, "version": self.version,
                                    "round": r.number if r else self.version, "round_open": r is not None,
                                    "have_delta": have, "contributed": r is not None and mine is not None,
                                    "finished": self.finished_at is not None, **window})
        if self.finish_header is not None:
            self._send(m.peer, "finish", self.finish_header_for_wire())  # it may have missed the first one

    def _on_sync(self, peer: str, msg: Message, now: float) -> None:
        m = self._member(peer, msg, now)
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

    # ------------------------------------------------------------------ rounds

    def _maybe_open(self, now: float) -> None:
        run = self.run
        if run is None or self.round is not None or self.finished_at is not None:
            return
        if run.version >= self.cfg.outer_steps:
            self._finish("outer steps done", now, code=0, complete=True)
            return
        live = len(self._live())
        if not self.started:
            if live < self._quorum():
                self.gate_since = None
                return
            if self.gate_since is None:
                self.gate_since = now
            if live < self.cfg.learners - self._given_up_count() and now - self.gate_since < self.cfg.straggler_timeout:
                return  # round 1 waits for --learners, or for quorum plus --straggler-timeout
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
        self._maybe_close(now)

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
        return RoundMembers(tuple(sorted(self.pending)), self._fresh(), waiting, absent)

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

    def observe_merge(self, seconds: float) -> None:
        """The shell measured how long a merge took: the grace leaves that much of the cap for it."""
        if math.isfinite(seconds) and seconds >= 0:
            self.merge_s = MERGE_TIME_EMA * seconds + (1 - MERGE_TIME_EMA) * self.merge_s

    def _close_round(self, now: float, stragglers: list[int]) -> None:
        """Merge the round as a transaction; a delta that breaks the merge is refused and the merge retried."""
        r = self.round
        assert r is not None and self.run is not None
        r.advance(RoundPhase.MERGING)
        while len(self.pending) >= self._quorum():
            ids = self._order()
            try:
                merged = self._merge(ids)
            except MergeError as e:
                contribution = self._contributions(ids)  # (the delta that moves the merge most, not the largest)
                culprit = max(ids, key=lambda i: (contribution[i], i))
                self._refuse_merged(culprit, f"round {r.number} could not be merged with this delta: {e}")
                continue
            self._commit(r, ids, merged, stragglers, now)
            return
        r.quorum_at = r.fresh_at = None  # refusals took the round back below quorum: it stays open
        r.advance(RoundPhase.OPEN)

    def _refuse_merged(self, lid: int, reason: str) -> None:
        d = self.pending.pop(lid)
        order = self._order()
        # rebuilt without it, in the order the others arrived
        self.sum = RoundSum.for_rule(self.run.layout, self.cfg.merge)
        for i in order:
            self.sum.add(i, self._decode(self.pending[i]), self._weight(self.pending[i]), self._scale(self.pending[i]))
        reason = truncate(reason)
        self._record("refuse_delta", learner=lid, round=d.round, digest=d.digest, reason=reason)
        self.out.append(DropDeltas(round=d.round, learner=lid))
        m = self.members.get(lid)
        if m is not None and m.active:
            self._send(m.peer, "error", {"code": str(Code.REFUSED), "reason": reason, "round": d.base_version + 1,
                                         "base_version": d.base_version, "digest": d.digest, "version": self.version})
        self._remember_refused(d.digest)
        self._log("warning", f"refused learner {lid}'s delta: {reason}")

    def _remember_refused(self, digest: str) -> None:
        self.refused_digests[digest] = None
        while len(self.refused_digests) > MAX_REFUSED_REMEMBERED:
            del self.refused_digests[next(iter(self.refused_digests))]

    def _order(self) -> list[int]:
        """The pending deltas' learners in the order they were added to the running sum."""
        return [i for i in self.sum.order if i in self.pending] if self.sum is not None else sorted(self.pending)

    def _terms(self, ids: list[int]) -> MergeTerms:
        """The bounded weights and scales of merging these pending deltas (`yeto.sync.merge.merge_terms`)."""
        ds = [self.pending[i] for i in ids]
        return merge_terms([self._counts(d) for d in ds], self.cfg.merge_weight, [d.lag for d in ds],
                           self.cfg.staleness_exponent, bool(self.cfg.step_normalize), [d.round_steps for d in ds])

    def _bounded_sum(self, ids: list[int], terms: MergeTerms) -> RoundSum:
        """The round's running sum, or, where a claim was capped or a scale bounded, the sum rebuilt with what each
        delta counts for (the running sum adds each delta as it arrives, before the round's median is known)."""
        arrived = [(self._weight(self.pending[i]), self._scale(self.pending[i])) for i in ids]
        if all(a == (w, sc) for a, w, sc in zip(arrived, terms.counted, terms.scales)):
            return self.sum.copy()
        s = RoundSum.for_rule(self.run.layout, self.cfg.merge)
        for i, w, sc in zip(ids, terms.counted, terms.scales):
            s.add(i, self._decode(self.pending[i]), w, sc)
        return s

    def _contributions(self, ids: list[int]) -> dict[int, float]:
        """How far each delta could move the merge: its bounded weight x scale x largest value."""
        t = self._terms(ids)
        total = sum(t.counted) or 1.0
        return {i: w / total * sc * t.length * self.pending[i].peak for i, w, sc in zip(ids, t.counted, t.scales)}

    def _merge(self, ids: list[int]) -> dict[str, Any]:
        run, cfg = self.run, self.cfg
        ds = [self.pending[i] for i in ids]
        terms = self._terms(ids)
        scales = dict(zip(ids, terms.scales))
        most = np.float32(terms.length)
        unnormalised = {i: effective_weight(w, scales[i]) for i, w in zip(ids, terms.counted)}
        norms = [d.norm * scales[i] * terms.length for i, d in zip(ids, ds)]  # (the deltas as they are merged)
        rule: dict[str, Any] = {}  # what the rule reports on the tape
        ref = clip_reference(norms, list(self.norm_history))
        try:
            with np.errstate(all="ignore"):
                weights = np.asarray(terms.counted, dtype=np.float64) / sum(terms.counted)
                clip: dict[int, float] = {}
                if cfg.robust == "trimmed-mean":  # fragment by fragment: n fragments in memory, not n adapters
                    avg = trimmed_mean(lambda k: np.stack([self._decode_fragment(self.pending[i], k) * np.float32(
                        scales[i] * most) for i in ids]), terms.counted, run.layout)
                else:
                    if cfg.robust == "norm-clip":
                        factors = clip_factors(norms, ref, cfg.robust_k)
                        clip = {i: c for i, c in zip(ids, factors) if c < 1.0}
                    if cfg.lora_merge == "factors":  # the running sums: one or two vectors in memory, not n
                        avg, fallbacks = clipped_merge(self._bounded_sum(ids, terms), clip, unnormalised,
                                                       lambda i: self._decode(self.pending[i]))
                        avg = avg * most
                        rule = {} if fallbacks is None else {"rda_fallbacks": fallbacks}
                    else:  # every delta at once (LoRA adapters are small: n of them fit where one base does not)
                        deltas = [self._decode(self.pending[i]) * np.float32(clip.get(i, 1.0) * scales[i] * most)
                                  for i in ids]
                        pm = product_merge([run.global_ + d for d in deltas], weights, run.layout)
                        avg = pm.merged - run.global_
                        rule = {"residual": pm.residual, "residual_mean": pm.residual_mean}
                new_global, momentum = nesterov_step(run.global_, avg, run.momentum, cfg.outer_lr, cfg.outer_momentum)
                if not (np.isfinite(new_global).all() and np.isfinite(momentum).all()):
                    raise MergeError("the outer step overflows")
                ef = ErrorFeedback(run.layout.numel)
                ef.residual = self.ef.residual
                descs, frames, sent = encode_fragments_ef(run.layout, new_global - run.global_, cfg.sync_bits, ef)
                committed = run.global_ + sent
                if not np.isfinite(committed).all():
                    raise MergeError("the new global adapter is not finite")
        except (QuantError, ValueError, FloatingPointError, OverflowError) as e:
            raise MergeError(str(e)) from e
        bounds = {"counted": list(terms.counted), "merged_norms": [n * clip.get(i, 1.0) for i, n in zip(ids, norms)],
                  "clip_ref": ref if cfg.robust == "norm-clip" else None}
        weights = weights * np.asarray([scales[i] * float(most) for i in ids])  # what each delta counted for
        return {"global": committed, "momentum": momentum, "residual": ef.residual, "weights": weights,
                "descs": descs, "frames": tuple(frames), "sent": sent, "clip": clip, "rule": rule, "bounds": bounds}

    def _commit(self, r: OpenRound, ids: list[int], merged: dict[str, Any], stragglers: list[int], now: float) -> None:
        r.advance(RoundPhase.COMMITTED)
        run = self.run
        version = run.version + 1
        digest = array_digest(merged["global"])
        summed, ids = ids, sorted(ids)  # the tape lists responders sorted, and the order they were summed in
        weights = [float(w) for _, w in sorted(zip(summed, merged["weights"]))]
        b = merged["bounds"]
        bounds = {"clip_ref": b["clip_ref"], **{k: [float(x) for _, x in sorted(zip(summed, b[k]))]
                                                for k in ("counted", "merged_norms")}}
        deltas = [self.pending[i].digest for i in ids]
        lags = [self.pending[i].lag for i in ids]
        self._record("merge", round=r.number, version=version, responders=ids, weights=weights,
                     loss_tokens=[self.pending[i].loss_tokens for i in ids], deltas=deltas, digest=digest,
                     stragglers=stragglers, update_norm=float(np.linalg.norm(merged["sent"])), summed=summed,
                     robust=self.cfg.robust, clip={str(i): c for i, c in merged["clip"].items()},
                     merge=self.cfg.merge, merge_weight=self.cfg.merge_weight, lora_merge=self.cfg.lora_merge,
                     step_normalize=self.cfg.step_normalize,
                     lags=lags, **bounds,
                     grace_s=round(now - r.fresh_at, 6) if r.fresh_at is not None else None, **merged["rule"])
        if merged["clip"]:
            self._log("warning", f"round {r.number}: robust merge clipped learner(s) "
                                 f"{', '.join(f'{i} (x{c:.3g})' for i, c in merged['clip'].items())}")
        self.norm_history.extend(b["merged_norms"])
        for i in ids:
            d = self.pending[i]
            history = self.merged.setdefault(i, [])
            history.append(d.ref()[::2])  # [the round it trained, digest]: as its learner names it
            del history[:-MERGED_HISTORY]
            m = self.members.get(i)
            if m is not None and d.lag == 0:
                m.since = now  # it waited for this merge: it trains from the broadcast on
        self.run = Checkpoint(version, run.layout, run.adapter_config, run.provenance, merged["global"],
                              merged["momentum"], merged["residual"], digest, asdict(self.cfg), sorted(self.seen),
                              dict(self.merged), contract=run.contract)
        self.ef.residual = merged["residual"]
        self.digests[version] = digest
        for v in [v for v in self.digests if v < version - self.cfg.max_base_lag]:
            del self.digests[v]
        self.out.append(SaveCheckpoint(self._checkpoint()))
        self._record("checkpoint", version=version, digest=digest)
        self.out.append(DropDeltas(through_round=r.number))
        self.pending = {}
        self.sum = RoundSum.for_rule(run.layout, self.cfg.merge)
        self.round = None
        header = {"version": version, "round": r.number, "digest": digest, "responders": ids, "weights": weights,
                  "deltas": deltas, "lags": lags, "fragments": merged["descs"]}
        self.last_broadcast = Broadcast(version, header, merged["frames"])
        to = []
        for m in self._live():
            self._send(m.peer, "broadcast", header, merged["frames"])
            to.append(m.learner)
        self._record("broadcast", round=r.number, version=version, to=to, bits=self.cfg.sync_bits)
        self._log("info", f"round {r.number} merged {ids} weights {[round(w, 3) for w in weights]}; version {version}")
        self._maybe_open(now)

    def _finish(self, reason: str, now: float, code: int, complete: bool, linger_s: Optional[float] = None) -> None:
        self.finished_at = now
        self.linger_until = now + (FINISH_LINGER_TIMEOUTS * self.cfg.learner_timeout if linger_s is None else linger_s)
        if self.round is not None:
            self.round.advance(RoundPhase.ABANDONED)
        self.round = None
        self.finish_header = {"version": self.version, "reason": reason, "complete": complete, "code": code}
        for m in self._active():
            self._send(m.peer, "finish", self.finish_header_for_wire())
        self._record("finish", version=self.version, reason=reason, code=code, complete=complete,
                     outstanding=sorted(self.pending))
        if self._all_gone(now):
            self._exit()

    def finish_header_for_wire(self) -> dict[str, Any]:
        assert self.finish_header is not None
        return {k: v for k, v in self.finish_header.items() if k != "code"}


def _config_problem(adapter_config: Any, provenance: Any) -> Optional[str]:
    """Why a hello's peft config or provenance cannot define (or join) a run, or None."""
    if not isinstance(provenance, dict):
        return f"provenance must be a JSON object, got {type(provenance).__name__}"
    if len(json.dumps(provenance)) > MAX_PROVENANCE_BYTES:
        return f"provenance is over {MAX_PROVENANCE_BYTES >> 10} KiB"
    if len(json.dumps(adapter_config)) > MAX_ADAPTER_CONFIG_BYTES:
        return f"adapter_config is over {MAX_ADAPTER_CONFIG_BYTES >> 10} KiB"
    if adapter_config.get("peft_type") != "LORA":
        return f"adapter_config.peft_type must be 'LORA', got {truncate(repr(adapter_config.get('peft_type')), 40)}"
    r = adapter_config.get("r")
    if not isinstance(r, int) or isinstance(r, bool) or r < 1:
        return f"adapter_config.r must be a positive integer, got {truncate(repr(r), 40)}"
    alpha = adapter_config.get("lora_alpha")
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool) or not math.isfinite(alpha):
        return f"adapter_config.lora_alpha must be a number, got {truncate(repr(alpha), 40)}"
    return None


def _claims_problem(h: dict[str, Any], tokens_per_step: int, round_steps: int) -> Optional[str]:
    """Why a delta's reported training cannot be true, or None: its step count must fit the round (`round_steps`,
    0 for time windows), its tokens what those steps can consume (`tokens_per_step`, declared at join)."""
    tokens, loss_tokens, steps, loss = h["tokens"], h["loss_tokens"], h["inner_steps"], h["loss"]
    if not 0 < loss_tokens <= tokens <= MAX_TOKENS_PER_DELTA:
        return f"delta with impossible token counts (tokens {tokens}, loss-bearing tokens {loss_tokens})"
    if not 0 < steps <= (round_steps or MAX_INNER_STEPS_PER_DELTA):
        return f"delta claims {steps} inner steps; the round allows {round_steps or MAX_INNER_STEPS_PER_DELTA}"
    carried = h.get("carried_steps", 0)
    if type(carried) is not int or not 0 <= carried <= steps:
        return f"delta claims {carried!r} steps carried in; it must be a count of its {steps} inner steps"
    if tokens_per_step and tokens > steps * tokens_per_step:
        return (f"delta claims {tokens} tokens in {steps} steps; this learner declared at most {tokens_per_step} "
                "tokens per step (batch x accumulation x sequence length)")
    if not (math.isfinite(loss) and 0 <= loss <= MAX_LOSS):
        return f"delta with impossible loss {loss}"
    return None


def _run_provenance(founder: dict[str, Any], contract: dict[str, Any]) -> dict[str, Any]:
    """What the syncer's adapter says about its origin: the run's contract and the base model it pins, never one
    learner's data, config or counts."""
    model = founder.get("model") if isinstance(founder.get("model"), dict) else {}
    return {"model": {k: model.get(k) for k in ("name", "kind", "source", "revision", "requested_revision", "hub_id")},
            "run": contract, "protocol": PROTOCOL_VERSION}
