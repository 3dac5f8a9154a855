"""Property tests of the pure sync math: layout/fragments, quantization, merge, outer step."""

from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from yeto.sync.wire.layout import (build_layout, flatten, layout_from_json, layout_mismatch, pack_fragment, unflatten,
                                   unpack_fragment)
from yeto.sync.merge.rules import DeltaCounts, merge_weights, weight_of
from yeto.sync.merge.outer import nesterov_step
from yeto.sync.wire.quant import BLOCK, ErrorFeedback, QuantError, block_steps, dequantize, encoded_size, quantize

names = st.text("abcdefghij._", min_size=1, max_size=12)
shapes = st.lists(st.integers(1, 9), min_size=1, max_size=3).map(tuple)
adapters = st.dictionaries(names, shapes, min_size=1, max_size=12)


def make(spec, seed=0):
    rng = np.random.default_rng(seed)
    return {k: rng.standard_normal(s).astype(np.float32) for k, s in spec.items()}


@settings(max_examples=60, deadline=None)
@given(spec=adapters, bound=st.integers(1, 200))
def test_pack_unpack_are_exact_inverses(spec, bound):
    tensors = make(spec)
    layout = build_layout(tensors, bound)
    assert [n for f in layout.fragments for n in f.names] == sorted(spec)
    for f in layout.fragments:
        assert f.numel <= bound or len(f.names) == 1  # bounded, except a lone oversized tensor
        back = unpack_fragment(layout, f.index, pack_fragment(layout, f.index, tensors))
        for n in f.names:
            np.testing.assert_array_equal(back[n], tensors[n])
    flat = flatten(layout, tensors)
    assert flat.size == layout.numel == sum(t.size for t in tensors.values())
    assert all(np.array_equal(unflatten(layout, flat)[k], v) for k, v in tensors.items())


@settings(max_examples=30, deadline=None)
@given(spec=adapters, bound=st.integers(1, 200))
def test_layout_depends_on_names_and_shapes_only(spec, bound):
    a = build_layout(make(spec, 1), bound)
    b = build_layout({k: torch.zeros(s, dtype=torch.bfloat16) for k, s in reversed(list(spec.items()))}, bound)
    assert a == b and layout_mismatch(a, b) is None
    assert layout_from_json(a.to_json()) == a


def test_layout_mismatch_names_the_first_differing_tensor():
    base = {"a.lora_A": np.zeros((4, 8)), "b.lora_A": np.zeros((4, 8)), "c.lora_B": np.zeros((8, 4))}
    other = dict(base, **{"b.lora_A": np.zeros((2, 8))})
    msg = layout_mismatch(build_layout(base), build_layout(other))
    assert "b.lora_A" in msg and "[4, 8]" in msg and "[2, 8]" in msg
    missing = {k: v for k, v in base.items() if k != "a.lora_A"}
    assert "a.lora_A" in layout_mismatch(build_layout(base), build_layout(missing))


finite = arrays(np.float32, st.integers(1, 700), elements=st.floats(-1e3, 1e3, width=32))


