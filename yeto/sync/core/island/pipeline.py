"""The deltas an island has in the syncer's hands (`DeltasInFlight`), pipelined ones (--pipeline D > 1, streamed runs)
included: the next rounds' parts pushed before this round's merge comes, so a slow link's upload overlaps with training
instead of stalling it.

Round R of a streamed run syncs one part; the merges of rounds b + 1 .. R - 1 sync other parts (`untouched_since`),
so a delta of R's part trained from version b equals one trained from version R - 1, the version R opens on. The
island trains R from the global it holds while its earlier deltas are in flight (at most D at once), and pushes it
naming R - 1 as its base and b as `trained_from`; the syncer keeps it until R opens. The deltas in flight are
`pushed` (the oldest: every rule of the island core applies to it) and `ahead` (the later ones, in round order); when
`pushed` settles, the first of `ahead` takes its place. Their parts are disjoint, so each gives back only its own
part of the error-feedback residual if it never counts. This object owns them and the residual; what it reads of the
run is the core's `RunKnowledge`, and what it sends goes to the core's `IslandOutbox`.
"""

from __future__ import annotations

from typing import Any, Optional

import numpy as np

from yeto.sync.core.island.knowledge import RunKnowledge
from yeto.sync.core.island.outbox import IslandOutbox
from yeto.sync.core.island.phases import Training
from yeto.sync.core.island.pushed import Pushed
from yeto.sync.wire.layout import Layout, fragment_pieces, synced_fragments, untouched_since
from yeto.sync.wire.quant import ErrorFeedback


