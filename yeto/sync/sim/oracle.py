"""The oracle: what the simulation knows that no node does (every durable global adapter, every payload sent, every
ack received, every delta merged), and the invariants it checks along the way and at the end of a schedule."""

from __future__ import annotations

from typing import Any, Optional

import numpy as np

from yeto.sync.merge.aggregate import RoundSum, clipped_merge, effective_weight
from yeto.sync.shell.audit import TapeFold, audit
from yeto.sync.core.actions import Checkpoint, Out
from yeto.sync.core.island import IslandCore
from yeto.sync.core.island.phases import TRANSITIONS, Phase
from yeto.sync.merge.rules import DeltaCounts, merge_terms, reported_fields
from yeto.sync.merge.outer import nesterov_step, nesterov_step_on
from yeto.sync.wire.layout import fragment_pieces, round_part, synced_fragments
from yeto.sync.wire.protocol import Code, Message, array_digest, decode_fragments, digest_bytes, encode_fragments_ef
from yeto.sync.wire.quant import ErrorFeedback

class Violation(Exception):
    """An invariant broken: the schedule's finding."""


class Oracle:
    def __init__(self, world: Any):  # the World (yeto.sync.sim.world imports this module, not the other way round)
        self.w = world
        self.globals: dict[int, tuple[str, np.ndarray]] = {}  # durable version -> (digest, adapter)
        # (delta digest, its fragments' indexes) -> (descs, frames): equal deltas of two parts (zeros) share a digest
        self.payloads: dict[tuple[str, tuple[int, ...]], tuple[list, list[bytes]]] = {}
        self.init_payloads: dict[str, np.ndarray] = {}  # global digest -> initial adapter
        # deltas as (island, base version, digest): two sessions of one island may send equal bits on other bases
        self.acked: set[tuple[int, int, str]] = set()  # every ack an island received
        self.merged: set[tuple[int, int, str]] = set()  # the deltas in durable merges
        # each island core's phase sequence: (the core, moves as (from, to, event), how many of them were checked);
        # the core is held so that its id is never a later core's (a relaunched island's), whose moves would replace
        # its own, by where memory happened to be free
        self.moves: dict[int, tuple[IslandCore, list[tuple[Phase, Phase, str]], list[int]]] = {}

    def watch_phases(self, lid: int, core: IslandCore) -> None:
        """Record every move of an island core's phase (its phase sequence), to check it after each event."""
        moves: list[tuple[Phase, Phase, str]] = []
        self.moves[id(core)] = (core, moves, [0])

        def on_move(old: Phase, new: Phase, event: str) -> None:
            moves.append((old, new, event))
            self.w.log(f"island {lid}: {old.value} -> {new.value} ({event})")

        core.phases.on_move = on_move

    def check_phases(self, lid: int, core: IslandCore) -> None:
        """Each move since the last check is in the phase table and starts where the one before it ended, and the
        core is in the phase its last move entered (a phase changed around `Phases.enter` is caught here even
        where the core's own check was skipped)."""
        _, moves, checked = self.moves[id(core)]
        at = moves[checked[0] - 1][1] if checked[0] else Phase.JOINING
        for old, new, event in moves[checked[0]:]:
            if old is not at:
                raise Violation(f"island {lid} moved {old.value} -> {new.value} on {event}, but its last recorded "
                                f"move entered {at.value}: a phase changed outside Phases.enter")
            if new not in TRANSITIONS[old]:
                raise Violation(f"island {lid} moved {old.value} -> {new.value} on {event}: the phase table has no "
                                "such move")
            at = new
        checked[0] = len(moves)
        if core.phase is not at:
            raise Violation(f"island {lid} is {core.phase.value}, but its last recorded move entered {at.value}: a "
                            "phase changed outside Phases.enter")

    def moves_seen(self) -> set[tuple[str, str]]:
        """The phase moves (from, to) any island of this schedule made."""
        return {(old.value, new.value) for _, moves, _ in self.moves.values() for old, new, _ in moves}

    def note_durable(self, ck: Checkpoint) -> None:
        had = self.globals.get(ck.version)
        if had is not None and had[0] != ck.digest:
            raise Violation(f"durable version {ck.version} redefined: {had[0]} then {ck.digest}")
        self.globals[ck.version] = (ck.digest, ck.global_.copy())

    def check_held(self, lid: int, version: int, flat: np.ndarray) -> None:
        want = self.globals.get(version)
        if want is None or not np.array_equal(want[1], flat):
            raise Violation(f"island {lid} holds version {version} ({array_digest(flat)}), which the syncer's disk "
                            f"does not ({want[0] if want else 'no such durable version'})")

    def check_base(self, lid: int, version: int, base: np.ndarray) -> None:
        want = self.globals.get(version)
        if want is None or not np.array_equal(want[1], base):
            raise Violation(f"island {lid} pushed a delta against version {version} but trained from another "
                            f"adapter ({array_digest(base)} vs {want[0] if want else 'unknown'})")

    def check_end(self) -> None:
        tape = self.w.syncer.disk.tape
        internal = [e for e in tape if e["event"] == "internal_error"]
        if internal:  # the core caught a bug of its own (and went on, or halted): a finding either way
            raise Violation(f"the syncer recorded an internal error: {internal[0].get('error')}")
        # (the audit's bound checks are the influence invariant: no island's claim bought more than the round's low
        # median weight, no merged delta was above k x the clip's reference)
        report = audit(tape)
        if not report.ok:
            raise Violation(f"audit: {report.violation}")
        core = self.w.syncer.core
        final = core.run
        if self.w.syncer.exit_code != 0 or final is None or final.version < core.cfg.outer_steps:
            raise Violation(f"the syncer ended with code {self.w.syncer.exit_code} at version "
                            f"{final.version if final else None} of {core.cfg.outer_steps}")
        for lrn in self.w.processes():
            self.check_island_ends(lrn, final)
        self.check_slow_links_kept(tape)
        fold = TapeFold()
        for e in tape:
            fold.feed(e)
        bases = {(e["round"], e["island"], e["digest"]): e["base_version"] for e in tape if e["event"] == "delta"}
        settled = {(lid, bases.get((rnd, lid, d)), d) for rnd, lid, d in fold.settled}
        lost = sorted(a for a in self.acked if a not in settled)
        if lost:
            raise Violation(f"acked deltas (island, base version, digest) never merged nor refused: {lost}")
        replayed = self.replay(tape)
        if not np.array_equal(replayed, final.global_):
            raise Violation("replaying the tape's merges does not give the final global adapter")

    def check_slow_links_kept(self, tape: list[dict[str, Any]]) -> None:
        """An island whose only trouble is a slow bulk link (its bytes flowing, its control link fast) is never taken
        for a silent one: no fault of its own (kill, cut, freeze), no lost message anywhere, no syncer freeze."""
        s = self.w.s
        if s.p_drop or any(node < 0 for _, node, _ in s.pauses):
            return
        troubled = {lid for _, lid, _, _ in s.island_kills} | {lid for _, lid, _ in s.cuts} | {
            node for _, node, _ in s.pauses} | {lid for _, lid in s.give_ups}
        for e in tape:
            if e["event"] == "leave" and e["island"] in s.slow_links and e["island"] not in troubled and \
                    e["reason"].startswith("silent"):
                raise Violation(f"island {e['island']}, behind a slow link ({s.slow_links[e['island']]:g} B/s) and "
                                f"otherwise sound, was dropped at version {e['version']}: {e['reason']}")

    def check_island_ends(self, lrn: Any, final: Checkpoint) -> None:
        """How an island process ended, each time it did: finished holding the final adapter bit for bit, and in error
        or without it only where excused."""
        for done, holds, at, booted in lrn.results:
            if done.complete and not (holds[0] == final.version and np.array_equal(holds[1], final.global_)):
                raise Violation(f"island {lrn.lid} finished holding version {holds[0]}, not the final "
                                f"version {final.version} bit for bit")
            # excused: it (re)started after the run was over, or the run ended while faults still cut it off
            # (a finished syncer waits for silent islands, but not forever)
            # or a zombie (its replacement holds the id; it may be told so, or give up)
            # or one kept out because a newer process holds its island id
            excused = (booted > self.w.syncer.exited_at or self.w.syncer.exited_at < self.w.healed_at
                       or lrn in self.w.zombies or done.code == Code.BUSY)
            if done.error and not excused:
                raise Violation(f"island {lrn.lid} ended in error at t={at:.1f}s: {done.reason}")
            # a stop lingers STOP_LINGER_S, not long enough for a slow link to carry the stop's adapter: the process
            # relaunched after it fetches the final one
            stopped_slow = lrn.lid in self.w.s.slow_links and any(a <= at for a, _ in self.w.stop_windows) and any(
                later > at for _, _, _, later in lrn.results)
            if not done.complete and not done.error and at > self.w.healed_at and lrn not in self.w.zombies and \
                    not stopped_slow:
                raise Violation(f"island {lrn.lid} ended at t={at:.1f}s, with the network healthy since "
                                f"t={self.w.healed_at:.1f}s, without the final adapter: {done.reason}")

    def keep_payload(self, digest: str, descs: list[dict[str, Any]], frames: list[bytes]) -> None:
        self.payloads[digest, tuple(sorted(d["index"] for d in descs))] = (descs, frames)

    def payload(self, digest: str, part: Optional[tuple[int, ...]]) -> tuple[list, list[bytes]]:
        """A merged delta's payload: of the round's part, or (a round of the whole adapter) of every fragment."""
        found = sorted(((len(idx), idx) for dg, idx in self.payloads if dg == digest and (
            part is None or idx == tuple(sorted(part)))), reverse=True)
        if not found:
            raise Violation(f"a merge uses delta {digest} of fragments {part}, which no island sent")
        return self.payloads[digest, found[0][1]]

    def replay(self, tape: list[dict[str, Any]]) -> np.ndarray:
        fold = TapeFold()
        for e in tape:
            fold.feed(e)
        cfg = self.w.s.syncer_config()
        deltas_on_tape = {(e["digest"], e["round"], e["island"]): e for e in tape if e["event"] == "delta"}  # (a run
        # restarted from scratch may see an island's same delta again, in another round; two islands' zero deltas
        # share a digest)
        g = self.init_payloads[fold.digests[0]].copy()
        m = np.zeros_like(g)
        ef = ErrorFeedback(self.w.layout.numel)
        starts = [(s["seq"], int(s["config"]["outer_steps"])) for s in tape if s["event"] == "start"]
        history = {0: g}  # version -> the global (a pipelined delta's part must be as its round's base has it)
        for v in sorted(fold.merged):
            e = fold.merged[v]
            outer_steps = [n for seq, n in starts if seq < e["seq"]][-1]  # (a restart may have raised it)
            part = round_part(self.w.layout, cfg.fragments, e["round"], outer_steps)
            if (e.get("part") is None) != (part is None) or (part is not None and tuple(e["part"]) != part):
                raise Violation(f"merge {v} of round {e['round']} is of fragments {e.get('part')}, the round's part "
                                f"is {part}")
            payloads = [self.payload(d, part) for d in e["deltas"]]
            deltas = {lid: decode_fragments(self.w.layout, Message("delta", {"fragments": descs}, frames), part)
                      for lid, (descs, frames) in zip(e["responders"], payloads)}
            lags = e.get("lags") or [0] * len(e["responders"])
            normalize = bool(e.get("step_normalize"))
            mine = [deltas_on_tape[d, e["round"], lid] for lid, d in zip(e["responders"], e["deltas"])]
            self._check_trained_from(mine, history, g, part)
            terms = merge_terms([DeltaCounts(d["loss_tokens"], d["tokens"], d["inner_steps"]) for d in mine],
                                cfg.merge_weight, lags, cfg.staleness_exponent, normalize,
                                [d["round_steps"] for d in mine], [d.get("tier", "bounded") for d in mine])
            weight = dict(zip(e["responders"], terms.counted))
            scale = dict(zip(e["responders"], terms.scales))
            s = RoundSum.for_rule(self.w.layout, e["merge"])
            for lid in e["summed"]:
                s.add(lid, deltas[lid], weight[lid], scale[lid])
            clip = {int(k): c for k, c in e["clip"].items()}
            weights = {lid: effective_weight(weight[lid], scale[lid]) for lid in weight}
            avg, report = clipped_merge(s, clip, weights, deltas.__getitem__)
            avg = avg * np.float32(terms.length)
            for name, what in reported_fields().items():  # (every rule's: a merge reports its own rule's alone)
                if report.get(name) != e.get(name):
                    raise Violation(f"replay of merge {v}: {report.get(name)} {what}, the tape says {e.get(name)}")
            if part is None:
                new, m = nesterov_step(g, avg, m, cfg.outer_lr, cfg.outer_momentum)
            else:
                new, m = nesterov_step_on(g, avg, m, cfg.outer_lr, cfg.outer_momentum,
                                          fragment_pieces(self.w.layout, part))
            _, _, sent = encode_fragments_ef(self.w.layout, new - g, cfg.broadcast_bits, ef, part)
            g = history[v] = g + sent
            if array_digest(g) != e["digest"]:
                raise Violation(f"replay of merge {v} gives {array_digest(g)}, the tape says {e['digest']}")
        return g

    def _check_trained_from(self, merged: list[dict[str, Any]], history: dict[int, np.ndarray], base: np.ndarray,
                            part: Optional[tuple[int, ...]]) -> None:
        """A pipelined delta merged (trained from an older version than its round's base) trained from the same
        values of its part as the round's base holds: no merge in between changed them."""
        for d in merged:
            b = d.get("trained_from")
            if b is None:
                continue
            for start, n in fragment_pieces(self.w.layout, synced_fragments(self.w.layout, part)):
                if not np.array_equal(history[b][start : start + n], base[start : start + n]):
                    raise Violation(f"island {d['island']}'s pipelined delta for round {d['round']} trained from "
                                    f"version {b}, whose part differs from version {d['base_version']}'s")

    def check_sent(self, node: Any, a: Out) -> None:
        """A delta leaving for the first time (at once, or held until the previous one settled): it is its adapter
        minus the version it trained from, quantized with exactly the quantization error of this session's merged
        deltas (an oracle that knows, from the syncer's disk, which of them were merged)."""
        h, digest = a.header, digest_bytes(a.frames)
        if (h["round"], h["base_version"], digest) in node.sent:
            return  # sent again
        p = next((q for q in node.core.in_flight() if [q.round, q.base_version, q.digest] == [
            h["round"], h["base_version"], digest]), None)
        if p is None:
            raise Violation(f"island {node.lid} sent a delta for round {h['round']} that it does not hold as pushed")
        x = node.raw.pop((h["round"], h["base_version"]), None)
        if x is None:
            raise Violation(f"island {node.lid} sent a delta for round {h['round']} on version {h['base_version']} "
                            "that it never trained")
        r = np.zeros(self.w.layout.numel, np.float32)
        for key, y, part in node.pushes:
            if key in self.merged:
                ef = ErrorFeedback(self.w.layout.numel)
                ef.residual = r
                ef.encode(y, node.core.policy.sync_bits, fragment_pieces(self.w.layout, part))
                r = ef.residual
        own = np.ones(r.size, dtype=bool)  # (the parts of the other deltas in flight are theirs until they settle)
        for q in [q for q in node.core.in_flight() if q is not p]:
            for start, n in fragment_pieces(self.w.layout, synced_fragments(self.w.layout, q.part)):
                own[start : start + n] = False
        if not np.array_equal(r[own], p.residual_before[own]):
            raise Violation(f"island {node.lid}'s error-feedback residual does not follow what was merged "
                            f"(off by {float(np.abs(r - p.residual_before)[own].max()):.3g})")
        expect = ErrorFeedback(self.w.layout.numel)
        expect.residual = p.residual_before
        part = node.core.part(h["round"])
        part = synced_fragments(self.w.layout, part)
        _, frames, _ = encode_fragments_ef(self.w.layout, x, node.core.policy.sync_bits, expect, part)
        if list(frames) != list(a.frames):
            raise Violation(f"island {node.lid}'s delta for round {h['round']} is not its adapter minus the "
                            f"version {h['base_version']} it trained from (its part {part})")
        node.pushes.append(((node.lid, p.base_version, p.digest), x, part))
        node.sent.add((h["round"], h["base_version"], digest))
