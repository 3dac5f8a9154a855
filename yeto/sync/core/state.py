"""What the syncer's core holds, and the helpers every concern of it shares.

`SyncerState` holds the run (the committed checkpoint), the members, the open round and what it has received; its
helpers put actions out (`_record` on the tape, `_send` to a peer, `_log`), answer refusals within a rate limit, and
look members up. The concerns build on it, each in its own module: `admission` (hello, identity, founding), `deltas`
(a delta's intake), `merging` (the merge transaction), `recovery` (a start from what survived on disk); `syncer`'s
`SyncerCore` combines them and drives the round. The four round hooks at the end are `SyncerCore`'s: a concern calls
them when what it did may open, close or end a round.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import asdict, dataclass, field
from typing import Any, Optional

from yeto.sync.core.actions import AcceptedDelta, Action, Checkpoint, Exit, Log, Record, Send
from yeto.sync.core.config import SyncerConfig
from yeto.sync.core.contract import InitAdapter
from yeto.sync.core.limits import RateLimit
from yeto.sync.core.quorum import quorum_after_give_ups
from yeto.sync.core.rounds import OpenRound
from yeto.sync.merge.aggregate import NORM_HISTORY, RoundSum
from yeto.sync.merge.rules import Tier
from yeto.sync.wire.layout import Layout
from yeto.sync.wire.protocol import Code, Message, ProtocolError, truncate
from yeto.sync.wire.quant import ErrorFeedback

STATE_REQUESTS_PER_WINDOW = 20  # full-state (or broadcast) resends per learner per RATE_WINDOW_S
REPLIES_PER_WINDOW = 30  # refusals/errors answered and written to the tape per peer per RATE_WINDOW_S
RATE_WINDOW_S = 60.0
FRESH_IDS_PER_WINDOW = 32  # learner ids beyond --learners one key holder may bring in per RATE_WINDOW_S
MAX_KNOCKING = 4096  # learner ids remembered as trying to rejoin


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
    tier: str = Tier.BOUNDED  # how far its claims are believed (yeto.sync.merge.rules.Tier; set at join by its key)
    tokens_per_step: int = 0  # declared at join: bounds its token claims
    round_s: Optional[float] = None  # its observed compute time per round (running estimate)
    step_s: Optional[float] = None  # ... and per inner step (time windows: how far its push may trail the window)
    since: float = 0.0  # when it (last) started training: a round's open, or the ack of its delta
    # the syncer's last answer about a delta of its (the ack or error sent, and which copy of the delta it answered):
    # every pong repeats it, so an answer lost on the control connection is learned without sending the delta again
    last_answer: Optional[dict[str, Any]] = None
    # [digest, copy] of the last delta message taken from it: a pong that says so and holds no delta of its (with no
    # answer that explains why) tells the learner its copy arrived and was lost here, so it sends it again
    heard: Optional[list[Any]] = None
    held_version: int = -1  # the version its last ping or sync said it holds


@dataclass
class Founding:
    """The run has a layout but no initial adapter yet: one member is asked to upload it."""

    layout: Layout
    adapter_config: dict[str, Any]
    provenance: dict[str, Any]
    contract: dict[str, Any]
    asked: Optional[int] = None  # learner id asked for the adapter
    # (learner, session) -> its uploads that came and could not count (from a member dropped meanwhile, or not the one
    # asked any more): a request to that session says how many, or it takes its upload for still on its way and waits
    lost_uploads: dict[tuple[int, str], int] = field(default_factory=dict)


@dataclass(frozen=True)
class Refusal:
    """Why a message is refused: the code, the reason its learner reads, and what the tape's record adds."""

    code: Code
    reason: str
    fields: dict[str, Any] = field(default_factory=dict)


@dataclass
class Broadcast:
    version: int
    header: dict[str, Any]
    frames: tuple[bytes, ...]


