"""recovery"""

from __future__ import annotations

from dataclasses import asdict

from yeto.sync.aggregate import RoundSum
from yeto.sync.core.actions import Action, DropDeltas, Durable
from yeto.sync.core.deltas import Deltas
from yeto.sync.core.fold import TapeFold
from yeto.sync.protocol import ProtocolError, truncate
from yeto.sync.quant import ErrorFeedback


class Recovery(Deltas):
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
