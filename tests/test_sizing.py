"""yeto.launch.sizing: the memory and speed model's terms add up and move the right way, a few absolute anchors, and
the LoRA parameter count it derives from a config equals what the island's own target rules pick on the real module
tree. (Predicted against measured: bench/sizing.py.)"""

from dataclasses import replace

import pytest

from yeto import YetoError
from yeto.models.catalog import CATALOG, Entry
from yeto.launch.gpus import APPLE_GPU_SHARE, GPUS, cpu, gpu
from yeto.launch.sizing import (IslandShape, base_bytes, memory, fits, largest_micro_batch, min_shape, model_size,
                         tokens_per_second, flops_per_token, NF4_BYTES)

SMOL = model_size("smollm2-135m")
LLAMA8 = model_size("llama3.1-8b")
LLAMA70 = model_size("llama3.1-70b")
QWEN_MOE = model_size("qwen3-30b-a3b")


def test_the_terms_add_up():
    m = memory(LLAMA8, IslandShape("H100"))
    assert m.total == m.base + m.lora + m.grads + m.optimizer + m.activations + m.context + m.slack
    assert min(m.base, m.lora, m.grads, m.optimizer, m.activations, m.context, m.slack) > 0
    assert m.optimizer == 2 * m.grads == 2 * m.lora  # fp32 adapter and gradient, AdamW's two fp32 moments


def test_absolute_anchors():
    assert memory(LLAMA8, IslandShape("H100")).base == pytest.approx(16.06e9, rel=0.01)  # 8.03B values x 2 bytes
    assert LLAMA8.lora_params("all-linear", 16) == 41_943_040  # peft's count for Llama-3-8B, r=16, all linears
    assert LLAMA8.lora_params("attention", 16) == 13_631_488
    assert not fits(LLAMA70, IslandShape("H100"))  # 141 GB of bf16 weights
    assert fits(LLAMA70, IslandShape("H100", base="nf4"))  # ~37 GB in nf4
    assert memory(LLAMA70, IslandShape("H100", base="nf4")).base < 45e9
    assert fits(LLAMA8, IslandShape("A100-80GB"))


def test_monotonic_in_micro_batch_and_seq_len():
    shape = IslandShape("H100")
    by_batch = [memory(LLAMA8, replace(shape, micro_batch=n)).activations for n in (1, 2, 4, 8)]
    by_seq = [memory(LLAMA8, replace(shape, seq_len=n)).activations for n in (256, 1024, 4096)]
    assert by_batch == sorted(by_batch) and len(set(by_batch)) == 4
    assert by_seq == sorted(by_seq) and len(set(by_seq)) == 3
    assert memory(LLAMA8, replace(shape, micro_batch=4)).base == memory(LLAMA8, shape).base


def test_checkpointing_lowers_activations_and_costs_flops():
    on, off = IslandShape("H100", checkpointing=True), IslandShape("H100", checkpointing=False)
    assert memory(LLAMA8, on).activations < memory(LLAMA8, off).activations / 3
    assert flops_per_token(LLAMA8, on) > flops_per_token(LLAMA8, off)
    assert tokens_per_second(LLAMA8, on) < tokens_per_second(LLAMA8, off)


def test_flops_count_is_stated_one():
    """4N without checkpointing (the frozen base gets no weight gradient), 6N with less the head's recompute (the loss
    calls the head outside the checkpointed blocks): N the matmul parameters."""
    short = IslandShape("H100", seq_len=16, lora_rank=1, targets="attention", checkpointing=False)
    n, head = LLAMA8.matmul_params, LLAMA8.hidden * LLAMA8.vocab
    assert flops_per_token(LLAMA8, short) == pytest.approx(4 * n, rel=0.01)
    assert flops_per_token(LLAMA8, replace(short, checkpointing=True)) == pytest.approx(6 * n - 2 * head, rel=0.01)
    compute_only = replace(GPUS["H100"], bandwidth_gbs=0.0)  # (16-token blocks are bandwidth-bound: the next test)
    assert tokens_per_second(LLAMA8, short, compute_only) == pytest.approx(989e12 * GPUS["H100"].mfu / (4 * n),
                                                                           rel=0.01)


