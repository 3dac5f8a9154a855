"""The MLX island: LoRA parity with peft, names, data, shim, adapters that torch loads, the same optimizer step and
loss as the torch island, and the flags it refuses."""

import ctypes
import json
import subprocess
import sys
import warnings

import numpy as np
import pytest
import torch

mx = pytest.importorskip("mlx.core")

from tests.conftest import ARCHITECTURES, DEMO_DATA, REPO  # noqa: E402
from yeto import YetoError  # noqa: E402
from yeto.island.data import Blocks  # noqa: E402
from yeto.backends.torch.island import TorchIsland, TrainConfig  # noqa: E402
from yeto.backends.torch.losses import sft_loss  # noqa: E402
from yeto.backends.mlx.compat import NOT_YET, load_mlx_model, mlx_config_shim, mlx_implements  # noqa: E402
from yeto.backends.mlx.lora import LoRALinear, to_mlx_path, to_peft_name  # noqa: E402
from yeto.backends.parity import name_parity  # noqa: E402


def test_lora_linear_matches_peft():
    import mlx.nn as nn
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)

    class Tiny(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = torch.nn.Linear(24, 12, bias=False)

        def forward(self, x):
            return self.proj(x)

    peft_model = get_peft_model(Tiny(), LoraConfig(r=4, lora_alpha=12, target_modules=["proj"], lora_dropout=0.0))
    layer = peft_model.base_model.model.proj
    torch.nn.init.normal_(layer.lora_B["default"].weight)  # a non-zero B, so the LoRA path counts
    A, B = layer.lora_A["default"].weight.detach(), layer.lora_B["default"].weight.detach()
    W = layer.base_layer.weight.detach()
    x = torch.randn(3, 5, 24)
    want = peft_model(x).detach().numpy()

    base = nn.Linear(24, 12, bias=False)
    base.weight = mx.array(W.numpy())
    ours = LoRALinear(base, r=4, alpha=12)
    assert ours.lora_A.shape == tuple(A.shape) == (4, 24) and ours.lora_B.shape == tuple(B.shape) == (12, 4)
    assert ours.scale == layer.scaling["default"] == 3.0
    ours.lora_A, ours.lora_B = mx.array(A.numpy()), mx.array(B.numpy())
    np.testing.assert_allclose(np.array(ours(mx.array(x.numpy()))), want, atol=1e-5, rtol=1e-5)


def test_lora_init_is_peft_like():
    import mlx.nn as nn

    mx.random.seed(0)
    ours = LoRALinear(nn.Linear(400, 30), r=64, alpha=16)
    a = np.array(ours.lora_A)
    bound = 1 / np.sqrt(400)
    assert np.abs(a).max() <= bound and np.abs(a).max() > 0.95 * bound  # uniform(-1/sqrt(in), 1/sqrt(in))
    assert abs(a.std() - bound / np.sqrt(3)) < 0.05 * bound
    assert not np.array(ours.lora_B).any()


def test_canonical_names_both_ways():
    path = "model.layers.3.self_attn.q_proj.lora_A"
    name = "base_model.model.model.layers.3.self_attn.q_proj.lora_A.default.weight"
    assert to_peft_name(path) == name and to_mlx_path(name) == path
    from yeto.backends.mlx.lora import RENAMES

    gemma = "language_model.model.layers.3.self_attn.q_proj.lora_A"  # mlx-lm's Gemma 3; transformers': model.language_
    assert to_peft_name(gemma, RENAMES["gemma3"]) == ("base_model.model.model.language_model.layers.3.self_attn.q_proj"
                                                      ".lora_A.default.weight")
    assert to_mlx_path(to_peft_name(gemma, RENAMES["gemma3"]), RENAMES["gemma3"]) == gemma
    dense = "model.layers.0.feed_forward.down_proj.lora_B"  # mlx-lm's LFM2-MoE dense MLP; transformers': w2
    assert to_peft_name(dense, RENAMES["lfm2_moe"]).endswith("layers.0.feed_forward.w2.lora_B.default.weight")
    with pytest.raises(ValueError):
        to_mlx_path("model.layers.3.self_attn.q_proj.weight")


# the architecture matrix (tests/conftest.py ARCHITECTURES: one tiny model per class of the catalog), MLX side
MLX_CLASSES = sorted(kind for kind in ARCHITECTURES if kind not in NOT_YET)


@pytest.mark.parametrize("kind", MLX_CLASSES)
def test_name_parity_on_tiny_configs(tiny_model, kind):
    for mode in ("attention", "all-linear", "auto"):
        n_torch, n_mlx, problems = name_parity(str(tiny_model(kind)), mode, r=4)
        assert problems == [] and n_torch == n_mlx > 0


def test_name_parity_on_smollm2_and_the_script(smollm2):
    n_torch, n_mlx, problems = name_parity("smollm2-135m")
    assert (n_torch, n_mlx, problems) == (240, 240, [])
    r = subprocess.run([sys.executable, "scripts/check_name_parity.py", "--model", "smollm2-135m"], cwd=REPO,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and "torch 240 trainable tensors, MLX 240" in r.stdout, r.stderr[-2000:]


def test_config_shim_flattens_rope_parameters():
    cfg = {"model_type": "llama", "rope_parameters": {"rope_theta": 100000.0, "rope_type": "default"}}
    assert mlx_config_shim(cfg) == {"rope_theta": 100000.0}
    assert mlx_config_shim({"rope_theta": 5.0, "rope_parameters": {"rope_theta": 5.0}}) == {}
    scaled = mlx_config_shim({"rope_parameters": {"rope_theta": 5e5, "rope_type": "llama3", "factor": 8.0}})
    assert scaled["rope_theta"] == 5e5 and scaled["rope_scaling"] == {"type": "llama3", "rope_type": "llama3",
                                                                      "factor": 8.0}
    # Gemma 3: rope per layer type, and the sliding-window pattern transformers 5 writes as layer_types only
    gemma = {"model_type": "gemma3_text", "layer_types": ["sliding_attention"] * 5 + ["full_attention"],
             "rope_parameters": {"full_attention": {"rope_theta": 1e6}, "sliding_attention": {"rope_theta": 1e4}}}
    assert mlx_config_shim(gemma) == {"rope_theta": 1e6, "rope_local_base_freq": 1e4, "sliding_window_pattern": 6}
    irregular = ["sliding_attention", "full_attention", "full_attention"]
    assert "sliding_window_pattern" not in mlx_config_shim({"layer_types": irregular})
    assert mlx_config_shim({"model_type": "qwen3_moe", "num_local_experts": 8}) == {"num_experts": 8}


def greedy_mlx(model, ids, n):
    ids = list(ids)
    for _ in range(n):
        logits = model(mx.array([ids]))
        ids.append(int(mx.argmax(logits[0, -1]).item()))
    return ids


def test_shimmed_smollm2_generates_what_torch_generates(smollm2, tokenizer):
    import mlx_lm
    from transformers import AutoModelForCausalLM

    text = tokenizer.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                         tokenize=False, add_generation_prompt=True)
    prompt = tokenizer(text, add_special_tokens=False)["input_ids"]
    torch_model = AutoModelForCausalLM.from_pretrained(smollm2.path).eval()
    with torch.no_grad():
        want = torch_model.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False)[0].tolist()
    got = greedy_mlx(load_mlx_model(smollm2.path), prompt, 8)
    assert got == want and "Paris" in tokenizer.decode(got[len(prompt):])
    # without the shim mlx-lm uses its default rope theta and the answer changes
    unshimmed, _ = mlx_lm.utils.load_model(__import__("pathlib").Path(smollm2.path))
    assert greedy_mlx(unshimmed, prompt, 8) != want


