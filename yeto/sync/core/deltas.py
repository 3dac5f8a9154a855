"""A delta's intake: what an island's delta must be to count in the open round, and how it joins the round's sum.

A delta counts if it is for the open round, trained from its base or one at most --max-base-lag versions back (and that
version as the run has it, not one rolled back), its claims (tokens, steps, loss) can be true, and no merge refused it
before; an island contributes one delta per round (a copy sent again after a lost ack is acked again). An accepted
delta is recorded, saved, then acked, and added to the round's running sum with its weight (--merge-weight) and its
scale (staleness discount, --step-normalize); its compute time updates the pace the grace predicts from.

A pipelined delta (--pipeline D > 1, streamed runs) is pushed before its round opens: it names the version its round
opens on as its base and, as `trained_from`, the older version it trained from, whose values of its part no merge in
between changed (`untouched_since`), so it is as fresh as any. Until its round opens it waits, unacked and in memory
only (at most D - 1 a member: a restart loses them and their islands send them again), then it is taken as if it
had just come.
"""

from __future__ import annotations

import math
from typing import Any, Optional

import numpy as np

from yeto.sync.core.actions import AcceptedDelta, SaveDelta
from yeto.sync.core.state import Member, Refusal, SyncerOutbox, SyncerState
from yeto.sync.merge.rules import DeltaCounts, staleness_factor, weight_of
from yeto.sync.wire.layout import untouched_since
from yeto.sync.wire.protocol import (Code, Message, ProtocolError, check_fragments, decode_fragments, digest_bytes,
                                     truncate)
from yeto.sync.wire.quant import dequantize

ROUND_TIME_EMA = 0.5  # weight of a member's newest round time in its running estimate
MAX_TOKENS_PER_DELTA = 1 << 40  # beyond any real round: a larger claim is refused
MAX_INNER_STEPS_PER_DELTA = 10**7
MAX_LOSS = 1e4  # a reported mean loss above this is no loss of a language model
MAX_REFUSED_REMEMBERED = 4096  # digests of deltas a merge refused
MAX_TASK_EXAMPLES = 10**7  # a task_eval header's example count beyond this is no evaluation an island ran


def task_eval_of(value: Any, version: int) -> Optional[dict[str, Any]]:
    """A delta's `task_eval` header ({version, accuracy, n}: the island's latest score of a global on its task) as
    the tape records it, or None where it is malformed (dropped, the delta kept: it is informational) or names a
    version the run has not reached."""
    if not isinstance(value, dict):
        return None
    v, accuracy, n = value.get("version"), value.get("accuracy"), value.get("n")
    if type(v) is not int or not 0 <= v <= version or type(n) is not int or not 1 <= n <= MAX_TASK_EXAMPLES:
        return None
    if isinstance(accuracy, bool) or not isinstance(accuracy, (int, float)) or not math.isfinite(accuracy) or \
            not 0.0 <= accuracy <= 1.0:
        return None
    return {"version": v, "accuracy": float(accuracy), "n": n}