def test_a_step_is_no_faster_than_the_memory_bandwidth_reads_the_base():
    """Each pass of a micro-batch reads the frozen base once (2 passes, 3 with checkpointing): on short blocks that
    read, not the FLOPs, sets the pace; on long ones the FLOPs do."""
    h100, mac = GPUS["H100"], GPUS["M2-16GB"]
    short = IslandShape("H100", seq_len=16, checkpointing=False)
    base = sum(base_bytes(SMOL, "bf16"))
    assert tokens_per_second(SMOL, short) == pytest.approx(16 / (2 * base / (h100.bandwidth_gbs * 1e9)), rel=1e-6)
    assert tokens_per_second(SMOL, replace(short, checkpointing=True)) == pytest.approx(
        16 / (3 * base / (h100.bandwidth_gbs * 1e9)), rel=1e-6)
    long = IslandShape("M2-16GB", seq_len=2048, checkpointing=False)
    assert tokens_per_second(SMOL, long) == pytest.approx(
        mac.bf16_tflops * 1e12 * mac.mfu / flops_per_token(SMOL, long), rel=1e-6)


def test_apple_silicon_covers_base_pro_max_and_ultra_of_m1_to_m4():
    """Every Apple chip tier in every memory size sold (a MacBook Air's M2, an M3 Pro were unknown), with Apple's
    bandwidth and the share of unified memory the GPU may wire."""
    apple = {name: g for name, g in GPUS.items() if g.apple}
    chips = {name.rsplit("-", 1)[0] for name in apple}
    tiers = {f"M{n}{tier}" for n in range(1, 5) for tier in ("", "-Pro", "-Max", "-Ultra")}
    assert chips == tiers - {"M4-Ultra"}  # (Apple made no M4 Ultra)
    assert {"M2-16GB", "M3-Pro-36GB", "M1-8GB", "M4-Max-36GB", "M3-Ultra-512GB", "M2-Max-64GB"} <= set(apple)
    for name, g in apple.items():
        ram_gb = int(name.rsplit("-", 1)[1].removesuffix("GB"))
        assert g.memory_gib == pytest.approx(ram_gb * APPLE_GPU_SHARE) and g.bandwidth_gbs > 0 and g.bf16_tflops > 0
    assert (GPUS["M2-16GB"].bandwidth_gbs, GPUS["M3-Pro-36GB"].bandwidth_gbs, GPUS["M4-Max-36GB"].bandwidth_gbs,
            GPUS["M4-Max-128GB"].bandwidth_gbs) == (100, 150, 410, 546)  # Apple's figures; a binned Max is slower
    for n in range(1, 5):  # within a generation a bigger tier is faster
        speeds = [max(g.bf16_tflops for name, g in apple.items() if name.rsplit("-", 1)[0] == f"M{n}{tier}")
                  for tier in ("", "-Pro", "-Max", "-Ultra") if f"M{n}{tier}" in chips]
        assert speeds == sorted(speeds) and len(set(speeds)) == len(speeds)
    assert min_shape(SMOL, gpus=["M2-8GB"]).describe() == "1x M2-8GB bf16"


def test_an_unknown_gpu_names_the_nearest_and_every_mac_in_one_line():
    with pytest.raises(YetoError) as e:
        gpu("m3-pro-36gb")
    text = str(e.value)
    assert "did you mean M3-Pro-36GB" in text and "M2-8/16/24GB" in text and "\n" not in text