def mlx_island(tiny_model, kind="llama", **kw):
    from yeto.backends.mlx.island import MLXIsland

    cfg = TrainConfig(model=str(tiny_model(kind)), data=str(DEMO_DATA), seq_len=64, batch_size=2, max_steps=4, lora_r=4,
                      lora_dropout=0.0, lr=1e-2, warmup_steps=1, **kw)
    return MLXIsland(cfg, log=lambda s: None)


def test_same_blocks_as_the_torch_island(tiny_model, tmp_path):
    cfg = TrainConfig(model=str(tiny_model("llama")), data=str(DEMO_DATA), seq_len=64, batch_size=2, lora_r=4,
                      island_id=1, num_islands=2)
    t = TorchIsland(cfg, log=lambda s: None)
    m = mlx_island(tiny_model, island_id=1, num_islands=2)
    np.testing.assert_array_equal(t.data.train.input_ids, m.data.train.input_ids)
    np.testing.assert_array_equal(t.data.train.loss_mask, m.data.train.loss_mask)
    assert sorted(t.adapter_state()) == sorted(m.adapter_state())
    assert {k: v.shape for k, v in t.adapter_state().items()} == {k: v.shape for k, v in m.adapter_state().items()}
    # same fragments on both backends, and an MLX adapter packs, writes and reads back exactly
    from safetensors.numpy import load_file

    from yeto.models.adapter import peft_file_name, write_adapter
    from yeto.sync.wire.layout import build_layout, pack_fragment, unpack_fragment

    lt, lm = build_layout(t.adapter_state(), 1000), build_layout(m.adapter_state(), 1000)
    assert lt == lm and len(lm.fragments) > 1
    state = m.adapter_state()
    for f in lm.fragments:
        back = unpack_fragment(lm, f.index, pack_fragment(lm, f.index, state))
        assert all(np.array_equal(back[n], state[n]) for n in f.names)
    out = write_adapter(tmp_path / "a", state, m.adapter_config(), m.record())
    saved = load_file(out / "adapter_model.safetensors")
    assert all(np.array_equal(saved[peft_file_name(k)], v) for k, v in state.items())
    # same weights -> same loss: the MLX loss is the torch sft_loss re-derived
    m.load_adapter_state({k: v + 0.01 for k, v in t.adapter_state().items()})
    t.load_adapter_state({k: v + 0.01 for k, v in t.adapter_state().items()})
    assert m.evaluate() == pytest.approx(t.evaluate(), rel=1e-4)


