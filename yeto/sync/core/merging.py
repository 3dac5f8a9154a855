"""The merge transaction: a round's pending deltas combined, the outer step taken, the next version committed.

`close_round` merges on copies (`_merge`: the rule's average, `_average`, then the outer Nesterov step and the
broadcast's quantization); a delta that makes the merge fail is refused (on the tape, to its island: the one that
moves the merge most, `_contributions`) and the merge is retried without it; the run's state changes only in
`_commit`, once a merge completed. Each delta counts for its bounded claim (`_terms`: no claim buys more than the
round's median weight allows) and its staleness scale. Durability order: the merge is recorded, the checkpoint saved,
then the new version broadcast.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Optional

import numpy as np

from yeto.sync.core.actions import Checkpoint, DropDeltas, SaveCheckpoint
from yeto.sync.core.deltas import Deltas
from yeto.sync.core.rounds import OpenRound, RoundPhase
from yeto.sync.core.state import Broadcast, SyncerOutbox, SyncerState
from yeto.sync.merge.aggregate import (RoundSum, clip_factors, clip_reference, clipped_merge, effective_weight,
                                       trimmed_mean)
from yeto.sync.merge.outer import nesterov_step, nesterov_step_on
from yeto.sync.merge.rules import MergeTerms, merge_terms, product_merge
from yeto.sync.wire.layout import fragment_pieces
from yeto.sync.wire.protocol import Code, array_digest, encode, encode_fragments_ef, message_bytes, truncate
from yeto.sync.wire.quant import ErrorFeedback, QuantError

MERGED_HISTORY = 16  # per island id, its latest merged deltas: one back from a long absence learns which counted


class MergeError(Exception):
    """A merge that cannot be made with these deltas (its result is not finite, or a delta does not fit the rule)."""


@dataclass
class Average:
    """The rule's combined delta, and what the rule did: the deltas it clipped (by factor) and what it reports."""

    delta: np.ndarray
    clip: dict[int, float] = field(default_factory=dict)
    rule: dict[str, Any] = field(default_factory=dict)  # extra fields of the tape's merge record


@dataclass
class Merged:
    """A merge computed on copies: the run's next state, and what the tape records of it (per delta, in the order
    the deltas were summed)."""

    global_: np.ndarray  # the new global adapter, as islands will hold it (the update quantized for the broadcast)
    momentum: np.ndarray
    residual: np.ndarray  # the broadcast's error feedback after this update
    sent: np.ndarray  # the update as broadcast
    descs: list[dict[str, Any]]
    frames: tuple[bytes, ...]
    weights: np.ndarray  # what each delta counted for
    counted: list[float]  # each delta's bounded claim
    merged_norms: list[float]  # each delta's norm as the clip judged it (`MergeTerms.judged`), clipped
    clip_ref: Optional[float]  # norm-clip: the reference norm the clip is relative to
    clip: dict[int, float]
    rule: dict[str, Any]


