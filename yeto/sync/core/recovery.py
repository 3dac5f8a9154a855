"""Recovery: a syncer process starts from what survived on disk, the tape reconciled with the checkpoint and deltas.

The tape is folded with `TapeFold` (the audit's fold, so the recovery and the audit agree on what a tape means). A
restart resumes at the checkpoint: merges recorded after it (their checkpoint was not durable) are rolled back on the
tape, the saved deltas of the open round are restored (a delta whose tape line was lost is recorded now), and the
accepted deltas that were not saved are discarded on the tape (their islands send them again). With no checkpoint at
all the run starts from scratch: whatever the tape accepted before is void.
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Any, Optional

from yeto.sync.core.actions import AcceptedDelta, Checkpoint, DropDeltas, Durable
from yeto.sync.core.deltas import Deltas
from yeto.sync.core.state import SyncerOutbox, SyncerState
from yeto.sync.core.fold import TapeFold
from yeto.sync.merge.aggregate import RoundSum
from yeto.sync.merge.rules import Tier
from yeto.sync.wire.layout import synced_fragments
from yeto.sync.wire.protocol import ProtocolError, truncate
from yeto.sync.wire.quant import ErrorFeedback

Saved = dict[tuple[int, int], AcceptedDelta]  # (round, island) -> a delta saved on disk


class Recovery:
    """What a process start does (`SyncerCore.start`)."""

    def __init__(self, state: SyncerState, outbox: SyncerOutbox, deltas: Deltas):
        self.state = state
        self.outbox = outbox
        self.deltas = deltas  # how a saved delta is decoded, weighed and recorded again

    def recover(self, now: float, durable: Durable) -> bool:
        """Resume from what survived, reconciling the tape with the disk; False when nothing durable was found (the
        run starts from scratch)."""
        s = self.state
        ck = durable.checkpoint
        if ck is not None:  # (first: the start record shows the config the run goes on with)
            s.cfg.check_resume(ck.config, ck.version)
        self.outbox.record("start", config=asdict(s.cfg), incarnation=s.incarnation)
        self.outbox.extend(durable.notes)
        fold = self._fold(durable.tape)
        rolled_back = list(range(fold.version, (ck.version if ck else -1), -1))
        for v in rolled_back:
            self.outbox.record("rollback", version=v, reason="its checkpoint was not durable when the syncer stopped")
            fold.rollback(v)
        if ck is None:
            self._start_from_scratch(fold, durable)
            return False
        self._resume_state(ck, fold)
        saved = {(d.round, d.island): d for d in durable.deltas}
        self._discard_unsaved(ck, fold, saved)
        restored = self._restore_saved(ck, fold, saved)
        self.outbox.add(DropDeltas(through_round=ck.version))
        for (rnd, lid), d in saved.items():
            if rnd == ck.version + 1 and lid not in s.pending:
                self.outbox.add(DropDeltas(round=rnd, island=lid))
        s.started = ck.version > 0 or bool(s.pending)
        s.absent_until = now + s.cfg.island_timeout
        self.outbox.record("resume", version=ck.version, digest=ck.digest, restored=restored, rolled_back=rolled_back)
        self.outbox.log("info", f"resumed at version {ck.version} ({len(restored)} delta(s) of round {ck.version + 1} "
                                "restored)")
        return True

    def _fold(self, tape: list[dict[str, Any]]) -> TapeFold:
        """The tape folded; the deltas merges refused are remembered (never accepted again)."""
        fold = TapeFold()
        for e in tape:
            fold.feed(e)
            if e.get("event") == "refuse_delta" and isinstance(e.get("digest"), str):
                self.deltas.remember_refused(e["digest"])
        return fold

    def _start_from_scratch(self, fold: TapeFold, durable: Durable) -> None:
        """Nothing durable: a fresh run (anything the tape accepted before is void)."""
        for (rnd, lid), ev in sorted(fold.outstanding.items()):
            self.outbox.record("discard", island=lid, round=rnd, digest=ev["digest"],
                               reason="the run restarted from scratch: no checkpoint was durable")
        if durable.deltas:
            self.outbox.add(DropDeltas(through_round=max(d.round for d in durable.deltas)))

    def _resume_state(self, ck: Checkpoint, fold: TapeFold) -> None:
        """The run as the checkpoint holds it, and whom it waits for: the checkpoint's members, and those who joined
        since (on the tape)."""
        s = self.state
        s.run = ck
        s.ef = ErrorFeedback(ck.layout.numel)
        s.ef.residual = ck.residual
        s.seen = set(ck.members) | fold.joined
        s.merged = {int(k): v for k, v in ck.merged.items()}
        s.retired = {int(k): list(v) for k, v in ck.retired.items()}
        s.owners = dict(ck.owners)
        s.sum = RoundSum.for_rule(ck.layout, s.cfg.merge)
        s.digests = {v: d for v, d in fold.digests.items() if ck.version - s.cfg.versions_kept <= v < ck.version}
        s.digests[ck.version] = ck.digest
        s.norm_history = {}
        for v in sorted(x for x in fold.merged if x <= ck.version):  # the clip's history, as the tape says it grew
            e = fold.merged[v]
            norms = e.get("merged_norms") or []
            part = tuple(e["part"]) if e.get("part") is not None else None
            s.norm_history_of(part).extend(zip(norms, e.get("tiers") or [Tier.BOUNDED] * len(norms)))

    def _discard_unsaved(self, ck: Checkpoint, fold: TapeFold, saved: Saved) -> None:
        """Deltas the tape accepted that the disk does not hold (or not for the open round) are void, on the tape."""
        for (rnd, lid), ev in sorted(fold.outstanding.items()):
            d = saved.get((rnd, lid))
            if rnd != ck.version + 1 or d is None or d.digest != ev["digest"]:
                self.outbox.record("discard", island=lid, round=rnd, digest=ev["digest"],
                                   reason="not saved when the syncer stopped; its island sends it again")

    def _restore_saved(self, ck: Checkpoint, fold: TapeFold, saved: Saved) -> list[int]:
        """The saved deltas of the open round back in its sum, in island order; returns whose were restored."""
        s = self.state
        restored = []
        for (rnd, lid), d in sorted(saved.items()):
            ev = fold.outstanding.get((rnd, lid))
            if not self._restorable(ck, fold, d, ev):
                continue
            if ev is not None and not self._fits_its_part(d):  # the run's parts moved: sent again, it would not fit
                reason = (f"round {rnd} no longer syncs the fragments this delta carries (the run restarted with "
                          "another --outer-steps, and its last round, which syncs the whole adapter, moved)")
                self.outbox.record("refuse_delta", island=lid, round=rnd, digest=d.digest, reason=reason)
                self.outbox.add(DropDeltas(round=rnd, island=lid))
                self.deltas.remember_refused(d.digest)
                continue
            try:
                flat = self.deltas.decode(d)
            except ProtocolError as e:  # a file that does not fit this run: its island sends the delta again
                if ev is not None:
                    self.outbox.record("discard", island=lid, round=rnd, digest=d.digest, reason=truncate(str(e)))
                continue
            self.deltas.measure(d, flat)
            if ev is None:  # saved, but its tape line was lost: account for it now
                self.outbox.record("delta", **self.deltas.delta_fields(d), norm=d.norm, recovered=True)
            s.pending[lid] = d
            s.sum.add(lid, flat, self.deltas.weight(d), self.deltas.scale(d))
            restored.append(lid)
        return restored

    def _fits_its_part(self, d: AcceptedDelta) -> bool:
        """Does a saved delta carry the fragments its round syncs now?"""
        s = self.state
        return [x.get("index") for x in d.descs] == list(synced_fragments(s.run.layout, s.part(d.round)))

    def _restorable(self, ck: Checkpoint, fold: TapeFold, d: AcceptedDelta, ev: Optional[dict[str, Any]]) -> bool:
        """A saved delta counts again if it is the open round's, its base within --max-base-lag, and it is the delta
        the tape accepted (or one the tape lost the line of, not one it merged or refused)."""
        if d.round != ck.version + 1 or not 0 <= ck.version - d.base_version <= self.state.cfg.max_base_lag:
            return False
        if ev is None:
            return not fold.resolved(d.round, d.island, d.digest)
        return ev["digest"] == d.digest
