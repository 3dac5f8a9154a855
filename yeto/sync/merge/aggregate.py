"""How a round's deltas become one: a running token-weighted sum, and robust merges against one bad island.

The mean (`--robust off`): mean = sum_i t_i * d_i / sum_i t_i, with t_i the
delta's weight (`--merge-weight`, `yeto.sync.merge.rules`: its loss-bearing tokens by
default). `RoundSum` adds each delta as it arrives, so the syncer holds one fp32
vector per round, not one per island; the deltas themselves stay in their wire
encoding (4 bits: 1/8 of fp32) for the durable copy and for the rare rebuild.

Norm clipping (`--robust norm-clip`, the default): with n_i = |s_i d_i| (the
delta as it is merged: staleness and step normalization applied; where the
merge does not normalize, a shorter delta at no less than its step gain,
`yeto.sync.merge.rules.MergeTerms.judged`) and
ref = median_low(this round's norms and the last `NORM_HISTORY` merged norms,
after their clips), a delta with n_i > k * ref is scaled by c_i = k * ref / n_i
before it is weighted. The low median (of a pair, the smaller) is what makes it
hold for any fleet size: a two-island round's plain median is the mean of an
honest and a hostile norm, which never clips. With at most half the norms
hostile, ref is at most an honest norm, so one island moves the global by at
most its weight x k x ref per round. The reference is taken over the trusted
islands' norms where there are any (yeto.sync.merge.rules.Tier: a join-key
holder can then neither raise nor lower it), else over the bounded ones' (an
extra id's only where there is nothing else), and never over a zero norm (a
delta that moves nothing is no step's length: one would clip every other delta
to nothing, and, kept in the history, go on doing so). Applied as a correction
on the running sum: sum <- sum - (1 - c_i) * t_i * d_i.

Trimmed mean (`--robust trimmed-mean`): per coordinate, drop the
floor(`TRIM_FRACTION` * n) (at least one) largest and smallest values and take
the token-weighted mean of the rest; it needs every delta at once, so it walks
the adapter fragment by fragment (memory: n fragments, not n adapters). With
fewer than three deltas there is nothing to trim and it is the mean.

The rule (`--merge`, yeto.sync.merge.rules.RULES) streams too: `RoundSum`
carries what the rule keeps beyond the sum (RDA: its per-tensor radial sums and
running sum of unit directions, a clip correcting the radial sum from the
delta's stored tensor norms, no decode; the mean: nothing).

Every result is a pure function of the deltas in their accumulation order (the
tape's `responders`), so the merge replays bit for bit.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

import numpy as np

from yeto.sync.wire.layout import Layout
from yeto.sync.merge.rules import MeanSums, RuleSums, Tier, low_median, merge_rule
from yeto.sync.wire.spans import over_spans

ROBUST_MODES = ("norm-clip", "trimmed-mean", "off")
DEFAULT_CLIP_K = 4.0  # --robust-k: room for honest norms to differ; one island moves the global by at most k x ref
NORM_HISTORY = 32  # past merged norms in the reference: a round of two or three deltas is not judged on them alone
TRIM_FRACTION = 0.2  # dropped at each end per coordinate: a fifth of the deltas may be extreme and not count
ACCUMULATE_CHUNK = 1 << 16  # values per step of the running sum (256 KiB: stays in cache)
ACCUMULATE_SPAN = 1 << 19  # values at least per thread


def accumulate(total: Optional[np.ndarray], delta: np.ndarray, scale: float, fused: bool = False) -> np.ndarray:
    """total += scale * delta, in place, in cache-sized chunks (one pass over memory, no full-size temporary).

    `fused` rounds once, as a fused multiply-add (the product is exact in float64): for a correction that cancels
    most of an earlier term (a clip), where a rounded product's error would be large against what remains."""
    d = np.ascontiguousarray(delta, dtype=np.float32).reshape(-1)
    if total is None:
        total = np.zeros(d.size, dtype=np.float32)
    alpha = np.float64(np.float32(scale)) if fused else np.float32(scale)

    def add_span(first: int, end: int) -> None:
        scratch = np.empty(min(ACCUMULATE_CHUNK, end - first), dtype=alpha.dtype)
        with np.errstate(over="ignore"):  # a huge delta overflows to inf: the merge refuses a non-finite result
            add_chunks(first, end, scratch)

    def add_chunks(first: int, end: int, scratch: np.ndarray) -> None:
        for a in range(first, end, ACCUMULATE_CHUNK):
            part, into = scratch[: min(ACCUMULATE_CHUNK, end - a)], total[a : min(a + ACCUMULATE_CHUNK, end)]
            np.multiply(d[a : a + part.size], alpha, out=part)
            if fused:
                part += into
                into[...] = part
            else:
                np.add(into, part, out=into)

    over_spans(d.size, add_span, ACCUMULATE_SPAN)
    return total


