"""A delta's intake: what a learner's delta must be to count in the open round, and how it joins the round's sum.

A delta counts if it is for the open round, trained from its base or one at most --max-base-lag versions back (and that
version as the run has it, not one rolled back), its claims (tokens, steps, loss) can be true, and no merge refused it
before; a learner contributes one delta per round (a copy sent again after a lost ack is acked again). An accepted
delta is recorded, saved, then acked, and added to the round's running sum with its weight (--merge-weight) and its
scale (staleness discount, --step-normalize); its compute time updates the pace the grace predicts from.

A pipelined delta (--pipeline D > 1, streamed runs) is pushed before its round opens: it names the version its round
opens on as its base and, as `trained_from`, the older version it trained from, whose values of its part no merge in
between changed (`untouched_since`), so it is as fresh as any. Until its round opens it waits, unacked and in memory
only (at most D - 1 a member: a restart loses them and their learners send them again), then it is taken as if it
had just come.
"""

from __future__ import annotations

import math
from typing import Any, Optional

import numpy as np

from yeto.sync.core.actions import AcceptedDelta, SaveDelta
from yeto.sync.core.state import Member, Refusal, SyncerState
from yeto.sync.merge.rules import DeltaCounts, staleness_factor, weight_of
from yeto.sync.wire.layout import round_part, untouched_since
from yeto.sync.wire.protocol import (Code, Message, ProtocolError, check_fragments, decode_fragments, digest_bytes,
                                     truncate)
from yeto.sync.wire.quant import dequantize

ROUND_TIME_EMA = 0.5  # weight of a member's newest round time in its running estimate
MAX_TOKENS_PER_DELTA = 1 << 40  # beyond any real round: a larger claim is refused
MAX_INNER_STEPS_PER_DELTA = 10**7
MAX_LOSS = 1e4  # a reported mean loss above this is no loss of a language model
MAX_REFUSED_REMEMBERED = 4096  # digests of deltas a merge refused


