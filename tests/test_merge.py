"""Merge rules (mean, RDA), merge weights, exact LoRA aggregation (product, frozen A): the pure math against hand
computations and numpy's SVD, the syncer core merging by the configured rule and recording it, real islands."""

import numpy as np
import pytest

from tests.conftest import DEMO_DATA
from tests.test_core import Fleet
from yeto import YetoError
from yeto.sync.core.contract import contract_mismatch
from yeto.sync.core.island import RoundCounts, Train, StepVerdict
from yeto.sync.core.syncer import SyncerConfig
from yeto.sync.wire.layout import build_layout, flatten, unflatten
from yeto.sync.merge.rules import MergeRule, lora_pairs, needs_its_sums, product_merge, rda, refactor, rules_help

EQUAL2 = np.array([0.5, 0.5])


def test_rda_keeps_the_typical_length_along_the_mean_direction():
    layout = build_layout({"t": np.zeros(2, np.float32)})
    merged, fallbacks = rda([np.array([3.0, 0.0]), np.array([0.0, 4.0])], EQUAL2, layout)
    # norms 3 and 4: mean 3.5; unit directions (1, 0) and (0, 1): mean (0.5, 0.5), direction (1, 1)/sqrt(2)
    np.testing.assert_allclose(merged, [3.5 / np.sqrt(2)] * 2, rtol=1e-6)
    assert fallbacks == 0
    mean = 0.5 * np.array([3.0, 0.0]) + 0.5 * np.array([0.0, 4.0])
    assert np.linalg.norm(merged) > np.linalg.norm(mean)  # the mean of orthogonal deltas shrinks; RDA does not
    w = np.array([0.75, 0.25])  # weights reach norms and directions alike: (0.75*3 + 0.25*4) along (0.75, 0.25)
    merged, _ = rda([np.array([3.0, 0.0]), np.array([0.0, 4.0])], w, layout)
    np.testing.assert_allclose(merged, 3.25 * np.array([0.75, 0.25]) / np.hypot(0.75, 0.25), rtol=1e-6)


def test_rda_falls_back_to_the_mean_per_tensor_when_directions_cancel():
    layout = build_layout({"a": np.zeros(2, np.float32), "b": np.zeros(2, np.float32), "c": np.zeros(2, np.float32)})
    slices = layout.tensor_slices()
    d0, d1 = np.zeros(6, np.float32), np.zeros(6, np.float32)  # (no delta moves c, as a streamed round leaves it:
    # not a fallback)
    d0[slices["a"]], d1[slices["a"]] = [1.0, 0.0], [-2.0, 0.0]  # opposite: the unit directions cancel
    d0[slices["b"]], d1[slices["b"]] = [1.0, 1.0], [2.0, 2.0]  # the same direction: RDA is the mean length
    merged, fallbacks = rda([d0, d1], EQUAL2, layout)
    assert fallbacks == 1
    np.testing.assert_allclose(merged[slices["a"]], [-0.5, 0.0])  # the mean
    np.testing.assert_allclose(merged[slices["b"]], [1.5, 1.5], rtol=1e-6)


def rda_by_formula(deltas, weights, layout):
    """RDA of whole deltas, written straight from its definition (the reference the streaming sums must match)."""
    w = np.asarray(weights, np.float64) / np.sum(weights)
    out = np.empty(layout.numel)
    for rows in layout.tensor_slices().values():
        x = np.stack([np.asarray(d[rows], np.float64) for d in deltas])
        norms = np.linalg.norm(x, axis=1)
        v = w @ (x / norms[:, None])
        out[rows] = (w @ norms) * v / np.linalg.norm(v)
    return out