class Deltas:
    """The delta message, and what a delta counts for (shared by the merge and the recovery)."""

    def __init__(self, state: SyncerState, outbox: SyncerOutbox):
        self.state = state
        self.outbox = outbox

    def on_delta(self, peer: str, msg: Message, now: float) -> None:
        """An island's delta (the core then sees whether the round may close)."""
        try:
            m = self.state.member(peer, msg, now)
        except ProtocolError as e:
            if e.code is Code.NOT_JOINED:
                self._heard_while_away(msg)
            raise
        self._take_delta(m, msg, now)

    def _heard_while_away(self, msg: Message) -> None:
        """A delta from a member's process while it is away (gone silent, its hello again still to come): the copy is
        heard, so once that hello comes the pongs say so and the island sends it again, even if the refusal that
        told it to was lost (sim seed 903596133)."""
        s = self.state
        h = msg.header
        m = s.members.get(h["island"])
        if m is not None and m.session == h["session"] and m.principal == s.principal:
            m.heard = [digest_bytes(msg.frames), h["copy"] if isinstance(h.get("copy"), int) else 0]

    def _take_delta(self, m: Member, msg: Message, now: float) -> None:
        """An island's delta: acked again if it counted already, kept for its round if pipelined ahead of it, refused
        if it cannot count in the open round, else accepted into the round's sum (on the tape, saved, then acked)."""
        s = self.state
        h = msg.header
        digest = digest_bytes(msg.frames)
        if [h["round"], digest] in s.merged.get(m.island, []):  # sent again after a lost ack: it counted
            self.answer(m, h, "ack", {**_where(h), "digest": digest, "duplicate": True, "merged": True})
            return
        m.heard = [digest, h["copy"] if isinstance(h.get("copy"), int) else 0]
        if self._waits_for_its_round(h):
            return self._keep_ahead(m, msg, digest, now)
        refusal = self._delta_refusal(m, h, digest)
        if refusal is not None:
            return self._refuse_delta(m, h, digest, refusal.code, refusal.reason, now)
        mine = s.pending.get(m.island)
        if mine is not None:
            if mine.ref() == [h["round"], h["base_version"], digest]:  # sent again after a lost ack
                self.answer(m, h, "ack", {**_where(h), "digest": digest, "duplicate": True,
                                          "merge_round": s.round.number})
            else:
                self._refuse_delta(m, h, digest, Code.DUPLICATE, f"island {m.island} already contributed to round "
                                                                 f"{s.round.number} (delta {mine.digest})", now)
            return
        try:
            flat = decode_fragments(s.run.layout, msg, s.part(h["round"]))  # sizes, bits, finiteness, part
        except ProtocolError as e:
            return self._refuse_delta(m, h, digest, Code.REFUSED, str(e), now)
        self._accept(m, msg, digest, flat, now)

    def _delta_refusal(self, m: Member, h: dict[str, Any], digest: str) -> Optional[Refusal]:
        """Why a delta cannot count in the open round, or None: stale (no round open, or its base more than
        --max-base-lag back), trained from a version since rolled back, claims that cannot be true, or a copy of one
        a merge refused."""
        s = self.state
        r = s.round
        lag = r.base_version - h["base_version"] if r is not None else -1
        if r is None or h["round"] != h["base_version"] + 1 or not 0 <= lag <= s.cfg.max_base_lag:
            state = f"round {r.number} is open on version {r.base_version}" if r else f"no round is open (version " \
                                                                                     f"{s.version})"
            return Refusal(Code.STALE, f"stale delta for round {h['round']} on version {h['base_version']}: {state} "
                                       f"(--max-base-lag {s.cfg.max_base_lag})")
        if lag and h.get("base_digest") != s.digests.get(h["base_version"]):
            return Refusal(Code.REFUSED, f"delta trained from version {h['base_version']} as it was before the syncer "
                           "rolled it back (or one it no longer knows): train from the current version")
        if "trained_from" in h:
            refusal = self.pipelined_refusal(h)
            if refusal is not None:
                return refusal
        return self._claims_refusal(m, h, digest)

    def _claims_refusal(self, m: Member, h: dict[str, Any], digest: str) -> Optional[Refusal]:
        """Claims that cannot be true, or a copy of a delta a merge refused."""
        s = self.state
        problem = _claims_problem(h, m.tokens_per_step, s.cfg.round_policy().steps_for())
        if problem:
            return Refusal(Code.REFUSED, problem)
        if digest in s.refused_digests:  # a copy of a delta a merge already refused (stale copies come back)
            return Refusal(Code.REFUSED, "this delta was refused by a merge")
        return None

    def pipelined_refusal(self, h: dict[str, Any]) -> Optional[Refusal]:
        """Why a delta pushed ahead of its round cannot stand for one trained from its round's base, or None."""
        s = self.state
        b, rnd = h["trained_from"], h["round"]
        if type(b) is not int or not 0 <= rnd - 1 - b < s.cfg.pipeline:
            return Refusal(Code.REFUSED, f"pipelined delta for round {rnd} trained from version {b!r}: --pipeline "
                           f"{s.cfg.pipeline} takes one trained at most {s.cfg.pipeline - 1} version(s) earlier")
        if not isinstance(h.get("trained_digest"), str) or h["trained_digest"] != s.digests.get(b):
            return Refusal(Code.REFUSED, f"pipelined delta trained from version {b} as it was before the syncer rolled "
                           "it back (or one it no longer knows): train from the current version")
        if not untouched_since(s.run.layout, s.cfg.fragments, rnd, b, s.cfg.outer_steps):
            return Refusal(Code.REFUSED, f"pipelined delta for round {rnd} trained from version {b}: a merge since "
                           "changed its part (the run's last round syncs the whole adapter)")
        return None

    def _waits_for_its_round(self, h: dict[str, Any]) -> bool:
        """A delta for a round not open yet that is kept for it rather than judged now: one pipelined ahead of the
        open round, or, with no round open (a restarted syncer before it reopens its round, or a run waiting for
        its quorum), one for the round that opens next, on the version it opens on. Refused as stale, the latter
        was lost whenever the refusal was (sim seed 800680): its island waited on a round that waited on it."""
        s = self.state
        if s.round is not None:
            return h["round"] > s.round.number and "trained_from" in h
        return s.run is not None and s.finished_at is None and h["round"] == s.version + 1 and \
            h["base_version"] == s.version

    def _keep_ahead(self, m: Member, msg: Message, digest: str, now: float) -> None:
        """A delta for a round not open yet (`_waits_for_its_round`): kept (unacked) for its round, or refused now."""
        s = self.state
        h, r = msg.header, s.round
        kept = s.ahead.setdefault(m.island, {})
        problem = None
        if r is None:  # (the round opening next, kept whole: at most one an island beside the pipelined ones)
            problem = None if h["round"] in kept or len(kept) < s.cfg.pipeline else Refusal(
                Code.STALE, f"island {m.island} already has {len(kept)} delta(s) waiting for round "
                            f"{h['round']} to open (--pipeline {s.cfg.pipeline})")
        elif not h["round"] - r.number < s.cfg.pipeline or h["base_version"] != h["round"] - 1:
            problem = Refusal(Code.STALE, f"delta for round {h['round']} on version {h['base_version']}: round "
                                          f"{r.number} is open, and --pipeline {s.cfg.pipeline} keeps deltas for the "
                                          f"{s.cfg.pipeline - 1} round(s) after it, each on the version it opens on")
        elif h["round"] not in kept and len(kept) >= s.cfg.pipeline - 1:
            problem = Refusal(Code.STALE, f"island {m.island} already has {len(kept)} pipelined delta(s) waiting "
                                          f"(--pipeline {s.cfg.pipeline})")
        pipelined = "trained_from" in h
        problem = problem or (self.pipelined_refusal(h) if pipelined else None) or \
            self._claims_refusal(m, h, digest)
        if problem is None:
            try:  # (its sizes and part now: a kept delta holds no more memory than its part's payload)
                check_fragments(s.run.layout, msg, s.part(h["round"]))
            except ProtocolError as e:
                problem = Refusal(Code.REFUSED, str(e))
        if problem is not None:
            return self._refuse_delta(m, h, digest, problem.code, problem.reason, now)
        kept[h["round"]] = (m.session, msg)

    def take_ahead(self, now: float) -> None:
        """The open round's pipelined deltas, taken as if they came now (those of a member gone or of an earlier
        session are dropped: its island sends them again)."""
        s = self.state
        r = s.round
        for lid in sorted(s.ahead):
            kept = s.ahead[lid]
            for rnd in [k for k in kept if k < r.number]:
                del kept[rnd]
            session_msg = kept.pop(r.number, None)
            m = s.members.get(lid)
            if session_msg is not None and m is not None and m.active and m.welcomed and m.session == session_msg[0]:
                self._take_kept(m, session_msg[1], now)
            if not kept:
                del s.ahead[lid]

    def _take_kept(self, m: Member, msg: Message, now: float) -> None:
        """A kept delta taken as if it came now. Where a later copy of its island was heard after it (refused, say,
        the error lost), the pongs go on speaking of that copy: told of the kept one instead, its island waited
        forever on the later one (sim seed 733602164)."""
        heard, answered = m.heard, m.last_answer
        self._take_delta(m, msg, now)
        if heard is not None and heard[0] != digest_bytes(msg.frames):
            m.heard, m.last_answer = heard, answered

    def _accept(self, m: Member, msg: Message, digest: str, flat: np.ndarray, now: float) -> None:
        """The delta joins the open round: recorded, saved, added to the running sum, then acked; its compute time
        (when plausible) updates its member's pace, which the grace predicts the next push from. Its island's score
        of a global on a task (`task_eval`), when well formed, is recorded with it; no merge reads it."""
        s = self.state
        h, r = msg.header, s.round
        d = AcceptedDelta(m.island, m.session, r.number, h["base_version"], h["tokens"], h["loss_tokens"],
                          h["inner_steps"], float(h["loss"]), digest, list(h["fragments"]), tuple(msg.frames),
                          carried_steps=h.get("carried_steps", 0), tier=str(m.tier))
        self.measure(d, flat)
        compute_s = h.get("compute_s")
        compute_s = float(compute_s) if isinstance(compute_s, (int, float)) and math.isfinite(compute_s) and \
            0 <= compute_s <= s.cfg.quorum_timeout else None
        pipelined = {"trained_from": h["trained_from"]} if "trained_from" in h else {}
        scored = task_eval_of(h.get("task_eval"), s.version)
        self.outbox.record("delta", **self.delta_fields(d), bytes=msg.nbytes, norm=d.norm, compute_s=compute_s,
                           **pipelined, **({"task_eval": scored} if scored is not None else {}))
        self.outbox.add(SaveDelta(d))
        s.pending[m.island] = d
        s.sum.add(m.island, flat, self.weight(d), self.scale(d))  # the decoded copy is dropped
        self.answer(m, h, "ack", {**_where(h), "digest": digest, "duplicate": False, "merge_round": r.number})
        if compute_s is not None:
            m.round_s = compute_s if m.round_s is None else (ROUND_TIME_EMA * compute_s +
                                                             (1 - ROUND_TIME_EMA) * m.round_s)
            step_s = compute_s / max(1, d.inner_steps)
            m.step_s = step_s if m.step_s is None else ROUND_TIME_EMA * step_s + (1 - ROUND_TIME_EMA) * m.step_s
        m.since = now

    def _refuse_delta(self, m: Member, h: dict[str, Any], digest: str, code: Code, reason: str, now: float) -> None:
        """Not accepted: the error names the delta (round, base version, digest), so an island that has pushed
        that round again since knows it is not about its newer delta."""
        if not self.outbox.may_reply(m.peer, now):
            return
        reason = truncate(reason)
        self.outbox.record("reject", island=m.island, round=h["round"], base_version=h["base_version"], digest=digest,
                           code=str(code), reason=reason)
        self.answer(m, h, "error", {"code": str(code), "reason": reason, "round": h["round"],
                                    "base_version": h["base_version"], "digest": digest, "version": self.state.version})

    def answer(self, m: Member, h: dict[str, Any], msg_type: str, header: dict[str, Any]) -> None:
        """Ack or refuse a delta, and keep the answer (with the copy of the delta it answers) for the pongs."""
        self.outbox.send(m.peer, msg_type, header)
        copy = h.get("copy")
        m.last_answer = {"type": msg_type, **header, "copy": copy if isinstance(copy, int) else 0}

    def remember_refused(self, digest: str) -> None:
        s = self.state
        s.refused_digests[digest] = None
        while len(s.refused_digests) > MAX_REFUSED_REMEMBERED:
            del s.refused_digests[next(iter(s.refused_digests))]

    # ------------------------------------------------------------------ what a delta counts for

    def weight(self, d: AcceptedDelta) -> float:
        """The delta's unnormalised merge weight (--merge-weight)."""
        return weight_of(self.counts(d), self.state.cfg.merge_weight)

    def scale(self, d: AcceptedDelta) -> float:
        """What a delta is scaled by before the rule: its staleness discount (--staleness-exponent; 1 when fresh)
        and, with --step-normalize, 1/its inner steps (the merge multiplies the result by the round's length)."""
        s = staleness_factor(d.lag, self.state.cfg.staleness_exponent)
        return s / max(1, d.inner_steps) if self.state.cfg.step_normalize else s

    @staticmethod
    def counts(d: AcceptedDelta) -> DeltaCounts:
        return DeltaCounts(d.loss_tokens, d.tokens, d.inner_steps)

    @staticmethod
    def delta_fields(d: AcceptedDelta) -> dict[str, Any]:
        return {"island": d.island, "round": d.round, "base_version": d.base_version, "digest": d.digest,
                "tokens": d.tokens, "loss_tokens": d.loss_tokens, "inner_steps": d.inner_steps, "loss": d.loss,
                "bits": sorted({x["bits"] for x in d.descs}), "lag": d.lag, "round_steps": d.round_steps,
                "tier": d.tier}

    def decode(self, d: AcceptedDelta) -> np.ndarray:
        s = self.state
        return decode_fragments(s.run.layout, Message("delta", {"fragments": d.descs}, list(d.frames)),
                                s.part(d.round))

    def decode_fragment(self, d: AcceptedDelta, k: int) -> np.ndarray:
        """Fragment k of the delta (zero where a streamed delta does not carry it)."""
        numel = self.state.run.layout.fragments[k].numel
        for desc, frame in zip(d.descs, d.frames):
            if desc["index"] == k:
                return dequantize(frame, numel, desc["bits"])
        return np.zeros(numel, dtype=np.float32)

    @staticmethod
    def measure(d: AcceptedDelta, flat: np.ndarray) -> None:
        d.peak = float(np.abs(flat).max()) if flat.size else 0.0
        d.norm = float(np.linalg.norm(flat.astype(np.float64)))


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
        return (f"delta claims {tokens} tokens in {steps} steps; this island declared at most {tokens_per_step} "
                "tokens per step (batch x accumulation x sequence length)")
    if not (math.isfinite(loss) and 0 <= loss <= MAX_LOSS):
        return f"delta with impossible loss {loss}"
    return None


def _where(h: dict[str, Any]) -> dict[str, Any]:
    """What names the delta a message answers: the round it trained and its base version."""
    return {"round": h["round"], "base_version": h["base_version"]}