def test_mlx_adapter_loads_in_torch_with_matching_logits(tiny_model, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    m = mlx_island(tiny_model)
    before = m.evaluate()
    for _ in range(4):
        m.step()
    assert m.evaluate() < before  # it learns
    out = m.save(tmp_path / "adapter")
    ids = m.data.train.input_ids[:2]
    m.model.eval()
    mlx_logits = np.array(m.model(mx.array(ids)))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        tuned = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(m.cfg.model), str(out)).eval()
    assert not [w for w in caught if "missing" in str(w.message).lower() or "unexpected" in str(w.message).lower()]
    with torch.no_grad():
        torch_logits = tuned(input_ids=torch.from_numpy(ids)).logits.numpy()
    np.testing.assert_allclose(torch_logits, mlx_logits, atol=2e-4, rtol=1e-4)
    with torch.no_grad(), tuned.disable_adapter():
        assert np.abs(tuned(input_ids=torch.from_numpy(ids)).logits.numpy() - mlx_logits).max() > 1e-3
    cfg = json.loads((out / "adapter_config.json").read_text())
    assert cfg["r"] == 4 and cfg["peft_type"] == "LORA"


def test_heterogeneous_fleet_torch_and_mlx(tiny_model, tmp_path):
    from tests.test_fleet import ENV, finish, loss_token_weights, syncer
    from yeto.launch.local import free_port
    from yeto.sync.shell.tape import read_tape

    model, port, s_out = tiny_model("llama"), free_port(), tmp_path / "syncer"
    common = ["--model", str(model), "--data", str(DEMO_DATA), "--syncer", f"127.0.0.1:{port}", "--islands", "2",
              "--seq-len", "64", "--batch-size", "2", "--lora-r", "4", "--no-progress"]
    procs = {"syncer": syncer(port, s_out, "--islands", 2, "--quorum", 2, "--outer-steps", 3, "--inner-steps", 4)}
    procs["torch"] = subprocess.Popen([sys.executable, "-m", "yeto.backends.torch", "--island-id", "0",
                                       "--threads", "1",
                                       "--out", str(tmp_path / "t"), *common],
                                      cwd=REPO, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    procs["mlx"] = subprocess.Popen([sys.executable, "-m", "yeto.backends.mlx", "--island-id", "1",
                                     "--out", str(tmp_path / "m"), *common],
                                    cwd=REPO, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    outs = finish(procs)
    assert all(code == 0 for code, _ in outs.values()), {k: v[1][-2500:] for k, v in outs.items()}
    from yeto.backends.mlx.compat import fast_blas_library

    if sys.platform.startswith("linux") and fast_blas_library():  # the MLX island re-exec'd itself with OpenBLAS
        assert "OpenBLAS preloaded" in outs["mlx"][1]
    events = read_tape(s_out)
    joins = {e["island"]: e["backend"] for e in events if e["event"] == "join"}
    assert joins == {0: "torch", 1: "mlx"}
    deltas = {(e["round"], e["island"]): e for e in events if e["event"] == "delta"}
    merges = [e for e in events if e["event"] == "merge"]
    assert len(merges) == 3
    for m in merges:
        assert m["responders"] == [0, 1]
        assert m["weights"] == pytest.approx(loss_token_weights(m, deltas))
    from peft import PeftModel
    from safetensors.numpy import load_file
    from transformers import AutoModelForCausalLM

    PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(model), str(s_out / "adapter"))
    merged = load_file(s_out / "adapter" / "adapter_model.safetensors")
    for d in ("t", "m"):  # both islands applied every broadcast and ended on the merged adapter
        mine = load_file(tmp_path / d / "adapter" / "adapter_model.safetensors")
        assert sorted(mine) == sorted(merged)
        assert max(float(np.abs(mine[k] - merged[k]).max()) for k in merged) < 1e-6


# ----------------------------------------------------------------------------- the same step and loss as torch

# Parity tolerances (fp32 on both sides). The engines sum in different orders, so gradients differ by ~1e-6
# relative. Adam divides each element's gradient by its own RMS, so an element whose gradient is near eps (1e-8)
# turns that noise into a visible fraction of its lr-sized step: measured, one element differs by 1.6e-4 after
# step 1 (6% of that step's lr, 2.5e-3) and 1.5e-4 after 10; the whole update (the pseudo-gradient a syncer
# merges) by 1.1e-3 and 3.2e-4 relative. Each part broken on the MLX side fails (measured update gaps, relative,
# after 1 / 10 steps): MLX's default AdamW without bias correction 2.2 / 5.5, no weight decay 0.063 / 0.23, no
# clipping 0.0056 / 0.21 (Adam's first step is scale-free), a constant lr 3.0 / 1.3, eps dropped 0.0075 / 0.002.
PARITY = dict(seq_len=64, batch_size=2, max_steps=10, lora_r=4, lora_dropout=0.0, lr=1e-2, warmup_steps=4,
              min_lr_ratio=0.1, weight_decay=1.0, max_grad_norm=0.1)
STEP_ATOL = 0.1 * PARITY["lr"]  # a few eps-regime elements at most, never a step's worth anywhere
STEP_RTOL = 5e-3  # |update_mlx - update_torch| / |update_torch| over the whole adapter
LOSS_RTOL = 2e-5  # fp32 logits summed in other orders; granite's x20 logit scaling makes it ~4e-6 (measured)


def twins(model_path, **kw):
    """A torch and an MLX island of one config, holding the same non-zero adapter (so A and B both learn)."""
    from yeto.backends.mlx.island import MLXIsland

    cfg = TrainConfig(model=str(model_path), data=str(DEMO_DATA), **{**PARITY, **kw})
    t, m = TorchIsland(cfg, log=lambda s: None), MLXIsland(cfg, log=lambda s: None)
    rng = np.random.default_rng(0)
    start = {k: (v if "lora_A" in k else rng.normal(0, 0.05, v.shape)).astype(np.float32)
             for k, v in t.adapter_state().items()}
    t.load_adapter_state(start)
    m.load_adapter_state(start)
    return t, m, start


def step_gap(t, m, start) -> tuple[float, float]:
    """(max abs difference of the adapters, |update_mlx - update_torch| / |update_torch|)."""
    ts, ms = t.adapter_state(), m.adapter_state()
    gap = max(float(np.abs(ts[k] - ms[k]).max()) for k in ts)
    du = np.sqrt(sum(float(((ms[k] - ts[k]) ** 2).sum()) for k in ts))
    dt = np.sqrt(sum(float(((ts[k] - start[k]) ** 2).sum()) for k in ts))
    return gap, du / dt


def test_one_and_ten_steps_match_torch(tiny_model):
    t, m, start = twins(tiny_model("llama"))
    gaps, lrs = {}, []
    for n in range(1, PARITY["max_steps"] + 1):
        st, sm = t.step(), m.step()
        assert sm["lr"] == pytest.approx(st["lr"], rel=1e-12)  # LambdaLR's lr * lr_lambda(s)
        lrs.append(st["lr"])
        assert sm["loss"] == pytest.approx(st["loss"], rel=LOSS_RTOL)  # the loss on the same batch
        # (the same adapter at step 1; after it the eps-regime elements above move the norm by up to 2e-3)
        assert sm["grad_norm"] == pytest.approx(st["grad_norm"], rel=1e-5 if n == 1 else 1e-2)
        assert st["grad_norm"] > 2 * PARITY["max_grad_norm"]  # clipping is active every step
        gaps[n] = step_gap(t, m, start)
    assert lrs[0] < lrs[3] == PARITY["lr"] > lrs[-1]  # warm-up, then the cosine decay
    for n in (1, 10):
        gap, rel = gaps[n]
        print(f"after {n} steps: max abs {gap:.3g}, relative {rel:.3g}")
        assert gap < STEP_ATOL and rel < STEP_RTOL, f"after {n} steps: max abs {gap:.3g}, relative {rel:.3g}"
    assert t.evaluate() == pytest.approx(m.evaluate(), rel=LOSS_RTOL)


def torch_plain_loss(t, blocks: Blocks) -> float:
    """The torch loss with the decoder's last hidden state through the bare LM head (no soft-capping or scaling)."""
    base = t.model.get_base_model()
    ids, mask = torch.from_numpy(blocks.input_ids), torch.from_numpy(blocks.loss_mask)
    sel = mask[:, 1:] > 0
    with torch.no_grad():
        hidden = getattr(base, base.base_model_prefix)(input_ids=ids).last_hidden_state
        logits = base.get_output_embeddings()(hidden[:, :-1][sel])
        return float(sft_loss(logits, ids[:, 1:][sel], mask[:, 1:][sel]))


# tiny models whose logits the model transforms after the head, each strongly enough to move the loss
LOGIT_TRANSFORMS = {
    "gemma2": dict(head_dim=16, final_logit_softcapping=1.0, initializer_range=0.2),  # logits of ~1.6 std: capped
    "granite": dict(logits_scaling=0.05),
    "cohere": dict(logit_scale=8.0),
}
OTHER_LAYOUTS = {"gpt_bigcode": dict(n_embd=64, n_layer=2, n_head=4, n_inner=128)}  # (yeto's auto rule: no match)


@pytest.fixture(scope="session")
def logit_model(tmp_path_factory, tokenizer):
    from transformers import AutoConfig, AutoModelForCausalLM

    def make(kind):
        shape = OTHER_LAYOUTS.get(kind) or dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                                num_attention_heads=4, num_key_value_heads=2, **LOGIT_TRANSFORMS[kind])
        cfg = AutoConfig.for_model(kind, vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id,
                                   eos_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.bos_token_id, **shape)
        torch.manual_seed(0)
        path = tmp_path_factory.mktemp(f"tiny-{kind}")
        AutoModelForCausalLM.from_config(cfg).save_pretrained(path)
        tokenizer.save_pretrained(path)
        return path

    return make