class DeltasInFlight:
    """The deltas in the syncer's hands, oldest first, and the error-feedback residual they were quantized with."""

    def __init__(self, layout: Layout, run: RunKnowledge, outbox: IslandOutbox):
        self.layout = layout
        self.run = run
        self.outbox = outbox
        self.ef = ErrorFeedback(layout.numel)
        self.pushed: Optional[Pushed] = None  # the delta in the syncer's hands, until it is merged or refused
        self.ahead: list[Pushed] = []  # later rounds' deltas pushed before `pushed` settled
        self.given_back: set[int] = set()  # fragments whose latest push never counted (the loop's streamed start)

    def in_flight(self) -> list[Pushed]:
        """The deltas in the syncer's hands (or on their way), oldest first."""
        return ([self.pushed] if self.pushed is not None else []) + self.ahead

    def unsettled(self) -> bool:
        """Our delta awaits its merge (or, a stale one, its ack: one per round in the syncer), or an earlier
        session's delta counts in the round open on our version."""
        p, run = self.pushed, self.run
        if p is not None and (p.base_version == run.version or not p.acked):
            return True
        return run.contributed is not None and run.contributed[1] == run.version

    # ------------------------------------------------------------------ training ahead

    def pipelined_ok(self, rnd: int, base_version: int, base_digest: str) -> bool:
        """May round `rnd`, trained from `base_version` ahead of its round, still be pushed? Its base is the run's,
        its round is not merged yet, and no merge from its base to its round touches its part."""
        run = self.run
        return run.lineage.get(base_version) == base_digest and run.version < rnd and not run.need_state and \
            untouched_since(self.layout, run.policy.fragments, rnd, base_version, run.policy.outer_steps)

    def next_pipelined(self) -> Optional[int]:
        """The round to train ahead now, or None: the pipeline is full, or the next round's part moves first."""
        flying, run = self.in_flight(), self.run
        if run.policy.pipeline <= 1 or not flying or len(flying) >= run.policy.pipeline or run.global_ is None:
            return None
        rnd = max(p.round for p in flying) + 1
        if rnd <= max(run.version, run.syncer_version) + 1 or rnd > run.policy.outer_steps or \
                rnd - 1 - run.version >= run.policy.pipeline:  # (the syncer takes it only from D - 1 versions back)
            return None
        return rnd if self.pipelined_ok(rnd, run.version, run.digest) else None

    def training_ahead(self, now: float, max_inner_steps: int) -> Optional[Training]:
        """The next round to train ahead of its opening, from the global held, while earlier deltas are in flight."""
        rnd = self.next_pipelined()
        run = self.run
        if rnd is None or run.finish is not None or run.policy.windowed:
            return None
        assert run.global_ is not None
        return Training(rnd, run.version, run.global_.copy(), now, run.policy.steps_for(max_inner_steps), 0.0,
                        run.digest)

    def may_send_now(self, t: Training) -> bool:
        """May this round's work go now: nothing in flight, or it is the next round the pipeline may take, or (the
        pipeline's open round, whose earlier delta of ours was lost) one older than all in flight, of another part."""
        flying = self.in_flight()
        if not flying:
            return True
        if self.run.policy.pipeline <= 1 or not all(self.disjoint(t.round, p) for p in flying):
            return False
        rounds = [p.round for p in flying]
        return t.round < min(rounds) or (len(flying) < self.run.policy.pipeline and t.round > max(rounds) and
                                         t.round > t.base_version + 1)

    def disjoint(self, rnd: int, p: Pushed) -> bool:
        """Do round `rnd` and the delta in flight `p` sync different fragments (so each keeps its own residual)?"""
        mine = set(synced_fragments(self.layout, self.run.part(rnd)))
        return p.round != rnd and mine.isdisjoint(synced_fragments(self.layout, p.part))

    def open_round_missed(self) -> bool:
        """The open round, on our version, lacks a delta of ours while later ones are in flight (its earlier delta
        was refused or lost): train it, or the merges our pipelined deltas wait for may never come."""
        run = self.run
        r = run.open_round
        flying = self.in_flight()
        if run.policy.pipeline <= 1 or r is None or r["version"] != run.version or not flying:
            return False
        return all(self.disjoint(r["round"], p) and p.round > r["round"] for p in flying) and not (
            run.contributed or run.place_held)

    @staticmethod
    def wire_base(t: Training, header: dict[str, Any]) -> dict[str, Any]:
        """A pipelined round names the version its round opens on as its base, and the one it trained from."""
        if t.round <= t.base_version + 1:
            return header
        return {**header, "base_version": t.round - 1, "base_digest": "", "trained_from": t.base_version,
                "trained_digest": t.base_digest}

    # ------------------------------------------------------------------ sending

    def enqueue(self, p: Pushed) -> None:
        """A delta now in flight, in round order: the oldest is `pushed`, whose rules the core follows."""
        flying = sorted(self.in_flight() + [p], key=lambda q: q.round)
        self.pushed, self.ahead = flying[0], flying[1:]

    def send(self, p: Pushed) -> None:
        """A copy of `p` on its way (the syncer's answers name the copy they answer)."""
        p.copies += 1
        self.outbox.send("delta", {**p.header, "copy": p.copies}, p.frames)
        p.on_its_way = True

    def resend_pushed(self) -> None:
        """Send `pushed` again (the syncer lacks it, or may)."""
        p = self.pushed
        if p is not None and p.frames:
            p.acked = False  # an ack from a syncer process that lost it says nothing about this copy (sim seed 5316)
            self.send(p)

    def pushed_ref(self) -> Optional[list]:
        """What a ping or sync says of `pushed`: [round, base version, digest], or None."""
        p = self.pushed
        return [p.round, p.base_version, p.digest] if p is not None else None

    def copies_lost(self) -> None:
        """The connections are remade: no copy of any delta in flight is on its way any more, a pipelined one's
        neither (sim seed 192937500: one pushed just before a reconnect was taken for still coming, for good)."""
        for p in self.in_flight():
            p.on_its_way = False

    # ------------------------------------------------------------------ settling

    def settle(self, version: int, merged: list[list]) -> None:
        """A new global: our pushed delta counted if it is among the merged ones (`merged`: [round, digest] of this
        island id's merged deltas); if not, and it cannot land in a later round either, it never will, and its
        residual is ours again."""
        run = self.run
        while True:  # (then the next delta in flight, which a state that jumps versions may settle too)
            p = self.pushed
            if p is None or p.base_version == version or (p.base_version > version and "trained_from" in p.header):
                return  # (a pipelined one waits for the version its round opens on)
            counted = [p.round, p.digest] in merged
            may_land = not counted and 0 < version - p.base_version <= run.policy.max_base_lag and (
                run.lineage.get(p.base_version) == p.base_digest) and not (
                p.merge_round is not None and version >= p.merge_round)  # (acked into a round merged without it)
            if not counted and not may_land:
                self.give_back(p)  # it never counted: its quantization error is not ours to carry
            if may_land:
                return
            self.pushed = None
            self.promote()

    def drop_uncounted(self) -> None:
        """`pushed` will never count: its residual is ours again, and the next delta in flight takes its place. (The
        place a late one held is freed by the next pong saying the round holds nothing of ours, not here: a merge that
        refused it may have gone on without it and closed the round, and this error comes before that broadcast, which
        travels on the bulk connection.)"""
        p = self.pushed
        assert p is not None
        self.give_back(p)
        self.pushed = None
        self.promote()

    def give_back(self, p: Pushed) -> None:
        """A delta that never counts: its part of the error-feedback residual is as it was before it, and the
        training loop is told (`given_back`: the steps before that push are not in any global)."""
        residual = self.ef.residual.copy()  # (a new array: a caller holding the old one keeps it)
        self.restore(p, residual)
        self.ef.residual = residual
        self.given_back.update(synced_fragments(self.layout, p.part))

    def pushing(self, t: Training) -> None:
        """The loop pushes round t's work: its fragments' latest push is this one, not one given back before."""
        self.given_back.difference_update(synced_fragments(self.layout, self.run.part(t.round)))

    def counted_residual(self) -> np.ndarray:
        """The error-feedback residual of the deltas that count: each delta still in flight gives its part back."""
        residual = self.ef.residual.copy()
        for p in self.in_flight():
            self.restore(p, residual)
        return residual

    def restore(self, p: Pushed, residual: np.ndarray) -> None:
        """Set p's part of `residual` (in place) to what it was before p was quantized."""
        for a, n in fragment_pieces(self.layout, synced_fragments(self.layout, p.part)):
            residual[a : a + n] = p.residual_before[a : a + n]

    def promote(self) -> None:
        """The oldest delta in flight settled: the next one is now the one the core's rules follow."""
        if self.pushed is None and self.ahead:
            self.pushed = self.ahead.pop(0)

    def ahead_matching(self, h: dict[str, Any]) -> Optional[Pushed]:
        """The delta pushed ahead that an ack or error names, if any."""
        for p in self.ahead:
            if [p.round, p.base_version] == [h.get("round"), h.get("base_version")] and h.get("digest",
                                                                                              p.digest) == p.digest:
                return p
        return None

    def ahead_refused(self, h: dict[str, Any]) -> bool:
        """A delta pushed ahead was refused: final (it trained the round from a version the syncer no longer takes);
        its residual is ours again. False if the error is not about one."""
        p = self.ahead_matching(h)
        if p is None:
            return False
        self.ahead.remove(p)
        self.give_back(p)
        return True