@pytest.mark.parametrize("seed", range(5))
def test_streaming_rda_matches_the_formula_whatever_the_order_scales_and_clips(seed):
    """The syncer adds deltas as they arrive (a stale one scaled, an outlier clipped at the close): its RDA must be the
    formula's on the deltas as they count, scale and clip applied."""
    from yeto.sync.merge.aggregate import RoundSum, clipped_merge

    rng = np.random.default_rng(seed)
    layout = build_layout({f"t{k}": np.zeros((3, 5), np.float32) for k in range(4)})
    n = int(rng.integers(2, 6))
    deltas = [rng.normal(size=layout.numel).astype(np.float32) * rng.uniform(0.1, 10) for _ in range(n)]
    tokens = rng.integers(1, 1000, size=n).astype(float)
    scale = [1.0 if rng.random() < 0.5 else float(rng.uniform(0.3, 1.0)) for _ in range(n)]
    clip = {int(i): float(rng.uniform(0.01, 0.9)) for i in rng.choice(n, size=int(rng.integers(0, n)), replace=False)}
    s = RoundSum.for_rule(layout, "rda")
    for i in rng.permutation(n):
        s.add(int(i), deltas[i], tokens[i], scale[i])
    merged, report = clipped_merge(s, clip, {i: tokens[i] * scale[i] for i in range(n)}, deltas.__getitem__)
    counted = [d * scale[i] * clip.get(i, 1.0) for i, d in enumerate(deltas)]
    np.testing.assert_allclose(merged, rda_by_formula(counted, tokens, layout), rtol=1e-4, atol=1e-6)
    assert report == {"rda_fallbacks": 0}
    assert not np.allclose(merged, rda_by_formula(deltas, tokens, layout), rtol=1e-3)  # scales and clips counted


def lora_adapter(rng, out=24, inn=20, r=4, layers=2):
    names = {}
    for i in range(layers):
        names[f"base_model.model.l{i}.q.lora_A.default.weight"] = rng.normal(size=(r, inn)).astype(np.float32)
        names[f"base_model.model.l{i}.q.lora_B.default.weight"] = rng.normal(size=(out, r)).astype(np.float32)
    names["base_model.model.norm.weight"] = rng.normal(size=(inn,)).astype(np.float32)  # not a LoRA pair
    return names


def products(layout, flat):
    t = unflatten(layout, flat)
    return {a: t[b].astype(np.float64) @ t[a].astype(np.float64) for a, b in lora_pairs(layout)}


def test_product_merge_is_exact_when_the_mean_update_has_rank_r():
    """Islands whose factors differ by a change of basis (B M, M^-1 A: the same update B A) and islands sharing A:
    the mean of the products has rank r, and the product merge writes it back exactly; the factor means do not."""
    rng = np.random.default_rng(0)
    base = lora_adapter(rng)
    layout = build_layout(base)
    islands = []
    for _ in range(3):
        t = dict(base)
        for a, b in lora_pairs(layout):
            m = rng.normal(size=(4, 4)) + 3 * np.eye(4)
            t[a], t[b] = np.linalg.solve(m, base[a]).astype(np.float32), (base[b] @ m).astype(np.float32)
        islands.append(flatten(layout, t))
    w = np.array([0.5, 0.3, 0.2])
    pm = product_merge(islands, w, layout)
    target = products(layout, flatten(layout, base))
    for a, p in products(layout, pm.merged).items():
        np.testing.assert_allclose(p, target[a], rtol=1e-4, atol=1e-4)
    assert pm.residual < 1e-5
    factor_mean = products(layout, (w @ np.stack(islands)).astype(np.float32))
    assert max(np.linalg.norm(factor_mean[a] - target[a]) / np.linalg.norm(target[a]) for a in target) > 0.05
    norm = "base_model.model.norm.weight"
    np.testing.assert_allclose(unflatten(layout, pm.merged)[norm],
                               sum(wi * unflatten(layout, x)[norm] for wi, x in zip(w, islands)), rtol=1e-6)


def test_product_merge_reports_the_residual_of_the_best_rank_r_fit():
    rng = np.random.default_rng(1)
    w = np.array([0.4, 0.6])
    bs, as_ = [rng.normal(size=(30, 3)) for _ in w], [rng.normal(size=(3, 25)) for _ in w]
    b, a, residual = refactor(bs, as_, w)
    full = sum(wi * bi @ ai for wi, bi, ai in zip(w, bs, as_))  # rank 6 > r = 3
    s = np.linalg.svd(full, compute_uv=False)
    best = np.sqrt((s[3:] ** 2).sum()) / np.linalg.norm(full)
    assert best > 0.1
    assert residual == pytest.approx(best, rel=1e-4)
    assert np.linalg.norm(full - b @ a) / np.linalg.norm(full) == pytest.approx(residual, rel=1e-6)


