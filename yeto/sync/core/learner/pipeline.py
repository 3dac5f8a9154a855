"""A learner's pipelined deltas (--pipeline D > 1, streamed runs): the next rounds' parts pushed before this round's
merge comes, so a slow link's upload overlaps with training instead of stalling it.

Round R of a streamed run syncs one part; the merges of rounds b + 1 .. R - 1 sync other parts (`untouched_since`),
so a delta of R's part trained from version b equals one trained from version R - 1, the version R opens on. The
learner trains R from the global it holds while its earlier deltas are in flight (at most D at once), and pushes it
naming R - 1 as its base and b as `trained_from`; the syncer keeps it until R opens. The deltas in flight are
`pushed` (the oldest: every rule of the learner core applies to it) and `ahead` (the later ones, in round order); when
`pushed` settles, the first of `ahead` takes its place. Their parts are disjoint, so each gives back only its own
part of the error-feedback residual if it never counts.
"""

from __future__ import annotations

from typing import Any, Optional

import numpy as np

from yeto.sync.core.learner.phases import Phase, Training
from yeto.sync.core.learner.loop import Train
from yeto.sync.core.learner.pushed import Pushed
from yeto.sync.wire.layout import fragment_pieces, synced_fragments, untouched_since


class PipelinedDeltas:
    @property
    def pipeline(self) -> int:  # deltas a learner may have in flight (1: it waits for each merge)
        return int(self.policy.get("pipeline", 1))

    @property
    def versions_kept(self) -> int:
        """How far back a base may be and still be pushed: --max-base-lag, or a pipelined round's distance."""
        return max(self.max_lag, self.pipeline - 1)

    def in_flight(self) -> list[Pushed]:
        """The deltas in the syncer's hands (or on their way), oldest first."""
        return ([self.pushed] if self.pushed is not None else []) + self.ahead

    def _pipelined_ok(self, rnd: int, base_version: int, base_digest: str) -> bool:
        """May round `rnd`, trained from `base_version` ahead of its round, still be pushed? Its base is the run's,
        its round is not merged yet, and no merge from its base to its round touches its part."""
        return self.lineage.get(base_version) == base_digest and self.version < rnd and not self.need_state and \
            untouched_since(self.layout, self.fragments, rnd, base_version, int(self.policy.get("outer_steps", 0)))

    def _next_pipelined(self) -> Optional[int]:
        """The round to train ahead now, or None: the pipeline is full, or the next round's part moves first."""
        flying = self.in_flight()
        if self.pipeline <= 1 or not flying or len(flying) >= self.pipeline or self.global_ is None:
            return None
        rnd = max(p.round for p in flying) + 1
        if rnd <= max(self.version, self.syncer_version) + 1 or rnd > int(self.policy.get("outer_steps", 0)) or \
                rnd - 1 - self.version >= self.pipeline:  # (the syncer takes it only from D - 1 versions back)
            return None
        return rnd if self._pipelined_ok(rnd, self.version, self.digest) else None

    def _start_pipelined(self, now: float) -> Optional[Train]:
        """Train the next round ahead of its opening, from the global held, while earlier deltas are in flight."""
        rnd = self._next_pipelined()
        if rnd is None or self.finish is not None or self.policy.get("round_seconds"):
            return None
        steps = int(self.policy["inner_steps"])
        if self.max_inner_steps:
            steps = min(steps, self.max_inner_steps)
        t = Training(rnd, self.version, self.global_.copy(), now, steps, 0.0, self.digest)
        self._enter(Phase.TRAINING, f"round {rnd} pipelined on version {self.version}", t)
        return Train(t.round, t.base_version, t.base, steps, 0.0)

    def _may_send_now(self, t: Training) -> bool:
        """May this round's work go now: nothing in flight, or it is the next round the pipeline may take, or (the
        pipeline's open round, whose earlier delta of ours was lost) one older than all in flight, of another part."""
        flying = self.in_flight()
        if not flying:
            return True
        if self.pipeline <= 1 or not all(self._disjoint(t.round, p) for p in flying):
            return False
        rounds = [p.round for p in flying]
        return t.round < min(rounds) or (len(flying) < self.pipeline and t.round > max(rounds) and
                                         t.round > t.base_version + 1)

    def _disjoint(self, rnd: int, p: Pushed) -> bool:
        """Do round `rnd` and the delta in flight `p` sync different fragments (so each keeps its own residual)?"""
        mine = set(synced_fragments(self.layout, self.part(rnd)))
        return p.round != rnd and mine.isdisjoint(synced_fragments(self.layout, p.part))

    def _open_round_missed(self) -> bool:
        """The open round, on our version, lacks a delta of ours while later ones are in flight (its earlier delta
        was refused or lost): train it, or the merges our pipelined deltas wait for may never come."""
        r = self.open_round
        flying = self.in_flight()
        if self.pipeline <= 1 or r is None or r["version"] != self.version or not flying:
            return False
        return all(self._disjoint(r["round"], p) and p.round > r["round"] for p in flying) and not (
            self.contributed or self.place_held)

    def _enqueue(self, p: Pushed) -> None:
        """A delta now in flight, in round order: the oldest is `pushed`, whose rules the core follows."""
        flying = sorted(self.in_flight() + [p], key=lambda q: q.round)
        self.pushed, self.ahead = flying[0], flying[1:]

    @staticmethod
    def _wire_base(t: Training, header: dict[str, Any]) -> dict[str, Any]:
        """A pipelined round names the version its round opens on as its base, and the one it trained from."""
        if t.round <= t.base_version + 1:
            return header
        return {**header, "base_version": t.round - 1, "base_digest": "", "trained_from": t.base_version,
                "trained_digest": t.base_digest}

    def _copies_lost(self) -> None:
        """The connections are remade: no copy of any delta in flight is on its way any more, a pipelined one's
        neither (sim seed 192937500: one pushed just before a reconnect was taken for still coming, for good)."""
        for p in self.in_flight():
            p.on_its_way = False

    def _give_back(self, p: Pushed) -> None:
        """A delta that never counts: its part of the error-feedback residual is as it was before it, and the
        training loop is told (`given_back`: the steps before that push are not in any global)."""
        residual = self.ef.residual.copy()  # (a new array: a caller holding the old one keeps it)
        self._restore(p, residual)
        self.ef.residual = residual
        self.given_back.update(synced_fragments(self.layout, p.part))

    def _pushing(self, t: Training) -> None:
        """The loop pushes round t's work: its fragments' latest push is this one, not one given back before."""
        self.given_back.difference_update(synced_fragments(self.layout, self.part(t.round)))

    def counted_residual(self) -> np.ndarray:
        """The error-feedback residual of the deltas that count: each delta still in flight gives its part back."""
        residual = self.ef.residual.copy()
        for p in self.in_flight():
            self._restore(p, residual)
        return residual

    def _restore(self, p: Pushed, residual: np.ndarray) -> None:
        """Set p's part of `residual` (in place) to what it was before p was quantized."""
        for a, n in fragment_pieces(self.layout, synced_fragments(self.layout, p.part)):
            residual[a : a + n] = p.residual_before[a : a + n]

    def _promote(self) -> None:
        """The oldest delta in flight settled: the next one is now the one the core's rules follow."""
        if self.pushed is None and self.ahead:
            self.pushed = self.ahead.pop(0)

    def _ahead_matching(self, h: dict[str, Any]) -> Optional[Pushed]:
        """The delta pushed ahead that an ack or error names, if any."""
        for p in self.ahead:
            if [p.round, p.base_version] == [h.get("round"), h.get("base_version")] and h.get("digest",
                                                                                              p.digest) == p.digest:
                return p
        return None

    def _ahead_refused(self, h: dict[str, Any]) -> bool:
        """A delta pushed ahead was refused: final (it trained the round from a version the syncer no longer takes);
        its residual is ours again. False if the error is not about one."""
        p = self._ahead_matching(h)
        if p is None:
            return False
        self.ahead.remove(p)
        self._give_back(p)
        return True
