"""Merge rules: how a round's deltas d_i (flat fp32, one per responder) become the one the outer step takes.

Weights (`--merge-weight`), w_i >= 0 normalised to sum 1:
    loss-tokens   w_i ~ the delta's loss-bearing tokens (the default: a token of signal counts once, wherever it
                  was trained)
    tokens        w_i ~ all tokens the island read (prompts included)
    steps         w_i ~ the island's inner steps this round
    equal         w_i = 1/n
A slow island already sends a smaller delta (fewer steps, fewer tokens behind it): token weights account for that
once, and the delta's own size a second time; `equal` counts every island once whatever it did.

Rules (`--merge`, the table `RULES`: each entry a `MergeRule`, all a rule is: its sums, its merge, what it reports
on the tape, its check of the other flags, its help line):
    rda    (the default) radial-directional averaging, per tensor t:
               (sum_i w_i |d_i,t|) * v / |v|,   v = sum_i w_i d_i,t / |d_i,t|
           The mean of near-orthogonal deltas shrinks as 1/sqrt(n); RDA keeps the typical delta's length and takes the
           mean direction. When the directions cancel (|v| < RDA_CANCEL * sum_i w_i) it falls back to the mean.
           Both sums are additive, so the syncer streams them (`Directions`): two vectors per round, not n deltas.
           In every fixed-step pairing measured it ends closer to data-parallel training than the mean (see
           docs/benchmarks.md, Convergence: N islands vs data-parallel).
    mean   sum_i w_i d_i (the rule under `--lora-merge product` and `--robust trimmed-mean`, which are means)

LoRA aggregation (`--lora-merge`):
    factors   the rule applies to lora_A and lora_B separately (B_bar A_bar is not the mean of the B_i A_i: the error
              is sum_i w_i (B_i - B_bar)(A_i - A_bar))
    product   per adapted layer, the merged update W = sum_i w_i B_i A_i (each island's adapter = the global it
              started from + its delta; peft's scale alpha/r is common to every island, so it factors out), written
              back as rank-r factors (B*, A*) by alternating least squares started from the factor means: exact
              when rank W <= r, the best rank-r fit otherwise (the relative residual |W - B*A*| / |W| is reported).
              Starting from the factor means keeps the factors near the islands' (an island-wide agreement merges to
              itself), so the outer step on (B* - B, A* - A) still reads as a step; with outer lr 1 and no momentum
              the new global's product is W itself.
              The ALS works on W in factored form (n*r columns), never on the out x in matrix.

Step normalization (`--step-normalize`, FedNova-style): each delta is scaled by k_max / k_i (k_i its inner steps,
k_max the round's length: the most steps a delta took in the round's window, its steps carried in from an earlier
window left out, so a delta carried over two windows is not taken for a round twice as long) before the rule. The
weighted mean of deltas of unequal length is shorter than the longest one: a 10x slower island in a time-window
round (a tenth of the steps, so a tenth of the weight and a delta a tenth as long) cuts the fast island's step by
~8%. Normalized, each delta is an estimate of the same k_max-step move, and the slow island's tokens reduce its noise
instead. With equal steps it is the plain rule. The default in time-window rounds, with the mean (docs/benchmarks.md,
heterogeneous fleet); not with rda, whose norm rule would take a short delta's scaled-up noise for length.

Trust tiers (`Tier`): the counts behind the weights and the step counts behind step normalization are the islands'
own claims. An island on a key the operator issued for it (an island key: every island `yeto launch` starts has one;
or a loopback --insecure run) is TRUSTED: its claims count as claimed, so a fast island weighs by its tokens and a
10x slower one by its tenth. An island on the shared join key is BOUNDED: its claimed weight is cut to the round's low
median claim (C = MAX_CLAIM_OVER_MEDIAN = 1: t_i' = min(t_i, median_low(t))), so it weighs by its count but never
more than the round's median delta (a short delta keeps its small weight, a long claim counts as the median: one
island among n weighs at most 1/n where the others' claims are alike). An id on the join key beyond --islands is
EXTRA: bounded, its claims left out of the median that bounds the others, and all extra ids of a merge together
weigh at most one median claim. A round's length k_max is the longest window steps claimed, a trusted claim as
claimed, any other cut to MAX_UNTRUSTED_STEP_GAIN (2) times the longest of the others' claims: the trusted ones and
the bounded ones but the longest (one key holder's, whoever holds it), never an extra id's. So one join-key holder's
step claim scales the honest deltas at most 2x further than they would go without it, whatever it claims. A real fast
island on the join key beside a 10x slower one looks the same: its delta keeps its own length (no delta is scaled
down to a round shorter than its claim) and the slow one's is scaled up 2x, not 10x: that is what the shared key
gives up (docs/SECURITY.md). No delta is scaled up by more than MAX_STEP_SCALE. The norm clip
(yeto.sync.merge.aggregate) then judges every delta, trusted or not, as it is merged.

Staleness (`--staleness-exponent a`): a delta accepted `lag` versions after its base is scaled by s = (1 + lag)^-a
before any rule sees it (FedAsync's polynomial rule; a = 0: no discount). The weights stay normalised by the counts
alone, so the discount shrinks the step even when the stale delta merges by itself: w_i s_i sums to less than 1.

Every function is pure: the same deltas in the same order give the same bits.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, Callable, Optional, Protocol, Sequence

import numpy as np

from yeto.sync.wire.layout import Layout

MERGE_WEIGHTS = ("loss-tokens", "tokens", "steps", "equal")
LORA_MERGES = ("factors", "product")
RDA_CANCEL = 1e-3  # |sum of weighted unit directions| below this (of the weights' sum): directions cancel, use the mean
RDA_FALLBACKS = "rda_fallbacks"  # the merge record's field: how many tensors RDA left at the mean
ALS_MAX_ITERATIONS = 50  # bounds a product merge's cost where ALS_TOLERANCE is not reached
ALS_TOLERANCE = 1e-9  # stop once the residual improves by less than this (relative to |W|^2)
RIDGE = 1e-12  # keeps the normal equations of a rank-deficient factor solvable
MAX_CLAIM_OVER_MEDIAN = 1.0  # no delta's weight claim counts for more than this x the round's low median claim
MAX_STEP_SCALE = 16.0  # step normalization scales no delta up by more than this
MAX_UNTRUSTED_STEP_GAIN = 2.0  # a claim not on an island key makes a round at most this x the others' longest claim


class Tier(StrEnum):
    """How far an island's claims are believed: fixed at its join by the key its connection proved."""

    TRUSTED = "trusted"  # an island key the operator issued (or --insecure on loopback): claims count as claimed
    BOUNDED = "bounded"  # the shared join key, an id the run expects: claims cut to the round's low median
    EXTRA = "extra"  # the shared join key, an id beyond --islands: bounded, and together worth one median claim