def test_identical_islands_merge_to_themselves():
    rng = np.random.default_rng(2)
    layout = build_layout(lora_adapter(rng))
    one = flatten(layout, lora_adapter(rng))
    pm = product_merge([one, one, one], np.array([0.2, 0.3, 0.5]), layout)
    np.testing.assert_allclose(pm.merged, one, rtol=1e-5, atol=1e-6)
    merged, _ = rda([one - 1, one - 1], EQUAL2, layout)
    np.testing.assert_allclose(merged, one - 1, rtol=1e-5)


def push(fleet, deltas, counts):
    """Every island trains its round to `local = adapter + deltas[lid]` and pushes (tokens, loss_tokens, steps)."""
    for lid, d in deltas.items():
        c = fleet.islands[lid]
        task = c.next_task(fleet.now)
        assert isinstance(task, Train), task
        assert c.after_step(fleet.cfg.inner_steps, fleet.now) is StepVerdict.PUSH
        tokens, loss_tokens, steps = counts[lid]
        fleet.to_syncer(lid, c.push(task.adapter + d, RoundCounts(tokens, loss_tokens, steps, 1.0, 0.1)))
        fleet.run()


@pytest.mark.parametrize("principal", [None, "join"])
def test_the_syncer_merges_by_the_configured_rule_and_weights_and_records_them(principal):
    """Weights follow --merge-weight: a trusted island's counts as claimed (no keys on loopback, or its own key); on
    the shared join key each count is capped at the round's low median (a claim buys no more than the median delta's
    weight; a short delta keeps its small one)."""
    plain = {"outer_lr": 1.0, "outer_momentum": 0.0, "robust": "off"}
    rng = np.random.default_rng(3)
    counts = {0: (100, 90, 2), 1: (300, 10, 2), 2: (200, 50, 2)}
    expected = {None: [("rda", "equal", [1 / 3] * 3), ("mean", "tokens", [1 / 6, 1 / 2, 1 / 3]),
                       ("mean", "loss-tokens", [90 / 150, 10 / 150, 50 / 150])],
                "join": [("rda", "equal", [1 / 3] * 3), ("mean", "tokens", [0.2, 0.4, 0.4]),  # 100, 300 -> 200, 200
                         ("mean", "loss-tokens", [50 / 110, 10 / 110, 50 / 110])]}  # 90 -> 50, 10, 50
    for merge, weight, expect_w in expected[principal]:
        f = Fleet(n=3, merge=merge, merge_weight=weight, principal=principal, **plain)
        g0 = f.syncer.run.global_.copy()
        deltas = {lid: rng.normal(size=f.layout.numel).astype(np.float32) for lid in (0, 1, 2)}
        push(f, deltas, counts)
        e = [e for e in f.tape if e["event"] == "merge"][0]
        assert (e["merge"], e["merge_weight"], e["lora_merge"]) == (merge, weight, "factors")
        assert e["tiers"] == ["trusted" if principal is None else "bounded"] * 3
        np.testing.assert_allclose(e["weights"], expect_w)
        if merge == "rda":
            want, _ = rda([deltas[0], deltas[1], deltas[2]], np.array(expect_w), f.layout)
            assert "rda_fallbacks" in e
        else:
            want = sum(w * deltas[i] for i, w in enumerate(expect_w))
        np.testing.assert_allclose(f.syncer.run.global_ - g0, want, rtol=1e-4, atol=1e-5)


def test_the_syncer_merges_products_and_records_the_residual():
    f = Fleet(n=2, lora_merge="product", outer_lr=1.0, outer_momentum=0.0, robust="off")
    g0 = f.syncer.run.global_.copy()
    rng = np.random.default_rng(4)
    deltas = {lid: rng.normal(size=f.layout.numel).astype(np.float32) for lid in (0, 1)}
    push(f, deltas, {0: (100, 50, 2), 1: (100, 50, 2)})
    e = [e for e in f.tape if e["event"] == "merge"][0]
    assert e["lora_merge"] == "product" and 0 <= e["residual"] < 1  # rank-2 factors, products of rank up to 4
    want = product_merge([g0 + deltas[0], g0 + deltas[1]], EQUAL2, f.layout)
    assert e["residual"] == pytest.approx(want.residual, rel=1e-5)
    np.testing.assert_allclose(f.syncer.run.global_, want.merged, rtol=1e-4, atol=1e-5)


