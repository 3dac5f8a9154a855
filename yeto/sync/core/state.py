"""What the syncer's core holds, and the outbox its concerns put actions in.

`SyncerState` is the run's state, one record the core owns and lends to each concern: the run (the committed
checkpoint), the members, the open round and what it has received, and the reads every concern shares (who is live,
the quorum, the member a message comes from). It holds no behaviour beyond those reads. `SyncerOutbox` collects the
actions a call puts out (`record` on the tape, `send` to a peer, `log`) and answers refusals within a rate limit.
Each concern gets the state, the outbox and the few collaborators it calls: `admission` (hello, identity, founding),
`deltas` (a delta's intake), `merging` (the merge transaction), `recovery` (a start from what survived on disk),
`driver` (the open round: opening, closing, the finish); `syncer`'s `SyncerCore` owns them all and dispatches events
to them.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import asdict, dataclass, field
from typing import Any, Optional

from yeto.sync.core.actions import AcceptedDelta, Action, Checkpoint, Log, Record, Send
from yeto.sync.core.config import SyncerConfig
from yeto.sync.core.contract import InitAdapter
from yeto.sync.core.limits import RateLimit
from yeto.sync.core.quorum import quorum_after_give_ups
from yeto.sync.core.rounds import OpenRound
from yeto.sync.merge.aggregate import NORM_HISTORY, RoundSum
from yeto.sync.merge.rules import Tier, counts_toward_quorum
from yeto.sync.wire.layout import Layout, round_part
from yeto.sync.wire.protocol import Code, Message, ProtocolError, truncate
from yeto.sync.wire.quant import ErrorFeedback

STATE_REQUESTS_PER_WINDOW = 20  # full-state (or broadcast) resends per island per RATE_WINDOW_S
REPLIES_PER_WINDOW = 30  # refusals/errors answered and written to the tape per peer per RATE_WINDOW_S
RATE_WINDOW_S = 60.0
FRESH_IDS_PER_WINDOW = 32  # island ids beyond --islands one key holder may bring in per RATE_WINDOW_S
MAX_KNOCKING = 4096  # island ids remembered as trying to rejoin


@dataclass
class Member:
    island: int
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
    # answer that explains why) tells the island its copy arrived and was lost here, so it sends it again
    heard: Optional[list[Any]] = None
    held_version: int = -1  # the version its last ping or sync said it holds


@dataclass
class Founding:
    """The run has a layout but no initial adapter yet: one member is asked to upload it."""

    layout: Layout
    adapter_config: dict[str, Any]
    provenance: dict[str, Any]
    contract: dict[str, Any]
    asked: Optional[int] = None  # island id asked for the adapter
    # (island, session) -> its uploads that came and could not count (from a member dropped meanwhile, or not the one
    # asked any more): a request to that session says how many, or it takes its upload for still on its way and waits
    lost_uploads: dict[tuple[int, str], int] = field(default_factory=dict)


@dataclass(frozen=True)
class Refusal:
    """Why a message is refused: the code, the reason its island reads, and what the tape's record adds."""

    code: Code
    reason: str
    fields: dict[str, Any] = field(default_factory=dict)


@dataclass
class Broadcast:
    version: int
    header: dict[str, Any]
    frames: tuple[bytes, ...]