@pytest.mark.parametrize("kind", sorted({*MLX_CLASSES, "qwen2_moe", "gpt_bigcode", *LOGIT_TRANSFORMS}))
def test_loss_matches_torch(tiny_model, logit_model, kind):
    """Same adapter, same blocks: the same loss on every class of the catalog (the architecture matrix: and the same
    first step), on architectures whose decoder is not `model.model` (GPTBigCode's is `model.transformer`) and whose
    logits are soft-capped or scaled after the head."""
    special = kind in LOGIT_TRANSFORMS or kind in OTHER_LAYOUTS
    t, m, _ = twins(logit_model(kind) if special else tiny_model(kind),
                    lora_targets="all-linear" if kind in OTHER_LAYOUTS else "auto")
    assert m.decoder is not None  # the LM head runs on the loss rows only
    batch = Blocks(t.data.train.input_ids[:4], t.data.train.loss_mask[:4])
    want = t.evaluate(batch)
    assert m.evaluate(batch) == pytest.approx(want, rel=LOSS_RTOL)
    assert m.evaluate() == pytest.approx(t.evaluate(), rel=LOSS_RTOL)
    if kind in LOGIT_TRANSFORMS:  # the transform matters: a loss without it would fail the comparison above
        assert abs(torch_plain_loss(t, batch) - want) > 100 * LOSS_RTOL * want
    if kind in ARCHITECTURES:  # the same gradient: MoE routing, sliding windows and conv blocks included
        st, sm = t.step(), m.step()
        assert sm["loss"] == pytest.approx(st["loss"], rel=LOSS_RTOL)
        assert sm["grad_norm"] == pytest.approx(st["grad_norm"], rel=1e-5)