def test_conflicting_merge_flags_are_one_line_errors():
    for flags, message in (({"merge": "median"}, "--merge must be one of mean, rda, got 'median'"),
                           ({"merge_weight": "loss"}, "--merge-weight must be one of loss-tokens, tokens, steps"),
                           ({"lora_merge": "svd"}, "--lora-merge must be one of factors, product"),
                           ({"merge": "rda", "robust": "trimmed-mean"}, "--robust trimmed-mean is its own rule"),
                           ({"merge": "rda", "lora_merge": "product"}, "use it with --merge mean")):
        with pytest.raises(YetoError, match=message):
            SyncerConfig(**flags).check()


class FirstSums:
    """A toy rule's sums, to show what a new rule takes: the first delta to arrive, as it counts (scaled, then
    clipped), the others left out."""

    def __init__(self):
        self.first = None  # (island, its effective weight t s, its delta scaled)

    def add(self, island, delta, weight, scale=1.0):
        if self.first is None:
            self.first = (island, weight * scale, np.asarray(delta, np.float32) * np.float32(scale))

    def merge(self, mean, total_weight, shrink):
        lid, weight, delta = self.first
        kept = 1.0 - shrink.get(lid, 0.0) / weight if weight else 1.0  # (a clip by c shrinks by (1 - c) t s)
        return delta * np.float32(kept), {"first_of": lid}


FIRST_ALONE = "--merge first takes the first delta as it came: drop --step-normalize"
FIRST = MergeRule("first", "the first delta to arrive, the others left out", lambda layout: FirstSums(),
                  reports={"first_of": "first island"},
                  check=lambda flags: FIRST_ALONE if flags.step_normalize else needs_its_sums(flags))


@pytest.fixture
def first_rule(monkeypatch):
    """The registry with the toy rule added: a copy, for this test alone."""
    from yeto.sync.merge import rules

    monkeypatch.setattr(rules, "RULES", {**rules.RULES, FIRST.name: FIRST})


def test_a_new_merge_rule_is_one_registry_entry(first_rule):
    """The entry alone makes the rule: the config takes it and runs its check, --merge's help lists it, the syncer
    core merges by it and records what it reports, and the audit proves the tape."""
    from yeto.sync.shell.audit import audit

    SyncerConfig(merge="first").check()
    for flags, message in (({"merge": "median"}, "--merge must be one of mean, rda, first, got 'median'"),
                           ({"merge": "first", "step_normalize": True}, FIRST_ALONE),
                           ({"merge": "first", "robust": "trimmed-mean"}, "--robust trimmed-mean is its own rule"),
                           ({"merge": "first", "lora_merge": "product"}, "use it with --merge mean")):
        with pytest.raises(YetoError, match=message):
            SyncerConfig(**flags).check()
    assert rules_help().endswith("or first (the first delta to arrive, the others left out)")
    f = Fleet(n=3, merge="first", outer_lr=1.0, outer_momentum=0.0, robust="off")
    g0 = f.syncer.run.global_.copy()
    rng = np.random.default_rng(5)
    deltas = {lid: rng.normal(size=f.layout.numel).astype(np.float32) for lid in (2, 0, 1)}
    push(f, deltas, {0: (100, 50, 2), 1: (100, 50, 2), 2: (100, 50, 2)})
    e = [e for e in f.tape if e["event"] == "merge"][0]
    assert (e["merge"], e["summed"], e["first_of"]) == ("first", [2, 0, 1], 2)
    np.testing.assert_allclose(f.syncer.run.global_ - g0, deltas[2], rtol=1e-5, atol=1e-6)
    assert audit(f.tape).ok


def test_the_simulator_replays_a_new_merge_rule_from_its_entry(first_rule):
    """A fault schedule run under the toy rule: the oracle replays every merge by the entry's sums (the global bit for
    bit, the field it reports), and a replay that reads another rule is caught."""
    import dataclasses

    from yeto.sync import sim

    schedule = dataclasses.replace(sim.Schedule.draw(11), merge="first")
    w = sim.World(schedule)
    w.run()
    merges = [e for e in w.syncer.disk.tape if e["event"] == "merge"]
    assert merges and all(e["merge"] == "first" and e["first_of"] == e["summed"][0] for e in merges)
    for e in merges:
        e["first_of"] = e["summed"][-1] if len(e["summed"]) > 1 else -1  # (a tape that says otherwise)
    with pytest.raises(sim.Violation, match="first island, the tape says"):
        w.oracle.replay(w.syncer.disk.tape)


