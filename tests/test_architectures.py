"""The architecture matrix, torch side: for each architecture class of the catalog, a tiny random model of that class
(tests/conftest.py `ARCHITECTURES`: two layers, the real config's structure) trains two steps, saves an adapter that
peft reloads to the same logits, and gets the adapters the target rules document. The MLX side is in
tests/test_mlx.py (name parity and loss on the same classes)."""

from __future__ import annotations

import re
import warnings

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from tests.conftest import ARCHITECTURES, DEMO_DATA
from tests.test_lora import adapted_modules
from yeto.backends.torch.island import TorchIsland, TrainConfig
from yeto.models.catalog import num_experts
from yeto.backends.torch.lora import torch_linears
from yeto.island.lora_targets import ATTENTION_REGEX, EXPERT_REGEX, NON_TEXT_REGEX, is_router

CLASSES = sorted(ARCHITECTURES)
TRAIN = dict(seq_len=64, batch_size=2, max_steps=2, lora_r=4, lora_dropout=0.0, lr=1e-2, warmup_steps=1)


@pytest.mark.parametrize("kind", CLASSES)
def test_trains_two_steps_and_the_adapter_reloads_in_peft(tiny_model, kind, tmp_path):
    from peft import PeftModel

    path = tiny_model(kind)
    island = TorchIsland(TrainConfig(model=str(path), data=str(DEMO_DATA), **TRAIN), log=lambda s: None)
    start = island.adapter_state()
    losses = [island.step()["loss"] for _ in range(TRAIN["max_steps"])]
    assert np.isfinite(losses).all()
    trained = island.adapter_state()
    assert sorted(trained) == sorted(start) and any(not np.array_equal(trained[k], start[k]) for k in start)
    out = island.save(tmp_path / "adapter")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        reloaded = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(path), str(out)).eval()
    assert not [w for w in caught if "missing" in str(w.message).lower() or "unexpected" in str(w.message).lower()]
    ids = torch.from_numpy(island.data.train.input_ids[:2])
    island.model.eval()
    with torch.no_grad():
        want = island.model(input_ids=ids).logits
        got = reloaded(input_ids=ids).logits
        assert torch.allclose(got, want, atol=1e-5, rtol=1e-4)
        with reloaded.disable_adapter():  # the trained adapter is what makes them equal
            assert (reloaded(input_ids=ids).logits - want).abs().max() > 1e-4


def linears_of(path):
    model = AutoModelForCausalLM.from_pretrained(path)
    linears, exclude = torch_linears(model)
    text = [n for n, _, _ in linears if n not in exclude and not re.fullmatch(NON_TEXT_REGEX, n)]
    return model, linears, text


@pytest.mark.parametrize("kind", CLASSES)
def test_target_rules_as_documented(tiny_model, kind):
    """attention: every attention projection of the decoder and nothing else; all-linear: every linear but the head,
    routers and a vision tower; auto: attention on a dense model, on an MoE every linear outside the routed experts,
    never a router."""
    path = tiny_model(kind)
    model, linears, text = linears_of(path)
    moe = num_experts(model.config.get_text_config()) > 0
    attention = sorted(n for n in text if re.fullmatch(ATTENTION_REGEX, n))
    layers = model.config.get_text_config().num_hidden_layers
    kinds = getattr(model.config.get_text_config(), "layer_types", None) or ["full_attention"] * layers
    with_attention = sum(k != "conv" for k in kinds)
    per_layer = 2 if any(n.endswith("qkv_proj") for n in attention) else 4  # phi3 fuses q, k and v
    assert len(attention) == with_attention * per_layer  # each attention layer's projections, conv blocks' not
    assert adapted_modules(path, "attention") == attention
    every = adapted_modules(path, "all-linear")
    outs = {n: o for n, _, o in linears}
    assert every == sorted(n for n in text if not is_router(n, outs[n], model.config))
    assert set(attention) < set(every) or moe  # the MLP and conv projections too (an MoE's experts are no linears)
    auto = adapted_modules(path, "auto")
    if not moe:
        assert auto == attention
    else:
        assert auto == sorted(n for n in every if not re.fullmatch(EXPERT_REGEX, n))
        routers = [n for n, _ in model.named_parameters() if re.search(r"\.(gate|router)\.weight$", n)]
        assert routers and not [r for r in routers if r.removesuffix(".weight") in auto]  # routers exist, untouched
        experts = [n for n, _ in model.named_parameters() if ".experts." in n]
        assert experts and not [n for n in auto if ".experts." in n]
    assert not [n for n in every if re.fullmatch(NON_TEXT_REGEX, n)]