class Deltas(SyncerState):
    """The delta message, and what a delta counts for (shared by the merge and the recovery)."""

    def _on_delta(self, peer: str, msg: Message, now: float) -> None:
        try:
            m = self._member(peer, msg, now)
        except ProtocolError as e:
            if e.code is Code.NOT_JOINED:
                self._heard_while_away(msg)
            raise
        self._take_delta(m, msg, now)
        self._maybe_close(now)

    def _heard_while_away(self, msg: Message) -> None:
        """A delta from a member's process while it is away (gone silent, its hello again still to come): the copy is
        heard, so once that hello comes the pongs say so and the learner sends it again, even if the refusal that
        told it to was lost (sim seed 903596133)."""
        h = msg.header
        m = self.members.get(h["learner"])
        if m is not None and m.session == h["session"] and m.principal == self.principal:
            m.heard = [digest_bytes(msg.frames), h["copy"] if isinstance(h.get("copy"), int) else 0]

    def _take_delta(self, m: Member, msg: Message, now: float) -> None:
        """A learner's delta: acked again if it counted already, kept for its round if pipelined ahead of it, refused
        if it cannot count in the open round, else accepted into the round's sum (on the tape, saved, then acked)."""
        h = msg.header
        digest = digest_bytes(msg.frames)
        if [h["round"], digest] in self.merged.get(m.learner, []):  # sent again after a lost ack: it counted
            self._answer(m, h, "ack", {**_where(h), "digest": digest, "duplicate": True, "merged": True})
            return
        m.heard = [digest, h["copy"] if isinstance(h.get("copy"), int) else 0]
        if self._waits_for_its_round(h):
            return self._keep_ahead(m, msg, digest, now)
        refusal = self._delta_refusal(m, h, digest)
        if refusal is not None:
            return self._refuse_delta(m, h, digest, refusal.code, refusal.reason, now)
        mine = self.pending.get(m.learner)
        if mine is not None:
            if mine.ref() == [h["round"], h["base_version"], digest]:  # sent again after a lost ack
                self._answer(m, h, "ack", {**_where(h), "digest": digest, "duplicate": True,
                                           "merge_round": self.round.number})
            else:
                self._refuse_delta(m, h, digest, Code.DUPLICATE, f"learner {m.learner} already contributed to round "
                                   f"{self.round.number} (delta {mine.digest})", now)
            return
        try:
            flat = decode_fragments(self.run.layout, msg, self._part(h["round"]))  # sizes, bits, finiteness, part
        except ProtocolError as e:
            return self._refuse_delta(m, h, digest, Code.REFUSED, str(e), now)
        self._accept(m, msg, digest, flat, now)

    def _delta_refusal(self, m: Member, h: dict[str, Any], digest: str) -> Optional[Refusal]:
        """Why a delta cannot count in the open round, or None: stale (no round open, or its base more than
        --max-base-lag back), trained from a version since rolled back, claims that cannot be true, or a copy of one
        a merge refused."""
        r = self.round
        lag = r.base_version - h["base_version"] if r is not None else -1
        if r is None or h["round"] != h["base_version"] + 1 or not 0 <= lag <= self.cfg.max_base_lag:
            state = f"round {r.number} is open on version {r.base_version}" if r else f"no round is open (version " \
                                                                                     f"{self.version})"
            return Refusal(Code.STALE, f"stale delta for round {h['round']} on version {h['base_version']}: {state} "
                           f"(--max-base-lag {self.cfg.max_base_lag})")
        if lag and h.get("base_digest") != self.digests.get(h["base_version"]):
            return Refusal(Code.REFUSED, f"delta trained from version {h['base_version']} as it was before the syncer "
                           "rolled it back (or one it no longer knows): train from the current version")
        if "trained_from" in h:
            refusal = self._pipelined_refusal(h)
            if refusal is not None:
                return refusal
        return self._claims_refusal(m, h, digest)

    def _claims_refusal(self, m: Member, h: dict[str, Any], digest: str) -> Optional[Refusal]:
        """Claims that cannot be true, or a copy of a delta a merge refused."""
        problem = _claims_problem(h, m.tokens_per_step, 0 if self.cfg.round_seconds else self.cfg.inner_steps)
        if problem:
            return Refusal(Code.REFUSED, problem)
        if digest in self.refused_digests:  # a copy of a delta a merge already refused (stale copies come back)
            return Refusal(Code.REFUSED, "this delta was refused by a merge")
        return None

    def _pipelined_refusal(self, h: dict[str, Any]) -> Optional[Refusal]:
        """Why a delta pushed ahead of its round cannot stand for one trained from its round's base, or None."""
        b, rnd = h["trained_from"], h["round"]
        if type(b) is not int or not 0 <= rnd - 1 - b < self.cfg.pipeline:
            return Refusal(Code.REFUSED, f"pipelined delta for round {rnd} trained from version {b!r}: --pipeline "
                           f"{self.cfg.pipeline} takes one trained at most {self.cfg.pipeline - 1} version(s) earlier")
        if not isinstance(h.get("trained_digest"), str) or h["trained_digest"] != self.digests.get(b):
            return Refusal(Code.REFUSED, f"pipelined delta trained from version {b} as it was before the syncer rolled "
                           "it back (or one it no longer knows): train from the current version")
        if not untouched_since(self.run.layout, self.cfg.fragments, rnd, b, self.cfg.outer_steps):
            return Refusal(Code.REFUSED, f"pipelined delta for round {rnd} trained from version {b}: a merge since "
                           "changed its part (the run's last round syncs the whole adapter)")
        return None

    def _waits_for_its_round(self, h: dict[str, Any]) -> bool:
        """A delta for a round not open yet that is kept for it rather than judged now: one pipelined ahead of the
        open round, or, with no round open (a restarted syncer before it reopens its round, or a run waiting for
        its quorum), one for the round that opens next, on the version it opens on. Refused as stale, the latter
        was lost whenever the refusal was (sim seed 800680): its learner waited on a round that waited on it."""
        if self.round is not None:
            return h["round"] > self.round.number and "trained_from" in h
        return self.run is not None and self.finished_at is None and h["round"] == self.version + 1 and \
            h["base_version"] == self.version

    def _keep_ahead(self, m: Member, msg: Message, digest: str, now: float) -> None:
        """A delta for a round not open yet (`_waits_for_its_round`): kept (unacked) for its round, or refused now."""
        h, r = msg.header, self.round
        kept = self.ahead.setdefault(m.learner, {})
        problem = None
        if r is None:  # (the round opening next, kept whole: at most one a learner beside the pipelined ones)
            problem = None if h["round"] in kept or len(kept) < self.cfg.pipeline else Refusal(
                Code.STALE, f"learner {m.learner} already has {len(kept)} delta(s) waiting for round "
                f"{h['round']} to open (--pipeline {self.cfg.pipeline})")
        elif not h["round"] - r.number < self.cfg.pipeline or h["base_version"] != h["round"] - 1:
            problem = Refusal(Code.STALE, f"delta for round {h['round']} on version {h['base_version']}: round "
                              f"{r.number} is open, and --pipeline {self.cfg.pipeline} keeps deltas for the "
                              f"{self.cfg.pipeline - 1} round(s) after it, each on the version it opens on")
        elif h["round"] not in kept and len(kept) >= self.cfg.pipeline - 1:
            problem = Refusal(Code.STALE, f"learner {m.learner} already has {len(kept)} pipelined delta(s) waiting "
                              f"(--pipeline {self.cfg.pipeline})")
        pipelined = "trained_from" in h
        problem = problem or (self._pipelined_refusal(h) if pipelined else None) or \
            self._claims_refusal(m, h, digest)
        if problem is None:
            try:  # (its sizes and part now: a kept delta holds no more memory than its part's payload)
                check_fragments(self.run.layout, msg, self._part(h["round"]))
            except ProtocolError as e:
                problem = Refusal(Code.REFUSED, str(e))
        if problem is not None:
            return self._refuse_delta(m, h, digest, problem.code, problem.reason, now)
        kept[h["round"]] = (m.session, msg)

    def _take_ahead(self, now: float) -> None:
        """The open round's pipelined deltas, taken as if they came now (those of a member gone or of an earlier
        session are dropped: its learner sends them again)."""
        r = self.round
        for lid in sorted(self.ahead):
            kept = self.ahead[lid]
            for rnd in [k for k in kept if k < r.number]:
                del kept[rnd]
            session_msg = kept.pop(r.number, None)
            m = self.members.get(lid)
            if session_msg is not None and m is not None and m.active and m.welcomed and m.session == session_msg[0]:
                self._take_delta(m, session_msg[1], now)
            if not kept:
                del self.ahead[lid]

    def _accept(self, m: Member, msg: Message, digest: str, flat: np.ndarray, now: float) -> None:
        """The delta joins the open round: recorded, saved, added to the running sum, then acked; its compute time
        (when plausible) updates its member's pace, which the grace predicts the next push from."""
        h, r = msg.header, self.round
        d = AcceptedDelta(m.learner, m.session, r.number, h["base_version"], h["tokens"], h["loss_tokens"],
                          h["inner_steps"], float(h["loss"]), digest, list(h["fragments"]), tuple(msg.frames),
                          carried_steps=h.get("carried_steps", 0), tier=str(m.tier))
        self._measure(d, flat)
        compute_s = h.get("compute_s")
        compute_s = float(compute_s) if isinstance(compute_s, (int, float)) and math.isfinite(compute_s) and \
            0 <= compute_s <= self.cfg.quorum_timeout else None
        pipelined = {"trained_from": h["trained_from"]} if "trained_from" in h else {}
        self._record("delta", **self._delta_fields(d), bytes=msg.nbytes, norm=d.norm, compute_s=compute_s, **pipelined)
        self.out.append(SaveDelta(d))
        self.pending[m.learner] = d
        self.sum.add(m.learner, flat, self._weight(d), self._scale(d))  # the decoded copy is dropped
        self._answer(m, h, "ack", {**_where(h), "digest": digest, "duplicate": False, "merge_round": r.number})
        if compute_s is not None:
            m.round_s = compute_s if m.round_s is None else (ROUND_TIME_EMA * compute_s +
                                                             (1 - ROUND_TIME_EMA) * m.round_s)
            step_s = compute_s / max(1, d.inner_steps)
            m.step_s = step_s if m.step_s is None else ROUND_TIME_EMA * step_s + (1 - ROUND_TIME_EMA) * m.step_s
        m.since = now

    def _refuse_delta(self, m: Member, h: dict[str, Any], digest: str, code: Code, reason: str, now: float) -> None:
        """Not accepted: the error names the delta (round, base version, digest), so a learner that has pushed
        that round again since knows it is not about its newer delta."""
        if not self._may_reply(m.peer, now):
            return
        reason = truncate(reason)
        self._record("reject", learner=m.learner, round=h["round"], base_version=h["base_version"], digest=digest,
                     code=str(code), reason=reason)
        self._answer(m, h, "error", {"code": str(code), "reason": reason, "round": h["round"],
                                     "base_version": h["base_version"], "digest": digest, "version": self.version})

    def _answer(self, m: Member, h: dict[str, Any], msg_type: str, header: dict[str, Any]) -> None:
        """Ack or refuse a delta, and keep the answer (with the copy of the delta it answers) for the pongs."""
        self._send(m.peer, msg_type, header)
        copy = h.get("copy")
        m.last_answer = {"type": msg_type, **header, "copy": copy if isinstance(copy, int) else 0}

    def _remember_refused(self, digest: str) -> None:
        self.refused_digests[digest] = None
        while len(self.refused_digests) > MAX_REFUSED_REMEMBERED:
            del self.refused_digests[next(iter(self.refused_digests))]

    # ------------------------------------------------------------------ what a delta counts for

    def _weight(self, d: AcceptedDelta) -> float:
        """The delta's unnormalised merge weight (--merge-weight)."""
        return weight_of(self._counts(d), self.cfg.merge_weight)

    def _scale(self, d: AcceptedDelta) -> float:
        """What a delta is scaled by before the rule: its staleness discount (--staleness-exponent; 1 when fresh)
        and, with --step-normalize, 1/its inner steps (the merge multiplies the result by the round's length)."""
        s = staleness_factor(d.lag, self.cfg.staleness_exponent)
        return s / max(1, d.inner_steps) if self.cfg.step_normalize else s

    @staticmethod
    def _counts(d: AcceptedDelta) -> DeltaCounts:
        return DeltaCounts(d.loss_tokens, d.tokens, d.inner_steps)

    @staticmethod
    def _delta_fields(d: AcceptedDelta) -> dict[str, Any]:
        return {"learner": d.learner, "round": d.round, "base_version": d.base_version, "digest": d.digest,
                "tokens": d.tokens, "loss_tokens": d.loss_tokens, "inner_steps": d.inner_steps, "loss": d.loss,
                "bits": sorted({x["bits"] for x in d.descs}), "lag": d.lag, "round_steps": d.round_steps,
                "tier": d.tier}

    def _part(self, round_number: int) -> Optional[tuple[int, ...]]:
        """The fragments a round merges when the run streams its adapter (--fragments); None: all of them (as in the
        run's last round)."""
        return round_part(self.run.layout, self.cfg.fragments, round_number, self.cfg.outer_steps)

    def _decode(self, d: AcceptedDelta) -> np.ndarray:
        return decode_fragments(self.run.layout, Message("delta", {"fragments": d.descs}, list(d.frames)),
                                self._part(d.round))

    def _decode_fragment(self, d: AcceptedDelta, k: int) -> np.ndarray:
        """Fragment k of the delta (zero where a streamed delta does not carry it)."""
        numel = self.run.layout.fragments[k].numel
        for desc, frame in zip(d.descs, d.frames):
            if desc["index"] == k:
                return dequantize(frame, numel, desc["bits"])
        return np.zeros(numel, dtype=np.float32)

    @staticmethod
    def _measure(d: AcceptedDelta, flat: np.ndarray) -> None:
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
        return (f"delta claims {tokens} tokens in {steps} steps; this learner declared at most {tokens_per_step} "
                "tokens per step (batch x accumulation x sequence length)")
    if not (math.isfinite(loss) and 0 <= loss <= MAX_LOSS):
        return f"delta with impossible loss {loss}"
    return None


def _where(h: dict[str, Any]) -> dict[str, Any]:
    """What names the delta a message answers: the round it trained and its base version."""
    return {"round": h["round"], "base_version": h["base_version"]}