def frozen_a_islands(tiny_model):
    from yeto.backends.torch.island import TorchIsland, TrainConfig
    from yeto.backends.mlx.island import MLXIsland

    common = dict(model=str(tiny_model("llama")), data=str(DEMO_DATA), seq_len=64, batch_size=2, lora_r=4,
                  lora_dropout=0.0, lr=1e-2, warmup_steps=1, num_islands=2, lora_freeze_a=True)
    return [TorchIsland(TrainConfig(**common, island_id=0), log=lambda s: None),
            MLXIsland(TrainConfig(**common, island_id=1), log=lambda s: None)]


def test_frozen_a_trains_b_only_on_both_backends_and_averaging_b_is_exact(tiny_model):
    pytest.importorskip("mlx.core")
    islands = frozen_a_islands(tiny_model)
    start = islands[0].adapter_state()
    islands[1].load_adapter_state(start)  # a run's islands all start from the founder's adapter
    ends = []
    for island in islands:
        for _ in range(3):
            island.step()
        end = island.adapter_state()
        assert sorted(end) == sorted(start)  # A is still exchanged (the run's shared A) ...
        for name in end:
            if ".lora_A." in name:
                np.testing.assert_array_equal(end[name], start[name])  # ... and never moves
        assert max(float(np.abs(end[n]).max()) for n in end if ".lora_B." in n) > 1e-4  # B trained
        ends.append(end)
    layout = build_layout(start)
    flat = [flatten(layout, e) for e in ends]
    mean_of_products = {a: 0.5 * p0 + 0.5 * p1 for (a, p0), p1 in zip(products(layout, flat[0]).items(),
                                                                      products(layout, flat[1]).values())}
    factor_mean = products(layout, 0.5 * flat[0] + 0.5 * flat[1])
    for a in factor_mean:
        np.testing.assert_allclose(factor_mean[a], mean_of_products[a], rtol=1e-5, atol=1e-7)
    assert product_merge(flat, EQUAL2, layout).residual < 1e-5  # the product merge agrees: nothing to drop


def test_a_island_that_trains_a_in_a_frozen_a_run_is_refused_by_the_contract():
    run = {"lora_freeze_a": True}
    assert contract_mismatch(run, {"lora_freeze_a": False}) == (
        "lora_freeze_a (--lora-freeze-a) is False on this island, True in the run")
    assert contract_mismatch(run, {"lora_freeze_a": True}) is None