class SyncerState:
    """The core's state and shared helpers (events come in through `yeto.sync.core.syncer.SyncerCore`)."""

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
        # recent merged deltas' norms, per part of the adapter (a streamed run's parts differ in size and layers; the
        # whole adapter's key is None): the norm clip's reference
        self.norm_history: dict[Optional[tuple[int, ...]], deque[tuple[float, str]]] = {}  # (norm, tier) merged
        self.merged: dict[int, list] = {}  # learner id -> its latest merged deltas, [[round, digest], ...]
        self.round: Optional[OpenRound] = None
        self.pending: dict[int, AcceptedDelta] = {}
        self.ahead: dict[int, dict[int, tuple[str, Message]]] = {}  # learner id -> round -> (session, its pipelined
        # delta): pushed before its round opened (--pipeline), taken when it opens (memory only: at most D - 1 each)
        self.digests: dict[int, str] = {}  # recent committed versions -> global digest: a stale delta's base is checked
        self.merge_s = 0.0  # how long merges take (the shell measures it): the grace leaves room for it
        self.refused_digests: dict[str, None] = {}  # deltas a merge refused (oldest first): never accepted again
        self.last_broadcast: Optional[Broadcast] = None
        self.started = False  # round 1 has opened (the --learners gate is behind us)
        self.gate_since: Optional[float] = None
        self.absent_until = -math.inf  # after a restart: members known before it are expected until then
        self.finished_at: Optional[float] = None
        self.linger_until = math.inf
        self.linger_for_fetchers = True  # a finish lingers on while a live learner fetches the final adapter; a stop
        # (a signal) does not: a person asked it to end
        self.finish_header: Optional[dict[str, Any]] = None
        self.exit_code: Optional[int] = None
        self.internal_errors: set[str] = set()
        self.last_tick = math.inf  # (no jump before the first tick)
        self.principal: Optional[str] = None  # of the message being handled
        self.out: list[Action] = []

    @property
    def version(self) -> int:
        return self.run.version if self.run is not None else -1

    @property
    def done(self) -> bool:
        return self.exit_code is not None

    def _given_up_count(self) -> int:
        return sum(1 for lid in self.given_up if 0 <= lid < self.cfg.learners)

    def _quorum(self) -> int:
        return quorum_after_give_ups(self.cfg.quorum, self.cfg.learners, self._given_up_count())

    # ------------------------------------------------------------------ actions out

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

    def _norm_history(self, part: Optional[tuple[int, ...]]) -> deque[tuple[float, str]]:
        """The recent merged norms of this part of the adapter (None: the whole of it), with their deltas' tiers."""
        return self.norm_history.setdefault(part, deque(maxlen=NORM_HISTORY))

    def _exit(self) -> None:
        if self.exit_code is None:
            self.exit_code = int(self.finish_header.get("code", 0)) if self.finish_header else 0
            self.out.append(Exit(self.exit_code))

    # ------------------------------------------------------------------ members

    def _active(self) -> list[Member]:
        return [m for m in self.members.values() if m.active]

    def _live(self) -> list[Member]:
        """Members that can train: active and welcomed."""
        return [m for m in self.members.values() if m.active and m.welcomed]

    def _member(self, peer: str, msg: Message, now: float) -> Member:
        """The member a message comes from: its session current, on the connection that said hello (else an error
        that tells the learner what to do: say hello, or stop, its session taken over)."""
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

    def _drop(self, m: Member, reason: str, now: float) -> None:
        m.active = False
        self.ahead.pop(m.learner, None)
        self._record("leave", learner=m.learner, reason=truncate(reason), version=self.version)
        self._log("info", f"learner {m.learner} left ({reason}); {len(self._active())} active")

    def _checkpoint(self) -> Checkpoint:
        assert self.run is not None and self.ef is not None
        r = self.run
        return Checkpoint(r.version, r.layout, r.adapter_config, r.provenance, r.global_, r.momentum, self.ef.residual,
                          r.digest, asdict(self.cfg), sorted(self.seen), {k: list(v) for k, v in self.merged.items()},
                          {k: list(v) for k, v in self.retired.items()}, r.contract,
                          dict(self.owners))  # (copies: they keep changing)

    def finish_header_for_wire(self) -> dict[str, Any]:
        assert self.finish_header is not None
        return {k: v for k, v in self.finish_header.items() if k != "code"}

    # ------------------------------------------------------------------ the round's driver (SyncerCore's)

    def _maybe_open(self, now: float) -> None:
        """Open the next round if the run can (founded, not finished, its gate passed)."""
        raise NotImplementedError

    def _maybe_close(self, now: float) -> None:
        """Close the open round if its `close_decision` says so."""
        raise NotImplementedError

    def _round_header(self, r: OpenRound, now: float) -> dict[str, Any]:
        """What a learner trains the open round by."""
        raise NotImplementedError

    def _finish(self, reason: str, now: float, code: int, complete: bool, linger_s: Optional[float] = None) -> None:
        """End the run: every learner is told, and the syncer exits once they had their chance to hear it."""
        raise NotImplementedError