def effective_weight(weight: float, scale: float) -> float:
    """What a delta's values are multiplied by in the sum (one expression, so sums replay bit for bit)."""
    return float(weight) * float(scale)


@dataclass
class RoundSum:
    """sum_i t_i * d_i over the deltas added so far, in arrival order (and what the rule keeps beside it)."""

    numel: int
    total: Optional[np.ndarray] = None
    weight: float = 0.0
    order: list[int] = field(default_factory=list)  # island ids, as added
    rule_sums: RuleSums = field(default_factory=MeanSums)  # `--merge`'s own sums (RDA: the radial and direction sums)

    @classmethod
    def for_rule(cls, layout: Layout, rule: str) -> "RoundSum":
        """An empty sum for `--merge rule`."""
        return cls(layout.numel, rule_sums=merge_rule(rule).sums(layout))

    def add(self, island: int, delta: np.ndarray, weight: float, scale: float = 1.0) -> None:
        """Add weight x scale x delta; the mean divides by the weights alone (a stale delta's scale < 1 shrinks
        the step)."""
        self.total = accumulate(self.total, delta, effective_weight(weight, scale))
        self.weight += weight
        self.order.append(island)
        self.rule_sums.add(island, delta, weight, scale)

    def copy(self) -> "RoundSum":
        """A copy a merge may correct (clips) while the round's own sum stays as the deltas arrived."""
        return RoundSum(self.numel, None if self.total is None else self.total.copy(), self.weight, list(self.order),
                        self.rule_sums)  # (shared: a rule's merge leaves its sums as they are)

    def mean(self) -> np.ndarray:
        if self.total is None or self.weight <= 0:
            raise ValueError("a merge needs at least one delta of positive weight")
        return self.total / np.float32(self.weight)


def clip_reference(norms: Sequence[float], history: Sequence[tuple[float, str]],
                   tiers: Optional[Sequence[str]] = None) -> float:
    """ref = median_low of this round's norms and the history's ((norm, tier) pairs), over the most trusted tier
    present, zero norms left out: what a delta's norm is judged against (0.0: nothing to judge by)."""
    pool = [*zip(norms, tiers if tiers is not None else [Tier.BOUNDED] * len(norms)), *history]
    pool = [(n, Tier(t)) for n, t in pool if n > 0 and math.isfinite(n)]
    for admitted in ({Tier.TRUSTED}, {Tier.BOUNDED}, set(Tier)):
        chosen = [n for n, t in pool if t in admitted]
        if chosen:
            return low_median(chosen)
    return 0.0


def clip_factors(norms: Sequence[float], ref: float, k: float) -> list[float]:
    """c_i = min(1, k * ref / n_i) (1 for a zero norm), ref from `clip_reference`."""
    return [1.0 if n <= k * ref or n == 0 else k * ref / n for n in norms]


def clipped_merge(s: RoundSum, factors: dict[int, float], weights: dict[int, float],
                  delta_of: Callable[[int], np.ndarray]) -> tuple[np.ndarray, dict[str, Any]]:
    """The running sum's merge by its rule, and the fields the rule adds to the merge record (RDA: its count of
    tensors that fell back to the mean), after scaling the listed islands' deltas by their factors (< 1); `weights`
    are the effective ones, t_i s_i."""
    shrink = {}
    for lid in s.order:
        c = factors.get(lid, 1.0)
        if c < 1.0:
            shrink[lid] = (1.0 - c) * weights[lid]  # what the clip takes off this delta's weight
            s.total = accumulate(s.total, delta_of(lid), -shrink[lid], fused=True)
    return s.rule_sums.merge(s.mean(), s.weight, shrink)


def trimmed_mean(block: Callable[[int], np.ndarray], weights: Sequence[float], layout: Layout) -> np.ndarray:
    """Coordinate-wise weighted trimmed mean; `block(k)` gives the (deltas, numel) values of fragment k."""
    w = np.asarray(weights, dtype=np.float64)
    count = len(w)
    cut = max(1, int(TRIM_FRACTION * count)) if count >= 3 else 0
    out = np.empty(layout.numel, dtype=np.float32)
    for k, f in enumerate(layout.fragments):
        x = block(k).astype(np.float64)
        if cut == 0:
            out[f.start:f.start + f.numel] = (w @ x) / w.sum()
            continue
        order = np.argsort(x, axis=0, kind="stable")
        xs = np.take_along_axis(x, order, axis=0)[cut:count - cut]
        ws = w[order][cut:count - cut]
        out[f.start:f.start + f.numel] = (ws * xs).sum(axis=0) / ws.sum(axis=0)
    return out