def test_the_loss_rows_path_is_taken_only_where_it_gives_the_models_own_logits():
    import mlx.nn as nn

    from yeto.backends.mlx.island import find_decoder, loss_rows_decoder

    class Body(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(32, 8)
            self.layers = [nn.Linear(8, 8), nn.Linear(8, 8)]

        def __call__(self, ids):
            x = self.embed(ids)
            for layer in self.layers:
                x = layer(x)
            return x

    class Toy(nn.Module):  # shaped like an mlx-lm model: `layers` is its decoder's, which sits elsewhere
        def __init__(self, after):
            super().__init__()
            self.backbone = Body()
            self.lm_head = nn.Linear(8, 11)
            self.after = after

        @property
        def layers(self):
            return self.backbone.layers

        def __call__(self, ids):
            return self.after(self.lm_head(self.backbone(ids)))

    capped = Toy(lambda z: mx.tanh(z / 0.1) * 0.1)  # soft-capping: row by row, so the model's own head does it
    assert find_decoder(capped) is capped.backbone and loss_rows_decoder(capped) is capped.backbone
    mixed = Toy(lambda z: mx.cumsum(z, axis=1))  # something that mixes positions after the decoder: not cut
    assert find_decoder(mixed) is mixed.backbone and loss_rows_decoder(mixed) is None
    assert type(mixed.backbone) is Body  # the probe left the decoder as it was


def test_full_logits_dtype_and_device_are_honoured(tiny_model):
    import mlx.nn as nn

    rows_only = mlx_island(tiny_model)
    full = mlx_island(tiny_model, full_logits=True, device="cpu")
    assert full.decoder is None and rows_only.decoder is not None
    full.load_adapter_state(rows_only.adapter_state())
    assert full.evaluate() == pytest.approx(rows_only.evaluate(), rel=1e-6)
    half = mlx_island(tiny_model, dtype="bfloat16")
    linears = [mod for _, mod in half.model.named_modules() if isinstance(mod, nn.Linear)]
    assert linears and all(mod.weight.dtype == mx.bfloat16 for mod in linears)
    from yeto.backends.mlx.lora import lora_state

    assert all(v.dtype == mx.float32 for v in lora_state(half.model).values())  # the adapter stays fp32, as peft
    assert np.isfinite(half.step()["loss"])


OPENBLAS_HERE = hasattr(ctypes.CDLL(None), "openblas_set_num_threads")


@pytest.mark.parametrize("flag, value, says", [
    ("dtype", "float64", "unknown --dtype"),
    ("device", "cuda", "--device cuda is the torch island's"),
    ("device", "mps", "--device mps is the torch island's"),
    ("gradient_checkpointing", True, "--gradient-checkpointing is the torch island's"),
    ("threads", -1, "--threads must be at least 0"),
    pytest.param("threads", 2, "does not run on OpenBLAS",
                 marks=pytest.mark.skipif(OPENBLAS_HERE, reason="OpenBLAS is loaded in this process")),
    ("base_quantization", "nf4", "--base-quantization is the torch island's"),
    ("shard", "fsdp", "--shard fsdp is for torchrun"),
    ("micro_batch_size", "2", "--micro-batch-size is the torch island's"),
    ("loss_function", "mymod:fn", "cross_entropy only"),
    ("max_grad_norm", -1.0, "--max-grad-norm must be above 0"),
    ("grad_accum", 0, "--grad-accum must be at least 1"),
])
def test_mlx_island_refuses_flags_it_cannot_honour(flag, value, says):
    from yeto.backends.mlx.island import MLXIsland

    # a model that does not exist: the refusal comes before anything loads
    with pytest.raises(YetoError, match=says):
        MLXIsland(TrainConfig(model="/nonexistent/model", **{flag: value}), log=lambda s: None)


def test_mlx_island_cli_refuses_in_one_line(tmp_path):
    r = subprocess.run([sys.executable, "-m", "yeto.backends.mlx", "--device", "cuda", "--out", str(tmp_path / "o"),
                        "--no-progress"], cwd=REPO, capture_output=True, text=True, timeout=120,
                       env={**__import__("os").environ, "YETO_NO_FAST_BLAS": "1"})
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert r.returncode == 2 and len(lines) == 1 and "--device cuda" in lines[0], r.stderr[-2000:]
    assert "Traceback" not in r.stderr


@pytest.mark.parametrize("kind", sorted(kind for kind in ARCHITECTURES if kind in NOT_YET))
def test_a_class_the_mlx_island_does_not_train_yet_is_refused(tiny_model, kind):
    from yeto.backends.mlx.island import MLXIsland

    assert mlx_implements(kind) is False
    with pytest.raises(YetoError, match=f"does not train model_type '{kind}' yet .*with the torch island"):
        MLXIsland(TrainConfig(model=str(tiny_model(kind)), data=str(DEMO_DATA), seq_len=64), log=lambda s: None)


def test_an_architecture_mlx_lm_lacks_is_one_line(tiny_model, tmp_path):
    import shutil

    path = tmp_path / "exotic"
    shutil.copytree(tiny_model("llama"), path)
    cfg = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**cfg, "model_type": "no_such_architecture"}))
    with pytest.raises(YetoError, match="no implementation of model_type 'no_such_architecture'"):
        load_mlx_model(path)
    assert mlx_implements("no_such_architecture") is False and mlx_implements("llama") is True