def test_nf4_lowers_the_base():
    bf16, nf4 = memory(LLAMA8, IslandShape("H100")), memory(LLAMA8, IslandShape("H100", base="nf4"))
    assert nf4.base < bf16.base / 2.5
    linear = LLAMA8.linear_params  # the decoder's linears at NF4_BYTES, embeddings and head in bf16
    assert nf4.base == pytest.approx(linear * NF4_BYTES + (LLAMA8.total - linear) * 2, rel=0.001)


def test_fsdp_divides_the_blocks_and_ddp_replicates():
    one = memory(LLAMA70, IslandShape("H100"))
    ddp = memory(LLAMA70, IslandShape("H100", count=4, strategy="ddp"))
    fsdp2, fsdp4 = (memory(LLAMA70, IslandShape("H100", count=n, strategy="fsdp")) for n in (2, 4))
    assert ddp.base == one.base
    assert fsdp4.base < fsdp2.base < one.base
    outside = 2 * (LLAMA70.embedding + LLAMA70.head)
    assert fsdp2.base - outside == pytest.approx((one.base - outside) / 2, rel=0.05)
    assert fsdp4.lora == one.lora and fsdp4.activations == one.activations  # the adapter stays whole on each rank
    assert fits(LLAMA70, IslandShape("H100", count=4, strategy="fsdp"))


def test_largest_micro_batch_is_the_boundary_of_fits():
    shape = IslandShape("L4", seq_len=2048, checkpointing=False)
    n = largest_micro_batch(SMOL, shape)
    assert n >= 1
    assert fits(SMOL, replace(shape, micro_batch=n)) and not fits(SMOL, replace(shape, micro_batch=n + 1))
    assert largest_micro_batch(SMOL, replace(shape, checkpointing=True)) > n
    assert largest_micro_batch(LLAMA70, IslandShape("L4")) == 0


def test_min_shape_picks_the_smallest_fitting_island():
    s = min_shape(SMOL)
    assert s is not None and (s.count, s.base) == (1, "bf16")
    assert GPUS[s.gpu].memory_gib == min(g.memory_gib for g in GPUS.values() if not g.apple)
    big = min_shape(LLAMA70)
    assert fits(LLAMA70, big)
    smaller = [name for name, g in GPUS.items() if not g.apple and g.memory_gib * 1 < GPUS[big.gpu].memory_gib]
    assert all(not fits(LLAMA70, IslandShape(name, base="nf4")) for name in smaller)
    huge = min_shape(model_size("qwen3-235b-a22b"))
    assert huge is not None and huge.count > 1 and huge.strategy == "fsdp"
    assert min_shape(LLAMA70, gpus=["T4"]) is None
    assert min_shape(SMOL, gpus=["M2-Max-64GB"]).describe() == "1x M2-Max-64GB bf16"


def test_moe_keeps_every_expert_resident_and_computes_with_the_active():
    m = memory(QWEN_MOE, IslandShape("H200"))
    assert m.base == pytest.approx(2 * QWEN_MOE.total, rel=0.001)
    assert QWEN_MOE.matmul_params < QWEN_MOE.total / 5
    assert QWEN_MOE.routed_experts == pytest.approx(128 * 48 * 3 * 2048 * 768, rel=0.001)


def test_a_cpu_device_has_no_context_or_slack():
    dev = cpu(gflops=100.0, memory_gib=8.0)
    m = memory(SMOL, IslandShape("CPU", base="fp32", seq_len=256), dev)
    assert m.context == 0 and m.slack == 0
    assert tokens_per_second(SMOL, IslandShape("CPU", base="fp32", seq_len=256), dev) == pytest.approx(
        100e9 / flops_per_token(SMOL, IslandShape("CPU", base="fp32", seq_len=256)), rel=1e-6)