class SyncerState:
    """The run's state: what the concerns read and change (events come in through `SyncerCore`)."""

    def __init__(self, cfg: SyncerConfig, incarnation: str, init: Optional[InitAdapter] = None):
        """`init`: the adapter a new run starts from (--init-adapter), instead of the founding island's."""
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
        self.retired: dict[int, list[str]] = {}  # island id -> its sessions that a newer one took over
        self.knocking: dict[int, float] = {}  # island id of this run -> when it last got "not joined"
        self.seen: set[int] = set()
        self.owners: dict[int, str] = {}  # island id -> proof of the identity that holds it (hash of its secret)
        self.bound_ids: set[int] = set()  # island ids only their own key may speak for (yeto keys add)
        self.revoked: set[str] = set()  # principals whose keys were revoked
        self.given_up: dict[int, str] = {}  # island id -> why the fleet controller stopped bringing it back
        # given-up islands welcomed back: their give-up is taken back as the next round opens (the quorum of a round
        # never rises while it is open: one in its grace has met it)
        self.returning: set[int] = set()
        self.sum: Optional[RoundSum] = None  # the open round's running sum of accepted deltas
        # recent merged deltas' norms, per part of the adapter (a streamed run's parts differ in size and layers; the
        # whole adapter's key is None): the norm clip's reference
        self.norm_history: dict[Optional[tuple[int, ...]], deque[tuple[float, str]]] = {}  # (norm, tier) merged
        self.merged: dict[int, list] = {}  # island id -> its latest merged deltas, [[round, digest], ...]
        self.round: Optional[OpenRound] = None
        self.pending: dict[int, AcceptedDelta] = {}
        self.ahead: dict[int, dict[int, tuple[str, Message]]] = {}  # island id -> round -> (session, its pipelined
        # delta): pushed before its round opened (--pipeline), taken when it opens (memory only: at most D - 1 each)
        self.digests: dict[int, str] = {}  # recent committed versions -> global digest: a stale delta's base is checked
        self.merge_s = 0.0  # how long merges take (the shell measures it): the grace leaves room for it
        self.refused_digests: dict[str, None] = {}  # deltas a merge refused (oldest first): never accepted again
        self.last_broadcast: Optional[Broadcast] = None
        self.started = False  # round 1 has opened (the --islands gate is behind us)
        self.gate_since: Optional[float] = None
        self.absent_until = -math.inf  # after a restart: members known before it are expected until then
        self.finished_at: Optional[float] = None
        self.linger_until = math.inf
        self.linger_for_fetchers = True  # a finish lingers on while a live island fetches the final adapter; a stop
        # (a signal) does not: a person asked it to end
        self.finish_header: Optional[dict[str, Any]] = None
        self.exit_code: Optional[int] = None
        self.principal: Optional[str] = None  # of the message being handled

    @property
    def version(self) -> int:
        return self.run.version if self.run is not None else -1

    @property
    def done(self) -> bool:
        return self.exit_code is not None

    def given_up_count(self) -> int:
        return sum(1 for lid in self.given_up if 0 <= lid < self.cfg.islands)

    def quorum(self) -> int:
        return quorum_after_give_ups(self.cfg.quorum, self.cfg.islands, self.given_up_count())

    def counting(self) -> list[AcceptedDelta]:
        """The pending deltas that count toward the quorum (their tier's: `counts_toward_quorum`)."""
        return [d for d in self.pending.values() if counts_toward_quorum(d.tier)]

    def active(self) -> list[Member]:
        return [m for m in self.members.values() if m.active]

    def live(self) -> list[Member]:
        """Members that can train: active and welcomed."""
        return [m for m in self.members.values() if m.active and m.welcomed]

    def member(self, peer: str, msg: Message, now: float) -> Member:
        """The member a message comes from: its session current, on the connection that said hello (else an error
        that tells the island what to do: say hello, or stop, its session taken over)."""
        lid, session = msg.header["island"], msg.header["session"]
        m = self.members.get(lid)
        if session in self.retired.get(lid, ()):
            raise ProtocolError(f"island {lid} has a newer session; this one ({truncate(session, 20)}) is over",
                                Code.SUPERSEDED)
        said_goodbye = m is not None and m.session == session and m.left  # (its late messages are no knock)
        if m is not None and m.session == session and (peer != m.peer or self.principal != m.principal):
            raise ProtocolError(f"this connection did not join as island {lid}: a message is only accepted on the "
                                "connection that said hello", Code.IDENTITY)
        if m is not None and m.session != session:
            m = None  # a session we have not met: it must say hello (its hello may have been lost)
        if m is None or not m.active or (not m.welcomed and msg.type not in ("init", "leave", "ping")):
            if lid in self.seen and not said_goodbye and len(self.knocking) < MAX_KNOCKING:
                self.knocking[lid] = now  # an island of this run trying to get back in: a finished run waits for it
            raise ProtocolError(f"island {lid} has not joined: send hello first", Code.NOT_JOINED)
        m.last_seen = now
        return m

    def part(self, round_number: int) -> Optional[tuple[int, ...]]:
        """The fragments a round merges when the run streams its adapter (--fragments); None: all of them (as in the
        run's last round)."""
        return round_part(self.run.layout, self.cfg.fragments, round_number, self.cfg.outer_steps)

    def norm_history_of(self, part: Optional[tuple[int, ...]]) -> deque[tuple[float, str]]:
        """The recent merged norms of this part of the adapter (None: the whole of it), with their deltas' tiers."""
        return self.norm_history.setdefault(part, deque(maxlen=NORM_HISTORY))

    def checkpoint(self) -> Checkpoint:
        assert self.run is not None and self.ef is not None
        r = self.run
        return Checkpoint(r.version, r.layout, r.adapter_config, r.provenance, r.global_, r.momentum, self.ef.residual,
                          r.digest, asdict(self.cfg), sorted(self.seen), {k: list(v) for k, v in self.merged.items()},
                          {k: list(v) for k, v in self.retired.items()}, r.contract,
                          dict(self.owners))  # (copies: they keep changing)

    def finish_header_for_wire(self) -> dict[str, Any]:
        assert self.finish_header is not None
        return {k: v for k, v in self.finish_header.items() if k != "code"}


