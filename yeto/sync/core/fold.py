"""What a tape commits to: the syncer's events folded, in order, with the invariants they must keep.

`TapeFold` folds the syncer's events, in order, into what they commit to: the
merged versions, the accepted deltas not yet merged (outstanding), the last
durable checkpoint. `audit` runs the fold over a whole tape and returns the
first event that breaks an invariant:

- seq numbers are consecutive (no lost or duplicated line);
- an accepted delta is for the open round, its base at most `max_base_lag` versions back
  (its `lag` on the record), accepted once,
  and ends in exactly one merge, or in an explicit `discard` / `refuse_delta`;
- a merge lists only outstanding deltas of its round, has at least the quorum
  in force, and makes the next version (none merged twice);
- a `rollback` undoes only the newest merge, and never a durable checkpoint;
- every `resume` is at the last merge not rolled back, with the same digest,
  and not behind the last durable checkpoint;
- a complete `finish` has run every outer step and left no delta outstanding.

The syncer's recovery (`yeto.sync.core.recovery`) uses the same fold to reconcile the
tape with the disk, so the audit and the recovery agree on what a tape means.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

from yeto.sync.core.quorum import quorum_after_give_ups
from yeto.sync.merge.aggregate import NORM_HISTORY, clip_factors, clip_reference
from yeto.sync.merge.rules import (MAX_CLAIM_OVER_MEDIAN, MERGE_WEIGHTS, DeltaCounts, Tier, capped_claims,
                                   counts_toward_quorum, merge_terms, weight_of)

CLIP_SLACK = 1e-6  # float rounding allowed over the clip's bound
RECOMPUTE_RTOL = 1e-9  # a recomputed number agrees with the record's to this (the same expression: the same bits)

Key = tuple[int, int]  # (round, island)


class AuditViolation(Exception):
    def __init__(self, seq: Any, what: str):
        super().__init__(f"seq {seq}: {what}")
        self.seq = seq
        self.what = what


@dataclass
class TapeFold:
    """The committed meaning of a tape prefix. `feed(e)` raises AuditViolation on the first broken invariant
    when `strict`; otherwise it folds what it can (recovery reads tapes the audit would reject)."""

    strict: bool = False
    next_seq: int = 0
    version: int = -1  # -1: no initial adapter yet
    digests: dict[int, str] = field(default_factory=dict)  # committed version -> global digest
    merged: dict[int, dict[str, Any]] = field(default_factory=dict)  # committed version -> merge event
    merged_deltas: dict[int, list[dict[str, Any]]] = field(default_factory=dict)
    checkpointed: int = -1
    outstanding: dict[Key, dict[str, Any]] = field(default_factory=dict)
    settled: set[tuple[int, int, str]] = field(default_factory=set)  # (round, island, digest) merged or refused
    discarded: set[tuple[int, int, str]] = field(default_factory=set)
    joined: set[int] = field(default_factory=set)  # every island id that ever joined the run
    quorum: int = 1
    config_quorum: int = 1
    islands: int = 1
    given_up: set = field(default_factory=set)  # island ids given up since the last start
    outer_steps: int = 0
    max_base_lag: int = 0  # a delta may be accepted this many versions after its base
    robust_k: float = 0.0  # --robust-k under norm-clip (0: no clip bound to check)
    staleness_exponent: float = 0.0
    by_part: dict[Any, list[int]] = field(default_factory=dict)  # streamed part (None: whole) -> versions merged
    counts: dict[str, int] = field(default_factory=dict)

    def resolved(self, rnd: int, island: int, digest: str) -> bool:
        key = (rnd, island, digest)
        return key in self.settled or key in self.discarded

    def _fail(self, e: dict[str, Any], what: str) -> None:
        if self.strict:
            raise AuditViolation(e.get("seq"), what)

    def feed(self, e: dict[str, Any]) -> None:
        kind = e.get("event")
        self.counts[kind] = self.counts.get(kind, 0) + 1
        if e.get("seq") != self.next_seq:
            self._fail(e, f"expected seq {self.next_seq}, found {e.get('seq')} (a tape line is missing or repeated)")
        self.next_seq = (e.get("seq") if isinstance(e.get("seq"), int) else self.next_seq) + 1
        handler = self._handlers().get(kind)
        if handler is not None:  # (the other events commit to nothing the fold keeps: logs, waits, errors)
            handler(e)

    def _handlers(self) -> dict[str, Callable[[dict[str, Any]], None]]:
        """Each tape event the fold reads, and the handler it goes to."""
        return {"start": self._on_start, "given_up": self._on_given_up, "given_up_cleared": self._on_given_up_cleared,
                "join": self._on_join, "init": self._on_init,
                "delta": self._on_delta, "refuse_delta": self._on_refuse_delta, "discard": self._on_discard,
                "merge": self._on_merge, "checkpoint": self._on_checkpoint, "rollback": self._on_rollback,
                "resume": self._on_resume, "finish": self._on_finish}

    def _on_start(self, e: dict[str, Any]) -> None:
        cfg = e.get("config") or {}
        self.quorum = self.config_quorum = int(cfg.get("quorum", self.quorum))
        self.islands = int(cfg.get("islands", self.islands))
        self.given_up = set()  # a restarted syncer applies its given-up folder again
        self.outer_steps = int(cfg.get("outer_steps", self.outer_steps))
        self.max_base_lag = int(cfg.get("max_base_lag", 0))
        self.robust_k = float(cfg.get("robust_k", 0.0)) if cfg.get("robust") == "norm-clip" else 0.0
        self.staleness_exponent = float(cfg.get("staleness_exponent", 0.0))

    def _on_given_up(self, e: dict[str, Any]) -> None:
        """The fleet controller gave an island up: the quorum shrinks, by the rule, not by the record's word."""
        self.given_up.add(e.get("island"))
        self._requorum(e)

    def _on_given_up_cleared(self, e: dict[str, Any]) -> None:
        """A given-up island is back: the quorum grows again, by the same rule."""
        self.given_up.discard(e.get("island"))
        self._requorum(e)

    def _requorum(self, e: dict[str, Any]) -> None:
        expected = quorum_after_give_ups(self.config_quorum, self.islands, len(self.given_up))
        if e.get("quorum") != expected:
            self._fail(e, f"{e.get('event')} of island {e.get('island')} sets quorum {e.get('quorum')}, the rule "
                          f"gives {expected} (--quorum {self.config_quorum}, --islands {self.islands}, "
                          f"{len(self.given_up)} given up)")
        self.quorum = expected

    def _on_join(self, e: dict[str, Any]) -> None:
        if isinstance(e.get("island"), int):
            self.joined.add(e["island"])

    def _on_init(self, e: dict[str, Any]) -> None:
        if self.version != -1:
            self._fail(e, f"a second initial adapter while version {self.version} is committed")
        self.version = 0
        self.digests[0] = e["digest"]

    def _on_delta(self, e: dict[str, Any]) -> None:
        key = (e["round"], e["island"])
        lag = self.version - e["base_version"]
        if self.version < 0 or not 0 <= lag <= self.max_base_lag or e["round"] != self.version + 1 or e.get(
                "lag", 0) != lag:
            self._fail(e, f"delta of island {e['island']} accepted for round {e['round']} on version "
                          f"{e['base_version']} while version {self.version} was committed")
        if key in self.outstanding:
            self._fail(e, f"delta of island {e['island']} for round {e['round']} accepted twice without being "
                          "merged or discarded in between")
        self.outstanding[key] = e

    def _settle(self, e: dict[str, Any], what: str) -> None:
        key = (e["round"], e["island"])
        have = self.outstanding.get(key)
        if have is None or have["digest"] != e["digest"]:
            self._fail(e, f"{what} of island {e['island']}'s delta {e['digest']} for round {e['round']}, "
                          "which is not an outstanding accepted delta")
            return
        del self.outstanding[key]
        self.settled.add((e["round"], e["island"], e["digest"]))

    def _on_refuse_delta(self, e: dict[str, Any]) -> None:
        self._settle(e, "refusal")

    def _on_discard(self, e: dict[str, Any]) -> None:
        self._settle(e, "discard")
        key = (e["round"], e["island"], e["digest"])
        if key in self.settled:
            self.settled.discard(key)
            self.discarded.add(key)

    def _on_merge(self, e: dict[str, Any]) -> None:
        v, rnd, responders, digests = e["version"], e["round"], e["responders"], e["deltas"]
        if v != self.version + 1 or rnd != v:
            self._fail(e, f"merge of round {rnd} into version {v} after version {self.version}: versions must be "
                          "consecutive, none merged twice")
        if len(responders) != len(digests) or len(set(responders)) != len(responders):
            self._fail(e, f"merge of round {rnd} lists responders {responders} and {len(digests)} delta digests")
        used = []
        for lid, dg in zip(responders, digests):
            have = self.outstanding.get((rnd, lid))
            if have is None or have["digest"] != dg:
                self._fail(e, f"merge of round {rnd} uses island {lid}'s delta {dg}, which is not an outstanding "
                              "accepted delta (lost, merged before, or never accepted)")
                continue
            used.append(self.outstanding.pop((rnd, lid)))
            self.settled.add((rnd, lid, dg))
        counting = sum(1 for d in used if counts_toward_quorum(d.get("tier", Tier.BOUNDED)))
        if len(used) == len(responders) and counting < self.quorum:
            self._fail(e, f"merge of round {rnd} with {counting} responder(s) that count toward quorum (extra ids do "
                          f"not), below the quorum {self.quorum}")
        if len(used) == len(responders):
            self._check_bounds(e, used)
        self.version = v
        self.digests[v] = e["digest"]
        self.merged[v] = e
        self.by_part.setdefault(_part_of(e), []).append(v)
        self.merged_deltas[v] = used

    def _check_bounds(self, e: dict[str, Any], used: list[dict[str, Any]]) -> None:
        """No island's claim bought more weight than the rule allows, and no merged delta was longer than the clip's
        bound (yeto.sync.merge.rules, yeto.sync.merge.aggregate): checked from the tape's own numbers."""
        counted, how = e.get("counted"), e.get("merge_weight", "loss-tokens")
        if counted is not None and how in MERGE_WEIGHTS:
            claims = [weight_of(DeltaCounts(d["loss_tokens"], d["tokens"], d["inner_steps"]), how) for d in used]
            tiers = [d.get("tier", Tier.BOUNDED) for d in used]  # (as each delta came: a tape before tiers, bounded)
            if e.get("tiers", tiers) != tiers:
                self._fail(e, f"merge of round {e['round']} says its deltas' tiers are {e['tiers']}; they came as "
                              f"{tiers}")
            elif len(counted) != len(claims) or counted != capped_claims(claims, tiers):
                self._fail(e, f"merge of round {e['round']} counts claims {counted}; the bound gives "
                              f"{capped_claims(claims, tiers)} (a trusted claim as claimed, any other at most "
                              f"{MAX_CLAIM_OVER_MEDIAN:g} x the low median)")
        ref, norms = e.get("clip_ref"), e.get("merged_norms")
        if self.robust_k and ref is not None and norms is not None:
            bound = self.robust_k * ref * (1 + CLIP_SLACK)
            over = [i for i, n in zip(e["responders"], norms) if n > bound]
            if over:
                self._fail(e, f"merge of round {e['round']} merged island(s) {over} above the clip bound "
                              f"{self.robust_k:g} x {ref:.4g}")
            elif how in MERGE_WEIGHTS and all("norm" in d for d in used) and "lags" in e:
                self._recompute_clip(e, used, how)

    def _recompute_clip(self, e: dict[str, Any], used: list[dict[str, Any]], how: str) -> None:
        """The clip and the weights recomputed from the deltas' norms and claims as received and the merged norms
        before (the tape's own history, as a restarted syncer rebuilds it): a merge's word on its reference, its
        scales and its weights is checked, not taken."""
        tiers = [d.get("tier", Tier.BOUNDED) for d in used]
        terms = merge_terms([DeltaCounts(d["loss_tokens"], d["tokens"], d["inner_steps"]) for d in used], how,
                            e["lags"], self.staleness_exponent, bool(e.get("step_normalize")),
                            [d.get("round_steps", 0) for d in used], tiers)
        norms = terms.judged_norms([d["norm"] for d in used])
        ref = clip_reference(norms, self._norm_history(_part_of(e)), tiers)
        merged = [n * c for n, c in zip(norms, clip_factors(norms, ref, self.robust_k))]
        weights = [w / sum(terms.counted) * s * terms.length for w, s in zip(terms.counted, terms.scales)]
        rnd = e["round"]
        if not _agrees([e["clip_ref"]], [ref]):
            self._fail(e, f"merge of round {rnd} states clip_ref {e['clip_ref']:.6g}; the tape's norms give {ref:.6g}")
        elif not _agrees(e["merged_norms"], merged):
            self._fail(e, f"merge of round {rnd} states merged norms {e['merged_norms']}; clipped at {ref:.6g} the "
                          f"tape's norms give {merged}")
        elif not _agrees(e.get("weights", weights), weights):
            self._fail(e, f"merge of round {rnd} states weights {e['weights']}; the capped claims and step scales "
                          f"give {weights}")

    def _norm_history(self, part: Any) -> list[tuple[float, str]]:
        """The last NORM_HISTORY merged norms of this part (with their tiers), newest merges walked first."""
        history: list[tuple[float, str]] = []
        for v in reversed(self.by_part.get(part, [])):
            m = self.merged[v]
            norms = m.get("merged_norms") or []
            history[:0] = zip(norms, m.get("tiers") or [Tier.BOUNDED] * len(norms))
            if len(history) >= NORM_HISTORY:
                return history[-NORM_HISTORY:]
        return history

    def _on_checkpoint(self, e: dict[str, Any]) -> None:
        if e["version"] != self.version or e.get("digest", self.digests.get(self.version)) != self.digests.get(
                self.version):
            self._fail(e, f"checkpoint of version {e['version']} while version {self.version} is committed")
        self.checkpointed = max(self.checkpointed, e["version"])

    def rollback(self, v: int) -> None:
        """Undo the newest merge (or, for version 0, the initial adapter); its deltas are outstanding again."""
        if v == 0:
            self.version = -1
            self.digests.pop(0, None)
            return
        m = self.merged.pop(v, None)
        if m is not None:
            self.by_part[_part_of(m)].remove(v)
        self.digests.pop(v, None)
        for d in self.merged_deltas.pop(v, []):
            self.settled.discard((d["round"], d["island"], d["digest"]))
            self.outstanding[(d["round"], d["island"])] = d
        self.version = v - 1

    def _on_rollback(self, e: dict[str, Any]) -> None:
        v = e["version"]
        if v != self.version:
            self._fail(e, f"rollback of version {v} while the newest committed version is {self.version}")
        if v <= self.checkpointed:
            self._fail(e, f"rollback of version {v}, whose checkpoint was durable (checkpoint event for "
                          f"{self.checkpointed}): a durable merge was lost")
        self.rollback(v)

    def _on_resume(self, e: dict[str, Any]) -> None:
        v = e["version"]
        if v != self.version or e.get("digest") != self.digests.get(v):
            self._fail(e, f"restart resumed at version {v} ({e.get('digest')}) but the tape's last merge is version "
                          f"{self.version} ({self.digests.get(self.version)})")
        if v < self.checkpointed:
            self._fail(e, f"restart resumed at version {v}, behind the durable checkpoint of version "
                          f"{self.checkpointed}")
        self.checkpointed = v

    def _on_finish(self, e: dict[str, Any]) -> None:
        if not e.get("complete"):
            return
        if self.version < self.outer_steps:
            self._fail(e, f"finish marked complete at version {self.version} of {self.outer_steps} outer steps")
        if self.outstanding:
            self._fail(e, f"finish marked complete with accepted deltas never merged: "
                          f"{sorted(self.outstanding)} (round, island)")


def _part_of(merge: dict[str, Any]) -> Any:
    return tuple(merge["part"]) if merge.get("part") is not None else None


def _agrees(stated: list[Any], computed: list[float]) -> bool:
    return len(stated) == len(computed) and all(
        isinstance(a, (int, float)) and abs(a - b) <= RECOMPUTE_RTOL * max(abs(a), abs(b), 1e-300)
        for a, b in zip(stated, computed))