def test_every_gpu_has_its_allocators_slack_and_bool_dropout_masks():
    """A GPU (ROCm's too) keeps a dropout's mask as bools and pays the caching allocator's slack; the CPU neither."""
    shape = IslandShape("MI300X", base="fp32", seq_len=256)
    on_gpu, on_cpu = memory(SMOL, shape), memory(SMOL, shape, cpu(10.0, 64.0))
    assert on_gpu.slack > 0 and on_cpu.slack == 0
    assert on_cpu.activations > on_gpu.activations  # the masks: 4 bytes a value on the CPU, 1 on a GPU
    no_dropout = replace(shape, lora_dropout=0.0)
    assert memory(SMOL, no_dropout).activations == memory(SMOL, no_dropout, cpu(10.0, 64.0)).activations


UNSIZED = Entry("example/unpublished", "Example", "?", 4096, None, None)  # an alias whose config is not known offline


def test_bad_shapes_are_one_line_errors(monkeypatch):
    with pytest.raises(YetoError, match="unknown GPU"):
        memory(SMOL, IslandShape("V100"))
    with pytest.raises(YetoError, match="strategy"):
        memory(SMOL, IslandShape("H100", strategy="zero3"))
    with pytest.raises(YetoError, match="LoRA targets"):
        memory(SMOL, IslandShape("H100", targets="everything"))
    monkeypatch.setitem(CATALOG, "unsized", UNSIZED)
    with pytest.raises(YetoError, match="not known offline"):
        model_size("unsized")


def one_per_architecture() -> list[str]:
    seen, out = set(), []
    for alias, e in CATALOG.items():
        if e.config is not None and e.architecture not in seen:
            seen.add(e.architecture)
            out.append(alias)
    return out


@pytest.mark.parametrize("alias", one_per_architecture())
def test_lora_count_matches_the_islands_target_rules(alias):
    """The adapter size sizing derives from the config equals r * (in + out) summed over the linears
    yeto.island.lora_targets.select_targets picks on the model built on the meta device, for every rule."""
    pytest.importorskip("torch")
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM

    from yeto.models.catalog import hf_config
    from yeto.backends.torch.lora import torch_linears
    from yeto.island.lora_targets import select_targets

    cfg = hf_config(CATALOG[alias].config)
    with init_empty_weights():
        model = AutoModelForCausalLM.from_config(cfg)
    linears, exclude = torch_linears(model)
    shapes = {n: (i, o) for n, i, o in linears}
    size = model_size(alias)
    for rule in ("attention", "all-linear", "auto"):
        chosen = select_targets(linears, cfg.get_text_config(), rule, exclude)
        assert size.lora_params(rule, 8) == sum(8 * sum(shapes[n]) for n in chosen), rule
    decoder = [(n, i, o) for n, i, o in linears if n not in exclude and "vision" not in n and "projector" not in n]
    assert size.linear_params == sum(i * o for _, i, o in decoder)


def test_a_local_model_is_sized_from_its_own_linears(tiny_model):
    """A directory's adapter is counted from the linears of the model built on the meta device (here an MoE with
    shared experts, which the config-only shapes do not know), equal to what the island's rules pick."""
    import json

    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM

    from yeto.models.catalog import hf_config
    from yeto.backends.torch.lora import torch_linears
    from yeto.island.lora_targets import select_targets

    path = tiny_model("qwen2_moe")
    size = model_size(str(path))
    cfg = hf_config(json.loads((path / "config.json").read_text()))
    with init_empty_weights():
        model = AutoModelForCausalLM.from_config(cfg)
    linears, exclude = torch_linears(model)
    shapes = {n: (i, o) for n, i, o in linears}
    for rule in ("attention", "all-linear", "auto"):
        chosen = select_targets(linears, cfg, rule, exclude)
        assert size.lora_params(rule, 4) == sum(4 * sum(shapes[n]) for n in chosen), rule
    assert size.moe and size.active < size.total