class SyncerOutbox:
    """The actions one event puts out, in order; refusals and errors answered within a rate limit per peer."""

    def __init__(self) -> None:
        self.actions: list[Action] = []
        self.replies = RateLimit(REPLIES_PER_WINDOW, RATE_WINDOW_S)

    def clear(self) -> None:
        """A new event begins (or a halt discards what this one said): nothing said yet."""
        self.actions = []

    def flush(self) -> list[Action]:
        out, self.actions = self.actions, []
        return out

    def add(self, action: Action) -> None:
        self.actions.append(action)

    def extend(self, actions: list[Action]) -> None:
        self.actions.extend(actions)

    def record(self, event: str, **fields: Any) -> None:
        self.actions.append(Record(event, fields))

    def log(self, level: str, text: str) -> None:
        self.actions.append(Log(level, text))

    def send(self, peer: str, msg_type: str, header: dict[str, Any], frames: tuple[bytes, ...] = ()) -> None:
        self.actions.append(Send(peer, msg_type, header, frames))

    def reject(self, peer: str, reason: str, code: Code, now: float) -> None:
        """An error answer to a message that is not an island's (malformed, unauthenticated, or a core bug)."""
        if not self.may_reply(peer, now):
            return
        reason = truncate(reason)
        self.record("reject", peer=truncate(peer, 80), code=str(code), reason=reason)
        self.send(peer, "error", {"code": str(code), "reason": reason})

    def refuse(self, peer: str, lid: int, code: Code, reason: str, now: float, **fields: Any) -> None:
        if not self.may_reply(peer, now):
            return
        reason = truncate(reason)
        self.record("refuse", island=lid, code=str(code), reason=reason, **fields)
        self.send(peer, "refuse", {"code": str(code), "reason": reason})
        self.log("warning", f"refused island {lid}: {reason}")

    def may_reply(self, peer: str, now: float) -> bool:
        """One peer's refusals cost at most REPLIES_PER_WINDOW tape lines and answers per window; the excess is
        counted on the tape once the next window opens."""
        ok = self.replies.allow(peer, now)
        skipped = self.replies.expired_refusals.pop(peer, 0)
        if skipped:
            self.record("replies_suppressed", peer=truncate(peer, 80), count=skipped)
        return ok