class Merging:
    """Closing a round: the merge transaction and its commit."""

    def __init__(self, state: SyncerState, outbox: SyncerOutbox, deltas: Deltas):
        self.state = state
        self.outbox = outbox
        self.deltas = deltas  # what each pending delta counts for, and how it is answered

    def close_round(self, now: float, stragglers: list[int]) -> bool:
        """Merge the round as a transaction; a delta that breaks the merge is refused and the merge retried. True
        when the merge committed (the next round may open); False: refusals took the round below quorum."""
        s = self.state
        r = s.round
        assert r is not None and s.run is not None
        r.advance(RoundPhase.MERGING)
        while len(s.counting()) >= s.quorum():
            ids = self._order()
            try:
                merged = self._merge(ids)
            except MergeError as e:
                contribution = self._contributions(ids)  # (the delta that moves the merge most, not the largest)
                culprit = max(ids, key=lambda i: (contribution[i], i))
                self._refuse_merged(culprit, f"round {r.number} could not be merged with this delta: {e}")
                continue
            self._commit(r, ids, merged, stragglers, now)
            return True
        r.quorum_at = r.fresh_at = None  # refusals took the round back below quorum: it stays open
        r.advance(RoundPhase.OPEN)
        return False

    def _merge(self, ids: list[int]) -> Merged:
        """The merge of these pending deltas and the outer step, computed on copies (the run is untouched until
        `_commit`); MergeError where the result is not finite or the deltas do not fit the rule."""
        s = self.state
        run, cfg = s.run, s.cfg
        terms = self._terms(ids)
        scales = dict(zip(ids, terms.scales))
        most = np.float32(terms.length)
        norms = terms.judged_norms([s.pending[i].norm for i in ids])
        tiers = [s.pending[i].tier for i in ids]
        ref = clip_reference(norms, list(s.norm_history_of(s.part(s.round.number))), tiers)
        try:
            with np.errstate(all="ignore"):
                weights = np.asarray(terms.counted, dtype=np.float64) / sum(terms.counted)
                avg = self._average(ids, terms, weights, norms, ref)
                part = s.part(s.round.number)
                if part is None:
                    new_global, momentum = nesterov_step(run.global_, avg.delta, run.momentum, cfg.outer_lr,
                                                         cfg.outer_momentum)
                else:  # a streamed round: its part alone steps, and is broadcast
                    new_global, momentum = nesterov_step_on(run.global_, avg.delta, run.momentum, cfg.outer_lr,
                                                            cfg.outer_momentum, fragment_pieces(run.layout, part))
                if not (np.isfinite(new_global).all() and np.isfinite(momentum).all()):
                    raise MergeError("the outer step overflows")
                ef = ErrorFeedback(run.layout.numel)
                ef.residual = s.ef.residual
                descs, frames, sent = encode_fragments_ef(run.layout, new_global - run.global_, cfg.broadcast_bits, ef,
                                                          part)
                committed = run.global_ + sent
                if not np.isfinite(committed).all():
                    raise MergeError("the new global adapter is not finite")
        except (QuantError, ValueError, FloatingPointError, OverflowError) as e:
            raise MergeError(str(e)) from e
        return Merged(global_=committed, momentum=momentum, residual=ef.residual, sent=sent, descs=descs,
                      frames=tuple(frames), weights=weights * np.asarray([scales[i] * float(most) for i in ids]),
                      counted=list(terms.counted), merged_norms=[n * avg.clip.get(i, 1.0) for i, n in zip(ids, norms)],
                      clip_ref=ref if cfg.robust == "norm-clip" else None, clip=avg.clip, rule=avg.rule)

    def _average(self, ids: list[int], terms: MergeTerms, weights: np.ndarray, norms: list[float],
                 ref: float) -> Average:
        """The deltas combined by the run's rule (--robust, --merge, --lora-merge), at the round's length."""
        s = self.state
        run, cfg = s.run, s.cfg
        scales = dict(zip(ids, terms.scales))
        most = np.float32(terms.length)
        if cfg.robust == "trimmed-mean":  # fragment by fragment: n fragments in memory, not n adapters
            return Average(trimmed_mean(lambda k: np.stack([self.deltas.decode_fragment(s.pending[i], k) * np.float32(
                scales[i] * most) for i in ids]), terms.counted, run.layout))
        clip: dict[int, float] = {}
        if cfg.robust == "norm-clip":
            factors = clip_factors(norms, ref, cfg.robust_k)
            clip = {i: c for i, c in zip(ids, factors) if c < 1.0}
        if cfg.lora_merge == "factors":  # the running sums: one or two vectors in memory, not n
            unnormalised = {i: effective_weight(w, scales[i]) for i, w in zip(ids, terms.counted)}
            avg, report = clipped_merge(self._bounded_sum(ids, terms), clip, unnormalised,
                                        lambda i: self.deltas.decode(s.pending[i]))
            return Average(avg * most, clip, report)
        # every delta at once (LoRA adapters are small: n of them fit where one base does not)
        deltas = [self.deltas.decode(s.pending[i]) * np.float32(clip.get(i, 1.0) * scales[i] * most) for i in ids]
        pm = product_merge([run.global_ + d for d in deltas], weights, run.layout)
        return Average(pm.merged - run.global_, clip, {"residual": pm.residual, "residual_mean": pm.residual_mean})

    def _terms(self, ids: list[int]) -> MergeTerms:
        """The bounded weights and scales of merging these pending deltas (`yeto.sync.merge.rules.merge_terms`)."""
        s = self.state
        ds = [s.pending[i] for i in ids]
        return merge_terms([self.deltas.counts(d) for d in ds], s.cfg.merge_weight, [d.lag for d in ds],
                           s.cfg.staleness_exponent, bool(s.cfg.step_normalize), [d.round_steps for d in ds],
                           [d.tier for d in ds])

    def _bounded_sum(self, ids: list[int], terms: MergeTerms) -> RoundSum:
        """The round's running sum, or, where a claim was capped or a scale bounded, the sum rebuilt with what each
        delta counts for (the running sum adds each delta as it arrives, before the round's median is known)."""
        arrived = [(self.deltas.weight(self.state.pending[i]), self.deltas.scale(self.state.pending[i])) for i in ids]
        if all(a == (w, sc) for a, w, sc in zip(arrived, terms.counted, terms.scales)):
            return self.state.sum.copy()
        s = RoundSum.for_rule(self.state.run.layout, self.state.cfg.merge)
        for i, w, sc in zip(ids, terms.counted, terms.scales):
            s.add(i, self.deltas.decode(self.state.pending[i]), w, sc)
        return s

    def _order(self) -> list[int]:
        """The pending deltas' islands in the order they were added to the running sum."""
        s = self.state
        return [i for i in s.sum.order if i in s.pending] if s.sum is not None else sorted(s.pending)

    def _contributions(self, ids: list[int]) -> dict[int, float]:
        """How far each delta could move the merge: its bounded weight x scale x largest value."""
        t = self._terms(ids)
        total = sum(t.counted) or 1.0
        return {i: w / total * sc * t.length * self.state.pending[i].peak for i, w, sc in zip(ids, t.counted, t.scales)}

    def _refuse_merged(self, lid: int, reason: str) -> None:
        """A delta that broke the merge leaves the round (on the tape, to its island, remembered: never accepted
        again); the running sum is rebuilt without it."""
        s = self.state
        d = s.pending.pop(lid)
        order = self._order()
        # rebuilt without it, in the order the others arrived
        s.sum = RoundSum.for_rule(s.run.layout, s.cfg.merge)
        for i in order:
            kept = s.pending[i]
            s.sum.add(i, self.deltas.decode(kept), self.deltas.weight(kept), self.deltas.scale(kept))
        reason = truncate(reason)
        self.outbox.record("refuse_delta", island=lid, round=d.round, digest=d.digest, reason=reason)
        self.outbox.add(DropDeltas(round=d.round, island=lid))
        m = s.members.get(lid)
        if m is not None and m.active:
            copy = {"copy": m.last_answer["copy"]} if m.last_answer and m.last_answer.get("digest") == d.digest else {}
            self.deltas.answer(m, copy, "error", {"code": str(Code.REFUSED), "reason": reason,
                                                  "round": d.base_version + 1, "base_version": d.base_version,
                                                  "digest": d.digest,
                                                  "version": s.version})
        self.deltas.remember_refused(d.digest)
        self.outbox.log("warning", f"refused island {lid}'s delta: {reason}")

    def _commit(self, r: OpenRound, ids: list[int], merged: Merged, stragglers: list[int], now: float) -> None:
        """The merge becomes the run's next version: on the tape, checkpointed, then broadcast (in that order)."""
        s = self.state
        r.advance(RoundPhase.COMMITTED)
        run = s.run
        version = run.version + 1
        digest = array_digest(merged.global_)
        summed, ids = ids, sorted(ids)  # the tape lists responders sorted, and the order they were summed in

        def by_island(values: Any) -> list[float]:
            return [float(x) for _, x in sorted(zip(summed, values))]

        weights = by_island(merged.weights)
        deltas = [s.pending[i].digest for i in ids]
        lags = [s.pending[i].lag for i in ids]
        self.outbox.record("merge", round=r.number, version=version, responders=ids, weights=weights,
                           loss_tokens=[s.pending[i].loss_tokens for i in ids], deltas=deltas, digest=digest,
                           stragglers=stragglers, update_norm=float(np.linalg.norm(merged.sent)), summed=summed,
                           robust=s.cfg.robust, clip={str(i): c for i, c in merged.clip.items()},
                           merge=s.cfg.merge, merge_weight=s.cfg.merge_weight, lora_merge=s.cfg.lora_merge,
                           step_normalize=s.cfg.step_normalize, lags=lags, clip_ref=merged.clip_ref,
                           counted=by_island(merged.counted), merged_norms=by_island(merged.merged_norms),
                           tiers=[s.pending[i].tier for i in ids],
                           grace_s=round(now - r.fresh_at, 6) if r.fresh_at is not None else None, **merged.rule,
                           **({"part": list(part)} if (part := s.part(r.number)) is not None else {}))
        if merged.clip:
            self.outbox.log("warning", f"round {r.number}: robust merge clipped island(s) "
                                       f"{', '.join(f'{i} (x{c:.3g})' for i, c in merged.clip.items())}")
        s.norm_history_of(s.part(r.number)).extend(zip(by_island(merged.merged_norms),
                                                       (s.pending[i].tier for i in ids)))  # (as the tape says)
        self._note_merged(ids, now)
        s.run = Checkpoint(version, run.layout, run.adapter_config, run.provenance, merged.global_,
                           merged.momentum, merged.residual, digest, asdict(s.cfg), sorted(s.seen),
                           dict(s.merged), contract=run.contract)
        s.ef.residual = merged.residual
        s.digests[version] = digest
        for v in [v for v in s.digests if v < version - s.cfg.versions_kept]:
            del s.digests[v]
        self.outbox.add(SaveCheckpoint(s.checkpoint()))
        self.outbox.record("checkpoint", version=version, digest=digest)
        self.outbox.add(DropDeltas(through_round=r.number))
        s.pending = {}
        s.sum = RoundSum.for_rule(run.layout, s.cfg.merge)
        s.round = None
        header = {"version": version, "round": r.number, "digest": digest, "responders": ids, "weights": weights,
                  "deltas": deltas, "lags": lags, "fragments": merged.descs}
        self._broadcast(Broadcast(version, header, merged.frames), r.number)
        self.outbox.log("info", f"round {r.number} merged {ids} weights {[round(w, 3) for w in weights]}; "
                                f"version {version}")

    def _note_merged(self, ids: list[int], now: float) -> None:
        """Each island's merged deltas (its latest MERGED_HISTORY), and the fresh ones' members train from now."""
        s = self.state
        for i in ids:
            d = s.pending[i]
            history = s.merged.setdefault(i, [])
            history.append(d.ref()[::2])  # [the round it trained, digest]: as its island names it
            del history[:-MERGED_HISTORY]
            m = s.members.get(i)
            if m is not None and d.lag == 0:
                m.since = now  # it waited for this merge: it trains from the broadcast on

    def _broadcast(self, b: Broadcast, round_number: int) -> None:
        """The new version to every live member (and kept, for one that asks again)."""
        s = self.state
        s.last_broadcast = b
        to = []
        for m in s.live():
            self.outbox.send(m.peer, "broadcast", b.header, b.frames)
            to.append(m.island)
        self.outbox.record("broadcast", round=round_number, version=b.version, to=to, bits=s.cfg.broadcast_bits,
                           bytes=message_bytes(encode("broadcast", b.header, b.frames)))