def test_yeto_models_shows_each_alias_min_island(tiny_model, monkeypatch):
    import json

    from typer.testing import CliRunner

    from yeto.cli import app

    monkeypatch.setitem(CATALOG, "unsized", UNSIZED)
    r = CliRunner().invoke(app, ["models", "--json"])
    assert r.exit_code == 0, r.output
    rows = {row["alias"]: row for row in json.loads(r.output)}
    assert rows["unsized"]["min_shape"] is None and rows["unsized"]["total_params"] is None  # not sized offline
    for alias in ("smollm2-135m", "llama3.1-70b", "qwen3-235b-a22b"):
        s = rows[alias]["min_shape"]
        shape = IslandShape(s["gpu"], s["count"], s["strategy"], s["base"], targets="auto")
        assert fits(model_size(alias), shape) and s["label"] == shape.describe()
        assert s["memory_gib"] <= GPUS[s["gpu"]].memory_gib and s["tokens_per_second"] > 0
    assert rows["llama3.1-70b"]["min_shape"]["base"] == "nf4" and rows["qwen3-235b-a22b"]["min_shape"]["count"] > 1
    table = CliRunner().invoke(app, ["models"])
    assert "min island" in table.output and rows["smollm2-135m"]["min_shape"]["label"] in table.output
    r = CliRunner().invoke(app, ["models", "--model", str(tiny_model("llama")), "--json"])
    assert r.exit_code == 0 and json.loads(r.output)[0]["min_shape"]["count"] == 1


@pytest.mark.parametrize("kind", ["llama", "lfm2"])
@pytest.mark.parametrize("checkpointing", [False, True])
def test_activations_are_what_autograd_saves(tiny_model, kind, checkpointing):
    """The layers' activation term equals the bytes autograd keeps in yeto's loss forward on a tiny model (every
    tensor a saved-tensor hook sees, once per storage, the weights and the loss's vocab-wide tensors left out), within
    15%. (Whole steps' peaks, with the logits and transients: bench/sizing.py.)"""
    import torch
    from peft import get_peft_model

    from yeto.backends.torch.island import masked_loss
    from yeto.launch.gpus import cpu
    from yeto.backends.torch.lora import lora_config
    from yeto.backends.torch.losses import load_loss_function
    from yeto.models.materialize import load_model, resolve_model
    from yeto.launch.sizing import layer_activation_bytes

    path = tiny_model(kind)
    base = load_model(resolve_model(str(path)), "cpu", torch.float32, False, "none")
    if checkpointing:
        base.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        base.enable_input_require_grads()
    model = get_peft_model(base, lora_config(base, "all-linear", 8, 16.0, 0.05))
    model.train()
    seq, batch = 128, 2
    size = model_size(str(path))
    kept = {p.untyped_storage().data_ptr(): 0 for p in model.parameters()}

    def pack(t):
        vocab_wide = t.dim() > 0 and t.shape[-1] == size.vocab
        kept.setdefault(t.untyped_storage().data_ptr(), 0 if vocab_wide else t.untyped_storage().nbytes())
        return t

    ids = torch.randint(0, 1000, (batch, seq))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        masked_loss(model, ids, torch.ones_like(ids, dtype=torch.float32), load_loss_function("cross_entropy"))
    shape = IslandShape("CPU", base="fp32", seq_len=seq, micro_batch=batch, checkpointing=checkpointing, lora_rank=8)
    per_layer = layer_activation_bytes(size, shape, cpu(10.0, 8.0))
    # checkpointing keeps each layer's input in the forward; the recomputed layer lives in the backward only
    final_norm = 4 * size.hidden
    predicted = batch * seq * ((size.layers * size.hidden * 4 if checkpointing else sum(per_layer)) + final_norm)
    assert predicted == pytest.approx(sum(kept.values()), rel=0.15)


def test_sizing_a_catalog_alias_imports_no_torch():
    """`yeto models` and `yeto shape` size the catalog on an install without torch."""
    import subprocess
    import sys

    code = ("import sys; from yeto.launch.sizing import model_size, min_shape; min_shape(model_size('llama3.1-70b')); "
            "print('torch' in sys.modules or 'transformers' in sys.modules)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and r.stdout.strip() == "False", r.stderr
