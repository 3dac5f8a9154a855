"""A saved adapter is a plain peft directory: reloaded by peft, same logits, no key warnings."""

import json
import warnings

import torch
from transformers import AutoModelForCausalLM

from yeto.models.adapter import read_provenance
from yeto.backends.torch.island import TorchIsland, TrainConfig


def test_peft_round_trip(tiny_model, tmp_path):
    from peft import PeftModel

    from tests.conftest import DEMO_DATA

    cfg = TrainConfig(model=str(tiny_model("llama")), data=str(DEMO_DATA), seq_len=64, batch_size=2, max_steps=3,
                      lora_r=4, lora_targets="all-linear", lora_dropout=0.0)
    island = TorchIsland(cfg, log=lambda s: None)
    for _ in range(3):
        island.step()
    out = island.save(tmp_path / "adapter")
    assert sorted(p.name for p in out.iterdir() if p.suffix in (".json", ".safetensors")) == [
        "adapter_config.json", "adapter_model.safetensors", "yeto_run.json"]
    ids = torch.from_numpy(island.data.train.input_ids[:2])
    island.model.eval()
    with torch.no_grad():
        want = island.model(input_ids=ids).logits

    base = AutoModelForCausalLM.from_pretrained(cfg.model)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        reloaded = PeftModel.from_pretrained(base, str(out)).eval()
    bad = [str(w.message) for w in caught if any(k in str(w.message).lower() for k in ("missing", "unexpected"))]
    assert not bad, bad
    with torch.no_grad():
        got = reloaded(input_ids=ids).logits
    torch.testing.assert_close(got, want)
    # training moved the adapter away from its zero init, so this comparison has teeth
    with torch.no_grad(), reloaded.disable_adapter():
        assert (reloaded(input_ids=ids).logits - want).abs().max() > 1e-4

    state = island.adapter_state()
    assert all(k.startswith("base_model.model.") and ".lora_" in k for k in state)
    prov = read_provenance(out)
    assert prov["steps"] == 3 and prov["model"]["revision"].startswith("sha256:")
    assert json.loads((out / "yeto_run.json").read_text()) == prov