def test_a_torch_and_an_mlx_island_with_frozen_a_merge_products_exactly(tiny_model, tmp_path):
    """Real processes: a syncer merging B.A products, a torch and an MLX island that train B only. With A shared the
    mean product has rank r, so every merge's residual is ~0: the re-factorisation drops nothing."""
    import subprocess
    import sys

    from safetensors.numpy import load_file

    from tests.conftest import REPO
    from tests.test_fleet import ENV, finish, start_island, syncer
    from yeto.launch.local import free_port
    from yeto.sync.shell.audit import audit
    from yeto.sync.shell.tape import read_tape

    model, port, s_out = tiny_model("llama"), free_port(), tmp_path / "syncer"
    procs = {"syncer": syncer(port, s_out, "--islands", 2, "--quorum", 2, "--outer-steps", 2, "--inner-steps", 3,
                              "--lora-merge", "product", "--sync-bits", 32)}
    procs[0] = start_island(model, port, 0, 2, tmp_path / "l0", "--lora-freeze-a", "--lora-dropout", 0)
    procs[1] = subprocess.Popen([sys.executable, "-m", "yeto.backends.mlx", "--model", str(model), "--syncer",
                                 f"127.0.0.1:{port}", "--island-id", "1", "--islands", "2", "--out",
                                 str(tmp_path / "l1"), "--data", str(DEMO_DATA), "--seq-len", "64", "--batch-size", "2",
                                 "--lora-r", "4", "--lora-dropout", "0", "--no-progress", "--lora-freeze-a"], cwd=REPO,
                                env=ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    outs = finish(procs)
    for name, (code, text) in outs.items():
        assert code == 0, (name, text[-3000:])
    tape = read_tape(s_out)
    assert audit(tape).ok, audit(tape).summary()
    contract = [e for e in tape if e["event"] == "contract"][0]
    assert contract["lora_freeze_a"] is True
    merges = [e for e in tape if e["event"] == "merge"]
    assert [m["responders"] for m in merges] == [[0, 1], [0, 1]]
    assert all(m["lora_merge"] == "product" and m["residual"] < 1e-4 for m in merges), merges
    merged = load_file(str(s_out / "adapter" / "adapter_model.safetensors"))
    for island in ("l0", "l1"):
        mine = load_file(str(tmp_path / island / "adapter" / "adapter_model.safetensors"))
        assert sorted(mine) == sorted(merged)
    first = load_file(str(tmp_path / "l0" / "adapter" / "adapter_model.safetensors"))
    assert any(np.abs(v).max() > 0 for k, v in first.items() if ".lora_B." in k)


def test_merge_alpha_starts_each_round_from_the_blend_of_the_merged_and_the_own_adapter(start_syncer):
    """--merge-alpha 0.25: after a merge an island starts from 0.25 x global + 0.75 x what it pushed (its delta is
    still taken against the global). Two islands pulling apart, plain averaging at 32 bits: the global is the mean
    of what they pushed, so the blend differs from both."""
    from tests.peers import QuadraticIsland, island_thread

    class Recording(QuadraticIsland):
        def load_adapter_state(self, state):
            super().load_adapter_state(state)
            self.loads.append(flatten(self.layout, self.state))

        def step(self):
            out = super().step()
            self.ends.append(flatten(self.layout, self.state))
            return out

    s, port = start_syncer(islands=2, quorum=2, outer_steps=2, inner_steps=2, sync_bits=32, merge_alpha=0.25,
                           outer_lr=1.0, outer_momentum=0.0)
    islands = {0: Recording(1.0, 100), 1: Recording(-1.0, 100)}
    for isl in islands.values():
        isl.layout, isl.loads, isl.ends = build_layout(isl.adapter_state()), [], []
    results: dict = {}
    threads = [island_thread(isl, port, lid, results) for lid, isl in islands.items()]
    for t in threads:
        t.join(60)
    assert all(not isinstance(results.get(i), Exception) for i in islands), results
    pushed = {lid: isl.ends[1] for lid, isl in islands.items()}  # round 1: 2 steps each
    merged = (pushed[0] + pushed[1]) / 2  # equal loss tokens
    for lid, isl in islands.items():  # loads: round 1 (the init), round 2 (the blend), the final global
        np.testing.assert_allclose(isl.loads[1], 0.25 * merged + 0.75 * pushed[lid], atol=1e-5)
        assert not np.allclose(isl.loads[1], merged, atol=1e-3)


@pytest.mark.parametrize("principal,plain_mean,normalized", [(None, 0.034, 0.04), ("join", 0.025, 0.03)])
def test_step_normalize_scales_each_delta_to_the_longest_island(principal, plain_mean, normalized):
    """Island 0 does 4 steps (+0.01 each, 200 loss tokens), island 1 one step (50): trusted, the mean weighs them
    0.8 / 0.2, 0.034; on the join key (in a pair the larger claim counts as the smaller) (0.04 + 0.01) / 2 = 0.025;
    either is shorter than the long island's move. Normalized, each trusted delta is scaled to 4 steps first: 0.04;
    on the join key the 4-step claim counts at most 2x the other's (MAX_UNTRUSTED_STEP_GAIN: it cannot be told from a
    liar's), so the round is 2 steps long, the long delta keeps its own length and the short one is scaled 2x:
    (0.04 + 0.02) / 2 = 0.03."""
    for normalize, expect in ((False, plain_mean), (True, normalized)):
        f = Fleet(n=2, quorum=2, inner_steps=4, outer_lr=1.0, outer_momentum=0.0, robust="off",
                  step_normalize=normalize, principal=principal)
        f.islands[1].max_inner_steps = 1  # a weaker island: one step per round
        before = f.syncer.run.global_.copy()
        f.train(0)
        f.train(1)
        np.testing.assert_allclose(f.syncer.run.global_ - before, expect, rtol=1e-5)
        merge = [e for e in f.tape if e["event"] == "merge"][-1]
        assert merge["step_normalize"] is normalize