def counts_toward_quorum(tier: str) -> bool:
    """An extra id merges but never makes a quorum: ids are free to a join-key holder, so a round it could close
    by answering fast would be the holder's alone."""
    return tier != Tier.EXTRA


@dataclass(frozen=True)
class DeltaCounts:
    """What a delta says about the work behind it (the fields weights can follow)."""

    loss_tokens: int
    tokens: int
    inner_steps: int


def low_median(values: Sequence[float]) -> float:
    """The lower middle value (of a pair, the smaller): one outlier among two cannot move it."""
    ordered = sorted(values)
    return float(ordered[(len(ordered) - 1) // 2]) if ordered else 0.0


def _tiers_of(tiers: Optional[Sequence[str]], n: int) -> list[Tier]:
    """Each delta's tier (none given: every one bounded, as a tape from before the tiers reads)."""
    return [Tier.BOUNDED] * n if tiers is None else [Tier(t) for t in tiers]


def _judging(values: Sequence[float], tiers: Sequence[Tier]) -> list[float]:
    """The values a median that bounds others is taken over: not an extra id's (unless there is nothing else)."""
    return [v for v, t in zip(values, tiers) if t is not Tier.EXTRA] or list(values)


def _step_claims(window_steps: Sequence[int], inner_steps: Sequence[int]) -> list[int]:
    """Each delta's claim on the round's length: its steps in the round's window (its inner steps less those carried
    in), or, in a round whose every delta was carried in whole, its inner steps."""
    return list(window_steps) if any(s > 0 for s in window_steps) else list(inner_steps)


def _step_cap(claims: Sequence[int], tiers: Sequence[Tier]) -> float:
    """How long a claim not on an island key may make the round: MAX_UNTRUSTED_STEP_GAIN x the longest of the other
    claims that can bound it (the trusted ones, and the bounded ones but the longest: one key holder's claim is
    never judged by itself; an extra id's never bounds anyone)."""
    trusted = [s for s, t in zip(claims, tiers) if s > 0 and t is Tier.TRUSTED]
    bounded = sorted(s for s, t in zip(claims, tiers) if s > 0 and t is Tier.BOUNDED)
    others = trusted + bounded[:-1] or bounded or [s for s in claims if s > 0] or [1]
    return MAX_UNTRUSTED_STEP_GAIN * max(others)


def round_length(window_steps: Sequence[int], inner_steps: Sequence[int],
                 tiers: Optional[Sequence[str]] = None) -> int:
    """k_max of step normalization: the longest claim on the round's length (`_step_claims`), a trusted claim as
    claimed, any other cut to `_step_cap`."""
    return _length_of(_step_claims(window_steps, inner_steps), _tiers_of(tiers, len(inner_steps)))


def _length_of(claims: Sequence[int], tiers: Sequence[Tier]) -> int:
    cap = _step_cap(claims, tiers)
    return max(1, int(max((s if t is Tier.TRUSTED else min(s, cap) for s, t in zip(claims, tiers)), default=1)))


def capped_claims(claims: Sequence[float], tiers: Optional[Sequence[str]] = None) -> list[float]:
    """The weights a round's claims may buy: a trusted claim as claimed; any other t_i' = min(t_i, C median_low(t))
    (C = MAX_CLAIM_OVER_MEDIAN, the median over the claims of trusted and bounded islands), and the extra ids'
    together scaled down to one such cap at most."""
    tier = _tiers_of(tiers, len(claims))
    cap = MAX_CLAIM_OVER_MEDIAN * low_median(_judging(claims, tier))
    counted = [float(t) if k is Tier.TRUSTED else min(float(t), cap) for t, k in zip(claims, tier)]
    extra = math.fsum(c for c, k in zip(counted, tier) if k is Tier.EXTRA)  # (exact: the same in any order)
    if extra > cap:
        counted = [c * (cap / extra) if k is Tier.EXTRA else c for c, k in zip(counted, tier)]
    return counted


@dataclass(frozen=True)
class MergeTerms:
    """What each delta of a merge counts for, by responder position: the merged update is
    length x rule(scales_i x d_i, weights counted_i)."""

    counted: list[float]  # unnormalised weights: the claims, capped (`capped_claims`)
    scales: list[float]  # staleness discount x step normalization's share (1/k_i of the round's length)
    length: float  # the round's length (1 without step normalization)
    # each delta's scale as the norm clip judges it (its judged norm: norm x judged x length): its own scale, but a
    # short delta at no less than its linear step gain where the merge does not normalize, so that a 1-step delta's
    # norm never becomes the reference that clips a 12-step one (docs/benchmarks.md, the pair in lockstep)
    judged: list[float]

    def judged_norms(self, norms: Sequence[float]) -> list[float]:
        """The deltas' norms (as received) as the clip judges them: the syncer's merge and the audit's recomputation
        take them from here, so the two cannot judge differently."""
        return [n * j * self.length for n, j in zip(norms, self.judged)]


def merge_terms(counts: Sequence[DeltaCounts], how: str, lags: Sequence[int], staleness_exponent: float,
                normalize: bool, window_steps: Sequence[int], tiers: Optional[Sequence[str]] = None) -> MergeTerms:
    """The bounded weights and scales of one merge (the syncer's and every replay's: one expression, same bits)."""
    counted = capped_claims([weight_of(c, how) for c in counts], tiers)
    stale = [staleness_factor(lag, staleness_exponent) for lag in lags]
    inner = [c.inner_steps for c in counts]
    claims = _step_claims(window_steps, inner)
    length = _length_of(claims, _tiers_of(tiers, len(inner)))
    # a delta is an estimate of a `length`-step move, scaled up by at most MAX_STEP_SCALE; one whose own claim is
    # longer than the round (a capped claim) is taken at its own length, never scaled down to the round's
    gains = [min(max(length, c) / max(1, k), MAX_STEP_SCALE) for c, k in zip(claims, inner)]
    if not normalize:
        return MergeTerms(counted, stale, 1.0, [s * g if g > 1 else s for s, g in zip(stale, gains)])
    scales = [s * g / length for s, g in zip(stale, gains)]
    return MergeTerms(counted, scales, float(length), scales)


def staleness_factor(lag: int, exponent: float) -> float:
    """(1 + lag)^-exponent: a delta computed against an older global weighs less (FedAsync's polynomial rule)."""
    return 1.0 if lag <= 0 or exponent == 0 else float((1.0 + lag) ** -exponent)


def weight_of(c: DeltaCounts, how: str) -> float:
    """One delta's unnormalised weight (for running sums): its `--merge-weight` count."""
    if how not in MERGE_WEIGHTS:
        raise ValueError(f"unknown merge weight {how!r}")
    return float({"loss-tokens": c.loss_tokens, "tokens": c.tokens, "steps": c.inner_steps, "equal": 1}[how])


def merge_weights(counts: Sequence[DeltaCounts], how: str = "loss-tokens") -> np.ndarray:
    """w_i per `--merge-weight` (sum 1)."""
    t = np.asarray([weight_of(c, how) for c in counts], dtype=np.float64)
    if t.size == 0 or (t < 0).any() or t.sum() <= 0:
        raise ValueError(f"a merge needs positive {how} counts, got {[float(x) for x in t]}")
    return t / t.sum()


@dataclass
class Directions:
    """RDA's running sums, so the syncer adds each delta as it arrives and holds two vectors per round, not n deltas.

    Per tensor k: radial[k] = sum_i t_i s_i |d_i,k| and units[k] = sum_i t_i d_i,k / |d_i,k| (t_i the unnormalised
    weight, s_i the delta's scale: a scale changes its length, never its direction). The tensors' norms of every delta
    are kept (a few floats each), so a clip after the fact corrects the radial sum without decoding the delta again.
    """

    slices: list[slice]
    units: Optional[np.ndarray] = None  # float32, flat (one more adapter-sized vector per round)
    radial: Optional[np.ndarray] = None  # float64, one per tensor
    norms: dict[int, np.ndarray] = field(default_factory=dict)  # per island: its tensors' norms (unscaled)

    @classmethod
    def of(cls, layout: Layout) -> "Directions":
        return cls(list(layout.tensor_slices().values()))

    def add(self, island: int, delta: np.ndarray, weight: float, scale: float = 1.0) -> None:
        x = np.asarray(delta).reshape(-1)
        if self.units is None:
            self.units, self.radial = np.zeros(x.size, np.float32), np.zeros(len(self.slices))
        norms = np.zeros(len(self.slices))
        for j, k in enumerate(self.slices):  # tensor by tensor: float64 for one tensor at a time
            t = x[k].astype(np.float64)
            norms[j] = n = float(np.linalg.norm(t))
            if n > 0:
                self.units[k] += ((weight / n) * t).astype(np.float32)
        self.radial += (weight * scale) * norms
        self.norms[island] = norms

    def merge(self, mean: np.ndarray, total_weight: float, shrink: dict[int, float]
              ) -> tuple[np.ndarray, dict[str, Any]]:
        """(sum radial / sum t) * v / |v| per tensor, v = units / sum t; the `mean` where |v| < RDA_CANCEL, counted
        in the report's RDA_FALLBACKS. `shrink` removes (1 - c_i) t_i s_i |d_i| from the radial sums (a clip by c_i,
        given as that product)."""
        out = np.asarray(mean, dtype=np.float32).copy()
        if self.units is None or total_weight <= 0:
            return out, {RDA_FALLBACKS: len(self.slices)}
        radial = self.radial.copy()
        for lid, amount in shrink.items():
            radial -= amount * self.norms[lid]
        fallbacks = 0
        for j, k in enumerate(self.slices):
            v = self.units[k].astype(np.float64) / total_weight
            length = float(np.linalg.norm(v))
            if length < RDA_CANCEL:
                fallbacks += int(self.radial[j] > 0)  # (a tensor no delta moved, one a streamed round leaves, is no
                # fallback: only deltas that cancel are)
            else:
                out[k] = (radial[j] / total_weight / length) * v
        return out, {RDA_FALLBACKS: fallbacks}


def rda(deltas: Sequence[np.ndarray], weights: np.ndarray, layout: Layout) -> tuple[np.ndarray, int]:
    """Radial-directional average of whole deltas, tensor by tensor; also how many tensors fell back to the mean."""
    d = Directions.of(layout)
    for i, x in enumerate(deltas):
        d.add(i, x, float(weights[i]))
    mean = sum(float(w) * np.asarray(x, dtype=np.float64) for w, x in zip(weights, deltas))
    merged, report = d.merge(mean / float(np.sum(weights)), float(np.sum(weights)), {})
    return merged, report[RDA_FALLBACKS]


class RuleSums(Protocol):
    """What a rule keeps of a round beyond the weighted sum (`yeto.sync.merge.aggregate.RoundSum` carries it), added
    to as each delta arrives, and the merge it makes of them. `merge` leaves the sums as they are: a merge retried
    without a refused delta, or made again on a copy, reads them again."""

    def add(self, island: int, delta: np.ndarray, weight: float, scale: float = 1.0) -> None:
        """Take in island's delta, counted for `weight` (its claim, unnormalised) and scaled by `scale`."""

    def merge(self, mean: np.ndarray, total_weight: float, shrink: dict[int, float]
              ) -> tuple[np.ndarray, dict[str, Any]]:
        """The merged delta (from the round's weighted `mean`, its weights' sum, and each clip's `shrink`: (1 - c_i)
        t_i s_i), and the fields the rule adds to the tape's merge record."""


class MeanSums:
    """The mean keeps nothing beyond the weighted sum: its merge is that sum's mean."""

    @classmethod
    def of(cls, layout: Layout) -> "MeanSums":
        return cls()

    def add(self, island: int, delta: np.ndarray, weight: float, scale: float = 1.0) -> None:
        pass

    def merge(self, mean: np.ndarray, total_weight: float, shrink: dict[int, float]
              ) -> tuple[np.ndarray, dict[str, Any]]:
        return mean, {}


class MergeFlags(Protocol):
    """The flags a rule's check reads (`yeto.sync.core.config.SyncerConfig` has them)."""

    robust: str
    lora_merge: str
    step_normalize: Optional[bool]


TRIMMED_MEAN_ALONE = ("--robust trimmed-mean is its own rule, coordinate by coordinate: use it with --merge mean "
                      "--lora-merge factors, or pick --robust norm-clip")
PRODUCT_IS_A_MEAN = "--lora-merge product merges the B.A products by their mean: use it with --merge mean"


def needs_its_sums(flags: MergeFlags) -> Optional[str]:
    """A rule's own math runs on the running sums: `--robust trimmed-mean` and `--lora-merge product` merge by means
    of their own, so they take the mean rule, not this one."""
    if flags.robust == "trimmed-mean":
        return TRIMMED_MEAN_ALONE
    if flags.lora_merge == "product":
        return PRODUCT_IS_A_MEAN
    return None


def fits_any_flags(flags: MergeFlags) -> Optional[str]:
    """The mean is what trimmed-mean and product merges are: every other flag goes with it."""
    return None


@dataclass(frozen=True)
class MergeRule:
    """One `--merge` rule, whole: its math (the sums it keeps as deltas arrive, and its merge of them), what its
    merge adds to the tape (checked by the simulator's replay), its check of the run's other flags, its default for
    `--step-normalize` and its line in `yeto syncer --help`. A new rule is one entry in `RULES`."""

    name: str
    help: str  # what `yeto syncer --help` says of it, after its name
    sums: Callable[[Layout], RuleSums]  # a round's empty sums
    reports: dict[str, str] = field(default_factory=dict)  # merge record fields it adds -> what a replay calls them
    step_normalize_by_default: bool = False  # in time-window rounds, with --step-normalize unset
    check: Callable[[MergeFlags], Optional[str]] = needs_its_sums  # a problem with the other flags, or None


MEAN = "mean"  # the rule `--robust trimmed-mean` and `--lora-merge product` are
DEFAULT_RULE = "rda"
RULES: dict[str, MergeRule] = {r.name: r for r in (
    MergeRule(MEAN, "weighted average; the default with --round-seconds, --lora-merge product or --robust "
                    "trimmed-mean", MeanSums.of, step_normalize_by_default=True, check=fits_any_flags),
    MergeRule("rda", "radial-directional: the mean norm along the mean direction, per tensor; the default",
              Directions.of, reports={RDA_FALLBACKS: "RDA fallbacks"}),
)}


def merge_rules() -> dict[str, MergeRule]:
    """The rules `--merge` takes, by name, in the order they are listed (read at each call: a test may swap in a copy
    of `RULES` with a rule of its own)."""
    return RULES


def merge_rule(name: str) -> MergeRule:
    """The rule `name` (`SyncerConfig.check` refuses an unknown one first, in one line)."""
    rule = merge_rules().get(name)
    if rule is None:
        raise ValueError(f"unknown merge rule {name!r}")
    return rule


def reported_fields() -> dict[str, str]:
    """Every rule's merge record fields: a replay checks each (a rule reports its own, and none of another's)."""
    return {k: label for r in merge_rules().values() for k, label in r.reports.items()}


def rules_help() -> str:
    """The rules as `--merge`'s help lists them: each with its own line, the default first."""
    lines = [f"{r.name} ({r.help})" for r in sorted(merge_rules().values(), key=lambda r: r.name != DEFAULT_RULE)]
    return lines[0] if len(lines) == 1 else f"{', '.join(lines[:-1])} or {lines[-1]}"


def lora_pairs(layout: Layout) -> list[tuple[str, str]]:
    """(lora_A name, lora_B name) of every adapted layer (peft's names; embeddings' lora_embedding_A/B too)."""
    names = {s.name for s in layout.specs}
    pairs = []
    for name in sorted(names):
        for a, b in ((".lora_A.", ".lora_B."), (".lora_embedding_A.", ".lora_embedding_B.")):
            if a in name and name.replace(a, b) in names:
                pairs.append((name, name.replace(a, b)))
    return pairs


@dataclass(frozen=True)
class ProductMerge:
    merged: np.ndarray  # the merged adapter (flat): factors re-fit to the mean product, other tensors the mean
    residual: float  # max over layers of |W - B*A*|_F / |W|_F
    residual_mean: float


def product_merge(adapters: Sequence[np.ndarray], weights: np.ndarray, layout: Layout) -> ProductMerge:
    """The islands' adapters (global + delta, flat) merged as B.A products, re-factorised to rank r."""
    slices = layout.tensor_slices()
    shapes = {s.name: s.shape for s in layout.specs}
    x = np.stack([np.asarray(a, dtype=np.float64) for a in adapters])
    out = (weights @ x).astype(np.float32)  # the mean: kept for tensors outside any A/B pair
    residuals = []
    for a_name, b_name in lora_pairs(layout):
        a_rows, b_rows = slices[a_name], slices[b_name]
        a_list = [x[i, a_rows].reshape(shapes[a_name]) for i in range(len(adapters))]  # (r, in)
        b_list = [x[i, b_rows].reshape(shapes[b_name]) for i in range(len(adapters))]  # (out, r)
        b_star, a_star, residual = refactor(b_list, a_list, weights)
        out[a_rows] = a_star.reshape(-1)
        out[b_rows] = b_star.reshape(-1)
        residuals.append(residual)
    return ProductMerge(out, max(residuals, default=0.0), float(np.mean(residuals)) if residuals else 0.0)


def refactor(bs: Sequence[np.ndarray], as_: Sequence[np.ndarray], weights: np.ndarray
             ) -> tuple[np.ndarray, np.ndarray, float]:
    """Rank-r factors (B*, A*) of W = sum_i w_i B_i A_i by alternating least squares from the factor means, and the
    relative residual. W stays factored: W = Bw As with Bw = [w_1 B_1 ... w_n B_n] (out x nr), As = [A_1; ...; A_n]."""
    bw = np.concatenate([w * b for w, b in zip(weights, bs)], axis=1)
    a_s = np.concatenate(list(as_), axis=0)
    gram_b, gram_a = bw.T @ bw, a_s @ a_s.T  # (nr x nr)
    w_norm2 = float(np.sum(gram_b * gram_a))  # |W|_F^2 = tr(Bw^T Bw As As^T)
    b = sum(w * b for w, b in zip(weights, bs))
    a = sum(w * a for w, a in zip(weights, as_))
    if w_norm2 <= 0:
        return b, a, 0.0
    r = a.shape[0]
    eye = np.eye(r)

    def residual2(b: np.ndarray, a: np.ndarray) -> float:  # |W - BA|^2 = |W|^2 - 2<W, BA> + |BA|^2
        cross = float(np.sum((b.T @ bw) * (a @ a_s.T)))  # <W, BA> = tr((B^T Bw)(As A^T))
        return max(w_norm2 - 2 * cross + float(np.sum((b.T @ b) * (a @ a.T))), 0.0)

    last = residual2(b, a)
    for _ in range(ALS_MAX_ITERATIONS):
        # B = W A^T (A A^T)^-1, then A = (B^T B)^-1 B^T W, with W applied in factored form
        aat = a @ a.T
        b = np.linalg.solve(aat + RIDGE * np.trace(aat) * eye + RIDGE * eye, (bw @ (a_s @ a.T)).T).T
        btb = b.T @ b
        a = np.linalg.solve(btb + RIDGE * np.trace(btb) * eye + RIDGE * eye, (b.T @ bw) @ a_s)
        now = residual2(b, a)
        if last - now <= ALS_TOLERANCE * w_norm2:
            last = now
            break
        last = now
    return b, a, float(np.sqrt(last / w_norm2))