@settings(max_examples=80, deadline=None)
@given(x=finite, bits=st.sampled_from([2, 4, 8]))
@example(x=np.array([-1.00001], dtype=np.float32), bits=4)  # a minimum whose fp16 rounding crosses a binade
@example(x=np.array([-1.00001], dtype=np.float32), bits=2)
def test_quantization_error_is_at_most_half_a_step_per_block(x, bits):
    buf = quantize(x, bits)
    assert len(buf) == encoded_size(x.size, bits)
    y = dequantize(buf, x.size, bits)
    steps = np.repeat(block_steps(buf, x.size, bits), BLOCK)[: x.size]
    err = np.abs(y - x)
    assert (err <= steps / 2 + 1e-6 * (1 + np.abs(x))).all()
    # the grid is tight: its fp16 minimum sits at most two fp16 ulps below the block's minimum,
    # and its step is the remaining range over the levels (plus fp16 rounding up)
    blocks = -(-x.size // BLOCK)
    mins = np.frombuffer(buf[: 2 * blocks], dtype=np.float16).astype(np.float32)
    for b in range(0, x.size, BLOCK):
        blk, lo = x[b : b + BLOCK], mins[b // BLOCK]
        assert lo <= blk.min() <= lo + 2 * abs(float(np.spacing(np.float16(blk.min())))) + 1e-7
        assert block_steps(buf, x.size, bits)[b // BLOCK] <= (blk.max() - lo) / ((1 << bits) - 1) * 1.002 + 1e-7


@settings(max_examples=40, deadline=None)
@given(x=finite)
def test_32_bits_round_trip_exactly_and_16_closely(x):
    np.testing.assert_array_equal(dequantize(quantize(x, 32), x.size, 32), x)
    np.testing.assert_allclose(dequantize(quantize(x, 16), x.size, 16), x, rtol=1e-3, atol=1e-4)


def test_four_bits_cost_less_than_a_seventh_of_fp32():
    n = 1_000_000
    assert encoded_size(n, 4) / (4 * n) < 1 / 7


def test_two_bits_pack_four_codes_a_byte_lowest_bits_first():
    x = np.tile(np.array([0.0, 1.0, 2.0, 3.0], np.float32), 64)  # one block and a second, partial one: lo 0, step 1
    x[BLOCK], x[BLOCK + 3] = 3.0, 0.0  # the second block: 3, 1, 2, 0 (code 3 in its lowest two bits), padded with 0
    buf = quantize(x[: BLOCK + 4], 2)
    assert len(buf) == encoded_size(BLOCK + 4, 2) == 2 * 4 + 2 * BLOCK * 2 // 8
    codes = np.frombuffer(buf, np.uint8)[8:]
    assert (codes[: BLOCK // 4] == 0b11_10_01_00).all()
    assert codes[BLOCK // 4] == 0b00_10_01_11
    assert (codes[BLOCK // 4 + 1 :] == 0).all()
    np.testing.assert_array_equal(dequantize(buf, BLOCK + 4, 2), x[: BLOCK + 4])
    assert encoded_size(1_000_000, 2) / (4 * 1_000_000) < 1 / 14


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_non_finite_input_is_rejected(bad):
    x = np.ones(300, dtype=np.float32)
    x[137] = bad
    for bits in (2, 4, 8, 16, 32):
        with pytest.raises(QuantError, match="index 137"):
            quantize(x, bits)


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_malformed_payloads_are_rejected(bits):
    x = np.linspace(-1, 1, 300, dtype=np.float32)
    buf = quantize(x, bits)
    for wrong in (buf[:-1], buf + b"\0", quantize(x, 2 if bits == 4 else 4)):
        with pytest.raises(QuantError, match="must be"):
            dequantize(wrong, 300, bits)
    blocks = -(-300 // BLOCK)
    for at, value in ((0, np.nan), (2 * blocks + 2, np.inf), (2 * blocks, -np.inf)):  # a minimum, then steps
        corrupt = bytearray(buf)
        corrupt[at : at + 2] = np.float16(value).tobytes()
        with pytest.raises(QuantError, match="non-finite"):
            dequantize(bytes(corrupt), 300, bits)
    with pytest.raises(QuantError, match="unsupported"):
        dequantize(buf, 300, 3)


def test_error_feedback_keeps_the_running_sum_unbiased():
    rng = np.random.default_rng(0)
    ef = ErrorFeedback(1000)
    true_sum = np.zeros(1000, np.float32)
    sent_sum = np.zeros(1000, np.float32)
    for _ in range(50):
        d = (rng.standard_normal(1000) * 1e-3 + 2e-4).astype(np.float32)
        _, sent = ef.encode(d, 4, [(0, 600), (600, 400)])
        true_sum += d
        sent_sum += sent
    # the gap is one round's residual, not fifty rounds' worth of error
    np.testing.assert_allclose(sent_sum + ef.residual, true_sum, atol=1e-6)
    one_round_err = np.abs(dequantize(quantize(d, 4), 1000, 4) - d).max()
    assert np.abs(sent_sum - true_sum).max() <= one_round_err * 1.5


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**31), rounds=st.integers(2, 40), n=st.integers(1, 600), bias=st.floats(-1e-3, 1e-3),
       split=st.floats(0.0, 1.0))
def test_two_bit_error_feedback_makes_the_sent_sum_track_the_true_sum(seed, rounds, n, bias, split):
    """At 2 bits one round's error is up to a sixth of a block's range; with error feedback the sum of what was sent
    stays within one round's error of the true sum, however many rounds (without it the errors add up)."""
    rng = np.random.default_rng(seed)
    cut = int(n * split)
    pieces = [(0, cut), (cut, n - cut)] if 0 < cut < n else [(0, n)]
    ef = ErrorFeedback(n)
    true_sum, sent_sum = np.zeros(n, np.float64), np.zeros(n, np.float64)
    worst = 0.0  # the largest half step any round used: a bound on every round's residual
    for _ in range(rounds):
        d = (rng.standard_normal(n) * 1e-3 + bias).astype(np.float32)
        target = d + ef.residual
        payloads, sent = ef.encode(d, 2, pieces)
        worst = max(worst, *(float(block_steps(p, k, 2).max()) / 2 for p, (_, k) in zip(payloads, pieces)))
        np.testing.assert_allclose(sent + ef.residual, target, rtol=0, atol=1e-9)
        true_sum += d
        sent_sum += sent
    assert np.abs(sent_sum - true_sum).max() <= worst * (1 + 1e-3) + 1e-6


@settings(max_examples=50, deadline=None)
@given(counts=st.lists(st.tuples(st.integers(1, 10**6), st.integers(1, 10**6), st.integers(1, 1000)), min_size=1,
                       max_size=16))
def test_merge_weights_follow_the_chosen_count(counts):
    deltas = [DeltaCounts(*c) for c in counts]
    for how, field in (("loss-tokens", 0), ("tokens", 1), ("steps", 2)):
        w = merge_weights(deltas, how)
        assert w.sum() == pytest.approx(1.0)
        raw = [c[field] for c in counts]
        np.testing.assert_allclose(w * sum(raw), raw, rtol=1e-9)
        assert [weight_of(d, how) for d in deltas] == raw
    np.testing.assert_allclose(merge_weights(deltas, "equal"), 1 / len(counts))


def test_merge_weights_reject_empty_or_zero():
    for bad in ([], [0, 0], [5, -1]):
        with pytest.raises(ValueError):
            merge_weights([DeltaCounts(t, 1, 1) for t in bad])


def test_merge_is_the_weighted_mean():
    from yeto.sync.merge.aggregate import RoundSum

    s = RoundSum(4)
    s.add(0, np.full(4, 1.0, np.float32), 900)
    s.add(1, np.full(4, 10.0, np.float32), 100)
    np.testing.assert_allclose(s.mean(), np.full(4, 1.9), rtol=1e-6)


def test_outer_step_matches_a_hand_computed_nesterov_update():
    params = np.array([1.0, -2.0], np.float32)
    m = np.array([0.5, 0.0], np.float32)
    delta = np.array([0.1, 0.2], np.float32)  # mean local progress
    lr, mu = 0.7, 0.9
    # by hand: g = -delta = [-0.1, -0.2]; m' = 0.9*[0.5, 0] + g = [0.35, -0.2]
    # step = g + 0.9*m' = [-0.1 + 0.315, -0.2 - 0.18] = [0.215, -0.38]; p' = p - 0.7*step
    new, m2 = nesterov_step(params, delta, m, lr, mu)
    np.testing.assert_allclose(m2, [0.35, -0.2], rtol=1e-6)
    np.testing.assert_allclose(new, [1.0 - 0.7 * 0.215, -2.0 + 0.7 * 0.38], rtol=1e-6)


def test_outer_step_agrees_with_torch_sgd_nesterov():
    rng = np.random.default_rng(0)
    p = rng.standard_normal(10).astype(np.float32)
    tp = torch.nn.Parameter(torch.from_numpy(p.copy()))
    opt = torch.optim.SGD([tp], lr=0.7, momentum=0.9, nesterov=True)
    m = np.zeros(10, np.float32)
    for _ in range(5):
        delta = rng.standard_normal(10).astype(np.float32) * 0.1
        p, m = nesterov_step(p, delta, m, 0.7, 0.9)
        tp.grad = torch.from_numpy(-delta)
        opt.step()
    np.testing.assert_allclose(p, tp.detach().numpy(), rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------------------- aggregation (yeto.sync.merge.aggregate)


@settings(max_examples=50, deadline=None)
@given(st.lists(st.integers(1, 10_000), min_size=1, max_size=6), st.integers(0, 2**31))
def test_running_sum_is_the_token_weighted_mean_whatever_the_arrival_order(tokens, seed):
    from yeto.sync.merge.aggregate import RoundSum

    rng = np.random.default_rng(seed)
    deltas = [rng.standard_normal(257).astype(np.float32) for _ in tokens]
    want = sum(t * d.astype(np.float64) for t, d in zip(tokens, deltas)) / sum(tokens)
    order = rng.permutation(len(tokens))
    s = RoundSum(257)
    for i in order:
        s.add(int(i), deltas[i], tokens[i])
    np.testing.assert_allclose(s.mean(), want, rtol=1e-5, atol=1e-6)
    assert s.order == [int(i) for i in order]


def test_norm_clip_scales_only_the_outlier_even_in_a_pair():
    from yeto.sync.merge.aggregate import RoundSum, clip_factors, clip_reference, clipped_merge

    def factors(norms, history):
        return clip_factors(norms, clip_reference(norms, [(n, "bounded") for n in history]), 4.0)

    assert factors([1.0, 1.2, 100.0], []) == [1.0, 1.0, pytest.approx(4 * 1.2 / 100)]
    assert factors([1.0, 100.0], []) == [1.0, pytest.approx(4 * 1.0 / 100)]  # a pair: the low median
    assert factors([100.0, 1.0], []) == [pytest.approx(4 * 1.0 / 100), 1.0]  # (in either order)
    assert factors([1.0, 100.0], [100.0, 100.0, 1.0, 1.0])[1] == pytest.approx(4 * 1.0 / 100)  # its history
    assert factors([1.0, 3.0], [1.0, 1.1, 0.9]) == [1.0, 1.0]  # honest spread is left alone
    assert factors([0.0, 1.0], [0.0, 0.0, 0.0]) == [1.0, 1.0]  # a zero delta is no step's norm: it clips nothing
    assert factors([1e-9, 1.0], []) == [1.0, pytest.approx(4e-9)]  # (a tiny bounded one still sets a pair's ref ...)
    trusted = clip_reference([1e-9, 1.0, 1.2], [(0.9, "trusted")], ["bounded", "trusted", "bounded"])
    assert trusted == 0.9  # (... unless trusted norms are there: the reference is theirs alone)
    assert clip_reference([3.0, 1.0], [], ["extra", "bounded"]) == 1.0  # an extra id's norm sets nothing
    d = {0: np.ones(8, np.float32), 1: np.full(8, 100.0, np.float32)}
    s = RoundSum(8)
    for i in (1, 0):
        s.add(i, d[i], 10)
    mean, report = clipped_merge(s, {1: 0.04}, {0: 10, 1: 10}, d.__getitem__)
    np.testing.assert_allclose(mean, (1.0 + 100.0 * 0.04) / 2, rtol=1e-6)
    assert report == {}  # (the mean reports nothing)


def test_trimmed_mean_drops_the_extremes_per_coordinate():
    from yeto.sync.merge.aggregate import trimmed_mean
    from yeto.sync.wire.layout import build_layout

    layout = build_layout({"a.lora_A.weight": np.zeros((3, 5), np.float32),
                           "b.lora_A.weight": np.zeros((2, 5), np.float32)}, 15)  # two fragments
    assert len(layout.fragments) == 2
    x = np.array([[1.0] * 25, [2.0] * 25, [3.0] * 25, [1e6] * 25, [-1e6] * 25], np.float32)
    out = trimmed_mean(lambda k: x[:, layout.fragments[k].start:layout.fragments[k].start + layout.fragments[k].numel],
                       [1, 1, 1, 1, 1], layout)
    np.testing.assert_allclose(out, 2.0)  # the hostile extremes on both sides are trimmed
    two = trimmed_mean(lambda k: x[:2, :layout.fragments[k].numel], [3, 1], layout)
    np.testing.assert_allclose(two, (3 * 1.0 + 2.0) / 4)  # two deltas: nothing to trim, the weighted mean


# ---------------------------------------------------------------- numpy kernels vs the torch ones they replace

REFERENCE = Path(__file__).parent / "data" / "sync_reference.npz"  # the torch kernels' outputs (yeto 1add59b)


def reference_round():
    from yeto.sync.wire.layout import build_layout

    ref = np.load(REFERENCE)
    layout = build_layout({"a.lora_A.weight": np.zeros((4, 100), np.float32),
                           "a.lora_B.weight": np.zeros((300, 2), np.float32)}, 512)
    return ref, layout, list(ref["deltas"]), [float(w) for w in ref["weights"]], [float(s) for s in ref["scales"]]


def test_quantization_and_error_feedback_are_bit_for_bit_the_torch_kernels():
    ref = np.load(REFERENCE)
    x = ref["x"]  # random, with a constant block and an outlier
    for bits in (4, 8):
        for n in (1, 127, 1000):
            q = quantize(x[:n], bits)
            np.testing.assert_array_equal(np.frombuffer(q, np.uint8), ref[f"q{bits}_{n}"], err_msg=f"{bits} bits, {n}")
            np.testing.assert_array_equal(dequantize(q, n, bits), ref[f"dq{bits}_{n}"], err_msg=f"{bits} bits, {n}")
    ef = ErrorFeedback(1000)
    for r in range(3):
        _, sent = ef.encode(x * (r + 1), 4, [(0, 600), (600, 400)])
        np.testing.assert_array_equal(sent, ref[f"ef_sent{r}"])
    np.testing.assert_array_equal(ef.residual, ref["ef_residual"])


@pytest.mark.parametrize("rule", ["mean", "rda"])
def test_running_sums_and_clipped_merges_match_the_torch_kernels(rule):
    """torch fused each add's multiply (one rounding), numpy rounds the product too (one more rounding per add): sums
    of three agree to a few ulps; a clip's correction is fused here as well, and RDA's merge is bit for bit."""
    from yeto.sync.merge.aggregate import RoundSum, clipped_merge

    ref, layout, deltas, weights, scales = reference_round()
    s = RoundSum.for_rule(layout, rule)
    for i, d in enumerate(deltas):
        s.add(i, d, weights[i], scales[i])
    np.testing.assert_array_max_ulp(s.total, ref[f"{rule}_total"], maxulp=4)
    np.testing.assert_array_max_ulp(s.mean(), ref[f"{rule}_mean"], maxulp=4)
    merged, report = clipped_merge(s.copy(), {2: 0.05}, {i: weights[i] * scales[i] for i in range(3)},
                                   deltas.__getitem__)
    want = ref[f"{rule}_clipped"]
    np.testing.assert_allclose(merged, want, rtol=0, atol=2e-6 * np.abs(want).max())
    assert report.get("rda_fallbacks", -1) == int(ref[f"{rule}_fallbacks"])
    if rule == "rda":
        np.testing.assert_array_equal(merged, want)


def test_outer_step_is_bit_for_bit_its_textbook_form():
    rng = np.random.default_rng(3)
    p, d, m = (rng.standard_normal(4099).astype(np.float32) for _ in range(3))
    g = -d
    m_want = 0.9 * m + g
    p_want = (p - 0.7 * (g + 0.9 * m_want)).astype(np.float32)
    new, m2 = nesterov_step(p, d, m, 0.7, 0.9)
    assert new.dtype == m2.dtype == np.float32
    np.testing.assert_array_equal(m2, m_want)
    np.testing.assert_array_equal(new, p_want)


def test_the_kernels_give_the_same_bits_on_one_thread_and_on_many(monkeypatch):
    import yeto.sync.wire.spans as spans
    from yeto.sync.merge.aggregate import accumulate

    rng = np.random.default_rng(5)
    x = (rng.standard_normal(3 * (1 << 20) + 77) * 1e-3).astype(np.float32)  # long enough for several spans
    x[12345] = 3.0

    def kernels():
        q = quantize(x, 4)
        total = accumulate(None, x, 0.3)
        return q, dequantize(q, x.size, 4), accumulate(total, dequantize(q, x.size, 4), -0.29, fused=True)

    monkeypatch.setattr(spans, "WORKERS", 1)
    one = kernels()
    monkeypatch.setattr(spans, "WORKERS", 4)
    many = kernels()
    assert one[0] == many[0]
    for a, b in zip(one[1:], many[1:]):
        np.testing.assert_array_equal(a, b)
    monkeypatch.setattr(spans, "WORKERS", 1)
    two = quantize(x, 2), dequantize(quantize(x, 2), x.size, 2)
    monkeypatch.setattr(spans, "WORKERS", 4)
    assert two[0] == quantize(x, 2)
    np.testing.assert_array_equal(two[1], dequantize(two[0], x.size, 2))
    bad = x.copy()
    bad[2_500_000] = np.nan  # in a later span than the first
    with pytest.raises(QuantError, match="index 2500000"):
        quantize(bad, 4)


def test_claims_buy_no_more_than_the_median_delta_and_step_claims_are_bounded():
    from yeto.sync.merge.rules import MAX_CLAIM_OVER_MEDIAN as C
    from yeto.sync.merge.rules import MAX_STEP_SCALE, MAX_UNTRUSTED_STEP_GAIN, capped_claims, merge_terms, round_length

    assert C == 1
    assert capped_claims([1000, 1000, 2 ** 40]) == [1000, 1000, 1000]  # 2^40 tokens count as the median
    assert capped_claims([1000, 2 ** 40]) == [1000, 1000]  # in a pair, as the smaller claim
    assert capped_claims([100, 1000, 1000]) == [100, 1000, 1000]  # a short delta keeps its small weight
    assert capped_claims([100, 1000, 5000]) == [100, 1000, 1000]
    gain = MAX_UNTRUSTED_STEP_GAIN
    assert round_length([10, 10, 10 ** 7], [10, 10, 10 ** 7]) == 10 * gain  # a step claim cannot set it
    assert round_length([10, 10, 10 ** 7], [10, 10, 10 ** 7], ["trusted"] * 3) == 10 ** 7  # a trusted claim does
    assert round_length([10, 1], [10, 1], ["trusted"] * 2) == 10  # so an honest fast island does
    assert round_length([10, 1], [10, 1]) == gain  # on the join key it is one claim judged by the other
    # extra ids never bound anyone, nor lengthen a round beyond gain x the rest
    assert round_length([10, 10 ** 7, 10 ** 7], [10, 10 ** 7, 10 ** 7], ["bounded", "bounded", "extra"]) == 10 * gain
    counts = [DeltaCounts(1000, 2000, 10), DeltaCounts(1000, 2000, 1)]
    t = merge_terms(counts, "loss-tokens", [0, 0], 0.5, True, [10, 1], ["trusted"] * 2)
    assert t.length == 10 and t.scales == [1 / 10, 1 / 1]  # each delta an estimate of a 10-step move
    joined = merge_terms(counts, "loss-tokens", [0, 0], 0.5, True, [10, 1])
    moves = [s * joined.length for s in joined.scales]
    assert moves == [1.0, gain]  # the fast island keeps its length (never scaled down), the slow one gain x
    liar = merge_terms([DeltaCounts(1000, 2000, 10)] * 2 + [DeltaCounts(1000, 2000, 1)], "loss-tokens", [0, 0, 0],
                       0.5, True, [10 ** 6, 10 ** 6, 1], ["trusted"] * 3)
    assert liar.length == 10 ** 6 and liar.scales[2] * liar.length == MAX_STEP_SCALE  # scaled up 16x, no more
    holder = merge_terms([DeltaCounts(1000, 2000, 10)] * 2 + [DeltaCounts(1000, 2000, 10 ** 7)], "loss-tokens",
                         [0, 0, 0], 0.5, True, [10, 10, 10 ** 7])
    assert [s * holder.length for s in holder.scales] == [gain, gain, 1.0]  # honest deltas gain x, no further


def test_the_clip_judges_a_short_delta_at_its_step_gain_whether_or_not_the_merge_normalizes():
    from yeto.sync.merge.aggregate import clip_factors, clip_reference
    from yeto.sync.merge.rules import merge_terms

    counts = [DeltaCounts(1200, 2400, 12), DeltaCounts(100, 200, 1)]
    plain = merge_terms(counts, "loss-tokens", [0, 1], 0.5, False, [12, 1], ["trusted"] * 2)
    assert plain.scales == [1.0, 2 ** -0.5] and plain.length == 1.0  # merged as it came (stale discounted)
    assert plain.judged == [1.0, 12 * 2 ** -0.5]  # judged as the 12-step move it stands for
    normalized = merge_terms(counts, "loss-tokens", [0, 1], 0.5, True, [12, 1], ["trusted"] * 2)
    assert normalized.judged == normalized.scales
    alike = merge_terms(counts[:1] * 2, "loss-tokens", [0, 0], 0.5, False, [12, 12])
    assert alike.judged == alike.scales == [1.0, 1.0]  # equal steps: judged as merged
    # the pair's clip: a 12-step delta of norm 5 beside a 1-step one of 0.5 is not cut to 4 x 0.5
    norms = plain.judged_norms([5.0, 0.5])
    assert clip_factors(norms, clip_reference(norms, [], ["trusted"] * 2), 4.0)[0] == 1.0
    unjudged = [5.0, 0.5 * 2 ** -0.5]
    assert clip_factors(unjudged, clip_reference(unjudged, [], ["trusted"] * 2), 4.0)[0] < 0.3  # (what it was)
