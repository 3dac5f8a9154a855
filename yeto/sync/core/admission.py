"""Admission: who may join the run, as whom, and how a new run is founded.

A hello is checked in steps that read in order: its own fields (`_checked_hello`), then whether the island fits the
run (`_hello_refusal`: its config, its key, its adapter's layout, its contract, the size of its deltas), then its
claim to an island id (`_check_id_free`: the identity that holds the id; `_make_room`: the limits on fresh ids and
on members; `_take_over`: a new session for a known id), and it joins (`_join`). A refusal is answered and on the tape;
a malformed hello is an error. Before the run has a version 0, the first hello defines its layout and contract
(`_begin_founding`) and one member is asked for the initial adapter (`_ask_founder`, `_on_init`, `_found`), unless the
syncer was given one (--init-adapter). A welcome tells a member the run's state and its data shard.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict
from typing import Any, Callable, Optional

import numpy as np

from yeto.sync.core.actions import Checkpoint, SaveCheckpoint
from yeto.sync.core.contract import contract_mismatch, contract_problem, init_adapter_problem, run_contract
from yeto.sync.core.limits import RateLimit
from yeto.sync.core.rounds import round_header
from yeto.sync.core.state import (FRESH_IDS_PER_WINDOW, RATE_WINDOW_S, Founding, Member, Refusal, SyncerOutbox,
                                  SyncerState)
from yeto.sync.merge.aggregate import RoundSum
from yeto.sync.merge.rules import Tier
from yeto.sync.wire.layout import Layout, flatten, layout_from_json, layout_mismatch, stream_parts
from yeto.sync.wire.protocol import (ISLAND_PRINCIPAL, PROTOCOL_VERSION, Code, Message, ProtocolError, array_digest,
                                     decode_fragments, identity_proof, message_size, session_start, truncate)
from yeto.sync.wire.quant import ErrorFeedback

MAX_ADAPTER_CONFIG_BYTES = 64 << 10
MAX_PROVENANCE_BYTES = 256 << 10
MAX_SESSION_CHARS = 64
MAX_BACKEND_CHARS = 32
MAX_ISLAND_ID = (1 << 31) - 1
MAX_LOST_UPLOADS = 64  # sessions whose founding uploads came and did not count, remembered to ask them again
MAX_RETIRED_SESSIONS = 8  # per island id: older sessions that get "superseded" instead of "say hello"


class Admission:
    """Hello, identity and sessions, founding, welcome."""

    def __init__(self, state: SyncerState, outbox: SyncerOutbox, open_round: Callable[[float], None]):
        """`open_round(now)`: the round driver's, called when a member joins a founded run or the run is founded."""
        self.state = state
        self.outbox = outbox
        self.open_round = open_round
        self.fresh_ids = RateLimit(FRESH_IDS_PER_WINDOW, RATE_WINDOW_S)  # per principal (or connection, insecure)

    def on_hello(self, peer: str, msg: Message, now: float) -> None:
        """An island asks to join: its hello is checked, then what it claims (its id, its identity, its session),
        then it becomes a member; before the run is founded it is asked for (or waits for) the initial adapter."""
        s = self.state
        h = msg.header
        if s.run is None and s.finished_at is not None:
            self.outbox.send(peer, "finish", s.finish_header_for_wire())
            return
        layout = self._checked_hello(h)
        refusal = self._hello_refusal(h, layout)
        if refusal is not None:
            self.outbox.refuse(peer, h["island"], refusal.code, refusal.reason, now, **refusal.fields)
            return
        old = s.members.get(h["island"])
        proof = identity_proof(h["identity"])
        self._check_id_free(h["island"], old, proof, now)
        if old is None:
            self._make_room(peer, h["island"], now)
        elif old.session != h["session"] and not self._take_over(old, h["session"]):
            self.outbox.send(peer, "finish", s.finish_header_for_wire())  # the run is over anyway: it may stop
            return
        self._join(peer, h, layout, proof, rejoin=old is not None or h["island"] in s.seen, now=now)

    def _checked_hello(self, h: dict[str, Any]) -> Layout:
        """The hello's own fields, checked (a malformed one is an error, not a refusal); returns its layout."""
        lid, session = h["island"], h["session"]
        if not 0 <= lid <= MAX_ISLAND_ID:
            raise ProtocolError(f"island id must be between 0 and {MAX_ISLAND_ID}")
        if session in self.state.retired.get(lid, ()):
            raise ProtocolError(f"island {lid}'s session {truncate(session, 20)} was taken over by a newer one",
                                Code.SUPERSEDED)
        if not 0 < len(session) <= MAX_SESSION_CHARS or len(h["backend"]) > MAX_BACKEND_CHARS:
            raise ProtocolError(f"hello: session must be 1-{MAX_SESSION_CHARS} characters and backend at most "
                                f"{MAX_BACKEND_CHARS}")
        try:
            return layout_from_json(h["layout"])
        except (KeyError, TypeError, ValueError, OverflowError) as e:
            raise ProtocolError(f"hello: malformed layout ({truncate(str(e), 200)})") from e

    def _hello_refusal(self, h: dict[str, Any], layout: Layout) -> Optional[Refusal]:
        """Why this island cannot join the run, or None: its config, its key, its adapter's layout, its contract,
        the syncer's --init-adapter, or the size its deltas would be (checked in that order)."""
        s = self.state
        lid, backend = h["island"], {"backend": h["backend"]}
        problem = _config_problem(h["adapter_config"], h.get("provenance", {})) or contract_problem(h["contract"])
        if problem:
            return Refusal(Code.BAD_CONFIG, problem, backend)
        bound = self._principal_problem(lid)
        if bound:
            return Refusal(Code.IDENTITY, bound, {"principal": s.principal})
        run_layout = s.run.layout if s.run else s.founding.layout if s.founding else None
        problem = layout_mismatch(run_layout, layout) if run_layout is not None else None
        if problem:
            return Refusal(Code.LAYOUT, f"adapter layout differs from the run's: {problem}", backend)
        contract = s.run.contract if s.run else s.founding.contract if s.founding else s.cfg.pinned()
        problem = contract_mismatch(contract, h["contract"])
        if problem:
            return Refusal(Code.CONTRACT, f"this island does not match the run's contract: {problem}; start it with "
                           "the run's settings", backend)
        problem = init_adapter_problem(s.init, layout, h["adapter_config"], h["contract"]) \
            if s.run is None and s.init is not None else None
        if problem:
            return Refusal(Code.CONTRACT, f"the syncer's --init-adapter {s.init.source} cannot start this run: "
                           f"{problem}; start the islands with its settings, or the syncer with another adapter",
                           backend)
        need = message_size(layout, s.cfg.sync_bits)
        if need > s.max_message_bytes:
            return Refusal(Code.TOO_LARGE, f"this adapter's deltas ({layout.numel:,} values at {s.cfg.sync_bits} "
                           f"bits) need messages of {need / 2**20:.0f} MiB, above --max-message-mb "
                           f"{s.cfg.max_message_mb}: restart the syncer with a larger --max-message-mb", backend)
        return None

    def _tier(self, lid: int) -> Tier:
        """What this connection's key makes of island `lid`'s claims: its own key (issued by the operator), or no key
        at all (--insecure, loopback only), is trusted; the shared join key is bounded, an id beyond --islands
        extra."""
        s = self.state
        p = s.principal
        if p is None or p.startswith(ISLAND_PRINCIPAL):
            return Tier.TRUSTED
        return Tier.BOUNDED if lid < s.cfg.islands else Tier.EXTRA

    def _principal_problem(self, lid: int) -> Optional[str]:
        """Why this connection's key may not speak for island `lid`, or None."""
        s = self.state
        p = s.principal
        if p is not None and p.startswith(ISLAND_PRINCIPAL) and p != f"{ISLAND_PRINCIPAL}{lid}":
            return f"this connection's key belongs to {p}; it cannot join as island {lid}"
        if p == "join" and lid in s.bound_ids:
            return (f"island {lid} has its own key (keys/islands/{lid}.key under the syncer's --out): join with "
                    "that key, not the shared join key")
        return None

    def _check_id_free(self, lid: int, old: Optional[Member], proof: str, now: float) -> None:
        """Another identity claims a held id: refused while its holder is live (or expected back after a restart); a
        relaunched island on a new machine gets the id once the old holder is gone."""
        s = self.state
        owner = s.owners.get(lid)
        held = (old is not None and old.active) or (old is None and lid in s.seen and now < s.absent_until)
        if owner is not None and owner != proof and held:
            raise ProtocolError(f"island id {lid} is held by a live island with another identity; retrying until it "
                                "goes silent (two islands with the same --island-id?)", Code.ID_TAKEN)

    def _make_room(self, peer: str, lid: int, now: float) -> None:
        """An island id with no member record: admitted if new to the run within its limits, and with room for it."""
        s = self.state
        if lid not in s.seen:
            self._admit_fresh(peer, lid, now)
        if len(s.members) >= s.cfg.max_islands and not self._evict_member():
            raise ProtocolError(f"the run holds --max-islands {s.cfg.max_islands} live islands; retrying",
                                Code.BUSY)

    def _admit_fresh(self, peer: str, lid: int, now: float) -> None:
        """An island id new to the run: one connection speaks for one id, and ids beyond --islands (the ones the run
        does not expect) come at most FRESH_IDS_PER_WINDOW per key holder per window and never fill the share of
        --max-islands kept for the expected ones, so a flood of fresh ids leaves room for a real island."""
        s = self.state
        if any(m.peer == peer and m.active for m in s.members.values()):
            raise ProtocolError("this connection already speaks for another island id: one connection per island",
                                Code.IDENTITY)
        if lid < s.cfg.islands:
            return
        if not self.fresh_ids.allow(s.principal or peer, now):
            raise ProtocolError(f"more than {FRESH_IDS_PER_WINDOW} new island ids beyond --islands from this key in "
                                f"{RATE_WINDOW_S:g}s; retrying", Code.BUSY)
        unexpected = sum(1 for m in s.members.values() if m.active and m.island >= s.cfg.islands)
        if unexpected >= s.cfg.max_islands - s.cfg.islands:
            raise ProtocolError(f"the run holds {unexpected} live islands beyond --islands {s.cfg.islands} "
                                f"(the rest of --max-islands {s.cfg.max_islands} is kept for those); retrying",
                                Code.BUSY)

    def _evict_member(self) -> bool:
        """Make room for a new island id by forgetting the longest-gone member; False if every member is live."""
        s = self.state
        gone = [m for m in s.members.values() if not m.active]
        if not gone:
            return False
        del s.members[min(gone, key=lambda m: m.last_seen).island]
        return True

    def _take_over(self, old: Member, session: str) -> bool:
        """A new session for a member's id takes it over (the old one is told, and retired unless it is older);
        a hello from an older process than a live member's never does: False once the run is over (it may just
        stop), else it is asked to retry."""
        s = self.state
        lid = old.island
        if old.active and session_start(session) < session_start(old.session):  # (delayed, or one that woke up)
            if s.finish_header is not None:
                return False
            raise ProtocolError(f"island id {lid} is held by a live session that started later; retrying until it "
                                "goes silent (another process with this --island-id is running?)", Code.BUSY)
        if session_start(session) >= session_start(old.session):  # an older one (it was silent) is not retired:
            retired = s.retired.setdefault(lid, [])  # it takes the id back when it returns
            retired.append(old.session)
            del retired[:-MAX_RETIRED_SESSIONS]
        if old.active:
            self.outbox.send(old.peer, "refuse", {"code": str(Code.SUPERSEDED),
                                                  "reason": f"island id {lid} was taken over by a new session"})
        self.outbox.record("supersede", island=lid, old_session=old.session, session=session)
        return True

    def _join(self, peer: str, h: dict[str, Any], layout: Layout, proof: str, rejoin: bool, now: float) -> None:
        """Make the hello's sender the member for its id: welcomed into the run, or (not founded yet) the founding."""
        s = self.state
        lid = h["island"]
        m = Member(lid, h["session"], peer, h["backend"], now, principal=s.principal,
                   tokens_per_step=h["contract"]["tokens_per_step"], tier=self._tier(lid))
        old = s.members.get(lid)
        if old is not None and old.session == m.session:
            self._keep_delta_news(old, m)
        s.members[lid] = m
        if s.owners.get(lid) != proof:
            s.owners[lid] = proof
        if s.run is not None:
            self._welcome(m, now, rejoin=rejoin, island_version=h["version"])
            self.open_round(now)
            return
        if s.founding is None:
            self._begin_founding(lid, h, layout)
        if s.init is not None:  # version 0 is the given adapter, exact (no upload, no quantization)
            self._found(lid, flatten(layout, s.init.tensors), now, source=s.init.source)
            return
        self.outbox.record("join", island=lid, backend=m.backend, session=m.session, rejoin=rejoin, tier=str(m.tier),
                           waiting_for="init")
        self.ask_founder(again_from=lid)

    @staticmethod
    def _keep_delta_news(old: Member, new: Member) -> None:
        """The same process says hello again (a late hello, or one sent again): what the pongs tell it about its
        delta (the last answer, the last copy heard) stays, or a lost answer is never learned (sim seed 800680)."""
        new.last_answer, new.heard = old.last_answer, old.heard

    def _welcome(self, m: Member, now: float, rejoin: bool, island_version: int) -> None:
        """A member of a founded run is told its state: the version, the open round (and whether its delta is in),
        its merged deltas, its data shard, and the finish if the run is over."""
        s = self.state
        assert s.run is not None
        m.welcomed = True
        m.since = now
        s.seen.add(m.island)
        s.knocking.pop(m.island, None)  # it got back in: from here on its member record says when it is done
        r = s.round
        mine = s.pending.get(m.island)
        contributed = r is not None and mine is not None
        open_round = None if r is None else round_header(s.cfg, r, now)
        self.outbox.send(m.peer, "welcome", {"incarnation": s.incarnation, "version": s.run.version,
                                             "digest": s.run.digest, "policy": s.cfg.policy(),
                                             "open_round": open_round, "contributed": contributed,
                                             "pending": mine.ref() if contributed else None,
                                             "merged": s.merged.get(m.island, []),
                                             "finished": s.finished_at is not None,
                                             "shard": self._shard(m.island)})
        self.outbox.record("join", island=m.island, backend=m.backend, session=m.session, rejoin=rejoin,
                           tier=str(m.tier), island_version=island_version, version=s.run.version,
                           round=r.number if r is not None else None, contributed=contributed)
        self.outbox.log("info", f"island {m.island} {'re' if rejoin else ''}joined ({m.backend}) at version "
                                f"{s.run.version}; {len(s.live())} live")
        if m.island in s.given_up and 0 <= m.island < s.cfg.islands:  # (another id never lowered the quorum)
            s.returning.add(m.island)  # (counted on again from the next round: RoundDriver.take_back_give_ups)
        if s.finish_header is not None:
            self.outbox.send(m.peer, "finish", s.finish_header_for_wire())

    def _shard(self, lid: int) -> list[int]:
        """[index, count]: the data shard island `lid` trains on. The count is the run's (the founding island's
        --num-islands, else --islands); an island beyond it shares the shard of `lid` mod count."""
        s = self.state
        assert s.run is not None
        count = int(s.run.contract.get("num_islands") or s.cfg.islands)
        return [lid % count, count]

    # ------------------------------------------------------------------ founding

    def _begin_founding(self, lid: int, h: dict[str, Any], layout: Layout) -> None:
        """The first island's hello defines the run: its layout and contract (with what the syncer pins)."""
        s = self.state
        contract = run_contract(h["contract"], s.cfg.pinned())
        contract["num_islands"] = contract.get("num_islands") or s.cfg.islands  # (the shard count)
        s.founding = Founding(layout, h["adapter_config"], _run_provenance(h.get("provenance") or {}, contract),
                              contract)
        self.outbox.record("layout", island=lid, fingerprint=layout.fingerprint, tensors=len(layout.specs),
                           numel=layout.numel, fragments=len(layout.fragments))
        self.outbox.record("contract", island=lid, **contract, sync_bits=s.cfg.sync_bits, protocol=PROTOCOL_VERSION)

    def ask_founder(self, again_from: Optional[int] = None) -> None:
        """Ask one live member for the initial adapter: another one if the one asked is gone, the same one
        again when it says hello or pings again (the request, or its upload, was lost)."""
        s = self.state
        f = s.founding
        if f is None or s.run is not None:
            return
        asked = s.members.get(f.asked) if f.asked is not None else None
        if asked is not None and asked.active:
            if again_from == f.asked:
                self._request_init(f, asked)
            return
        candidates = sorted(m.island for m in s.active())
        if not candidates:
            f.asked = None
            return
        f.asked = candidates[0]
        self._request_init(f, s.members[f.asked])
        self.outbox.record("init_request", island=f.asked, bits=s.cfg.sync_bits)

    def _request_init(self, f: Founding, m: Member) -> None:
        """Ask `m` for the initial adapter, saying how many uploads of its session came and could not count (`heard`:
        the error saying so may have been lost, and an island waits on an upload it thinks is still on its way)."""
        heard = f.lost_uploads.get((m.island, m.session), 0)
        self.outbox.send(m.peer, "init_request",
                         {"bits": self.state.cfg.sync_bits, **({"heard": heard} if heard else {})})

    def on_init(self, peer: str, msg: Message, now: float) -> None:
        """The initial adapter, from the member asked for it (a repeat of the founding upload is ignored)."""
        s = self.state
        f = s.founding
        try:
            m = s.member(peer, msg, now)
            if s.run is not None and s.founder == m.island:
                return  # a repeat of the upload that founded the run
            if s.run is not None or f is None or f.asked != m.island:
                raise ProtocolError("an initial adapter nobody asked for", Code.WRONG_PHASE)
        except ProtocolError:
            key = (msg.header["island"], msg.header["session"])
            if f is not None and (key in f.lost_uploads or len(f.lost_uploads) < MAX_LOST_UPLOADS):
                f.lost_uploads[key] = f.lost_uploads.get(key, 0) + 1  # (sim seed 3141721)
            raise
        flat = decode_fragments(f.layout, msg)
        self._found(m.island, flat, now, bits=sorted({d["bits"] for d in msg.header["fragments"]}), bytes=msg.nbytes)

    def _found(self, founder: int, flat: np.ndarray, now: float, **fields: Any) -> None:
        """Commit version 0 (`flat`: the founding island's upload, or --init-adapter) and welcome everyone."""
        s = self.state
        f = s.founding
        assert f is not None
        s.founder = founder
        digest = array_digest(flat)
        s.ef = ErrorFeedback(f.layout.numel)
        s.run = Checkpoint(0, f.layout, f.adapter_config, f.provenance, flat, np.zeros_like(flat),
                           s.ef.residual, digest, asdict(s.cfg), [], {}, {}, f.contract)
        s.sum = RoundSum.for_rule(f.layout, s.cfg.merge)
        s.digests = {0: digest}
        s.founding = None
        known = set(s.seen)
        s.seen.update(x.island for x in s.active())  # (saved with checkpoint 0: a restart waits for them)
        self.outbox.record("init", island=founder, digest=digest, **fields)
        parts = len(stream_parts(f.layout, s.cfg.fragments))
        if parts < s.cfg.fragments:
            self.outbox.log("warning", f"--fragments {s.cfg.fragments}: this adapter has {len(f.layout.fragments)} "
                                       f"fragment(s), so it streams in {parts} part(s), each synced every {parts} "
                                       f"round(s), not every {s.cfg.fragments}: for as many steps between a part's "
                                       f"syncs, use --fragments {parts} with rounds {s.cfg.fragments / parts:g}x as "
                                       "long")
        self.outbox.add(SaveCheckpoint(s.checkpoint()))
        self.outbox.record("checkpoint", version=0, digest=digest)
        for other in s.active():
            self._welcome(other, now, rejoin=other.island in known, island_version=-1)
        self.open_round(now)

    # ------------------------------------------------------------------ forgetting

    def expire_silent_ids(self, now: float) -> None:
        """Ids beyond --islands that joined, never delivered a delta and are gone are forgotten (from `seen`,
        `owners` and so the checkpoint): a flood of fresh ids leaves nothing behind."""
        s = self.state
        for lid in [x for x in s.seen if x >= s.cfg.islands and x not in s.merged and x not in s.pending]:
            m = s.members.get(lid)
            if m is None or (not m.active and now - m.last_seen > s.cfg.island_timeout):
                s.seen.discard(lid)
                s.owners.pop(lid, None)
                s.members.pop(lid, None)


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


def _run_provenance(founder: dict[str, Any], contract: dict[str, Any]) -> dict[str, Any]:
    """What the syncer's adapter says about its origin: the run's contract and the base model it pins, never one
    island's data, config or counts."""
    model = founder.get("model") if isinstance(founder.get("model"), dict) else {}
    return {"model": {k: model.get(k) for k in ("name", "kind", "source", "revision", "requested_revision", "hub_id")},
            "run": contract, "protocol": PROTOCOL_VERSION}
