import re
from types import SimpleNamespace

import pytest
from transformers import AutoModelForCausalLM

from yeto import YetoError
from yeto.backends.torch.lora import lora_config, torch_linears
from yeto.island.lora_targets import ATTENTION_REGEX, peft_target_modules, select_targets


def adapted_modules(model_dir, mode):
    from peft import get_peft_model

    model = AutoModelForCausalLM.from_pretrained(model_dir)
    linears, exclude = torch_linears(model)
    chosen = select_targets(linears, model.config, mode, exclude)
    peft_model = get_peft_model(model, lora_config(model, mode, r=4, alpha=8))
    wrapped = sorted(n.removeprefix("base_model.model.").removesuffix(".lora_A.default")
                     for n, _ in peft_model.named_modules() if n.endswith(".lora_A.default"))
    assert wrapped == chosen  # peft adapts exactly what the rule chose
    return chosen


def test_llama_attention_targets(tiny_model):
    chosen = adapted_modules(tiny_model("llama"), "auto")
    assert chosen == [f"model.layers.{i}.self_attn.{p}" for i in range(2)
                      for p in ("k_proj", "o_proj", "q_proj", "v_proj")]
    all_linear = adapted_modules(tiny_model("llama"), "all-linear")
    assert "model.layers.0.mlp.gate_proj" in all_linear and "lm_head" not in all_linear and len(all_linear) == 14


def test_lfm2_attention_matches_out_proj_but_not_conv(tiny_model):
    chosen = adapted_modules(tiny_model("lfm2"), "attention")
    assert "model.layers.1.self_attn.out_proj" in chosen
    assert not [n for n in chosen if ".conv." in n]
    assert len(chosen) == 8  # two attention layers x q, k, v, out


def test_moe_auto_never_adapts_routers(tiny_model):
    chosen = adapted_modules(tiny_model("qwen2_moe"), "auto")
    assert "model.layers.0.mlp.shared_expert.down_proj" in chosen and "model.layers.0.self_attn.q_proj" in chosen
    assert not [n for n in chosen if n.endswith(("gate", "shared_expert_gate"))]
    every = adapted_modules(tiny_model("qwen2_moe"), "all-linear")
    assert "model.layers.0.mlp.shared_expert_gate" not in every


def test_an_moe_models_targets_are_exact_names():
    """peft reads a bare `down_proj` on an MoE model as the fused routed experts too (test above, through peft)."""
    chosen = ["model.layers.0.mlp.shared_expert.down_proj", "model.layers.0.self_attn.q_proj"]
    assert peft_target_modules(chosen, chosen) == ["down_proj", "q_proj"]
    assert peft_target_modules(chosen, chosen, moe=True) == chosen


def test_moe_rule_on_per_expert_linears():
    cfg = SimpleNamespace(num_local_experts=4, model_type="mixtral")
    names = ["model.layers.0.self_attn.q_proj", "model.layers.0.block_sparse_moe.gate"]
    names += [f"model.layers.0.block_sparse_moe.experts.{e}.w{k}" for e in range(4) for k in (1, 2, 3)]
    linears = [(n, 64, 4 if n.endswith("gate") else 64) for n in names]
    assert select_targets(linears, cfg, "auto") == ["model.layers.0.self_attn.q_proj"]
    every = select_targets(linears, cfg, "all-linear")
    assert "model.layers.0.block_sparse_moe.gate" not in every and len(every) == 13


def test_attention_regex_rejects_conv_and_mlp():
    assert re.fullmatch(ATTENTION_REGEX, "model.layers.3.self_attn.out_proj")
    for n in ("model.layers.3.conv.out_proj", "model.layers.3.conv.in_proj", "model.layers.0.mlp.down_proj"):
        assert not re.fullmatch(ATTENTION_REGEX, n)


def test_bad_lora_arguments(tiny_model):
    model = AutoModelForCausalLM.from_pretrained(tiny_model("llama"))
    with pytest.raises(YetoError, match="unknown --lora-targets"):
        lora_config(model, "everything")
    with pytest.raises(YetoError, match="--lora-r"):
        lora_config(model, "auto", r=0)
