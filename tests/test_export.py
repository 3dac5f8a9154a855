"""`yeto export --merged`: a plain transformers checkpoint that computes what base + adapter computes."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from tests.conftest import DEMO_DATA

YETO = [sys.executable, "-m", "yeto"]


@pytest.fixture(scope="module")
def trained(tiny_model, tmp_path_factory):
    from yeto.backends.torch.island import TorchIsland, TrainConfig

    cfg = TrainConfig(model=str(tiny_model("llama")), data=str(DEMO_DATA), seq_len=64, batch_size=2, max_steps=3,
                      lora_r=4, lora_targets="all-linear", lora_dropout=0.0, lr=1e-2)
    island = TorchIsland(cfg, log=lambda s: None)
    for _ in range(3):
        island.step()
    return island, island.save(tmp_path_factory.mktemp("export") / "adapter")


def test_the_merged_checkpoint_loads_with_transformers_and_matches_base_plus_adapter(trained, tmp_path):
    from transformers import AutoTokenizer

    island, adapter = trained
    out = tmp_path / "merged"
    r = subprocess.run(YETO + ["export", str(adapter), "--merged", str(out)], capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert list(out.glob("*.safetensors")) and (out / "config.json").is_file()
    merged = merged_computes_base_plus_adapter(out, island, adapter)
    tokenizer = AutoTokenizer.from_pretrained(out)
    assert tokenizer.chat_template
    prompt = tokenizer("Hello", return_tensors="pt")
    generated = merged.generate(**prompt, max_new_tokens=3, do_sample=False)
    assert generated.shape[1] == prompt["input_ids"].shape[1] + 3


def test_export_refuses_a_non_empty_directory_and_another_base_in_one_line(trained, tiny_model, tmp_path):
    _, adapter = trained
    full = tmp_path / "full"
    full.mkdir()
    (full / "keep.txt").write_text("mine")
    cases = [(["export", str(adapter), "--merged", str(full)], "--force"),
             (["export", str(adapter), "--merged", str(tmp_path / "m"), "--model", str(tiny_model("lfm2"))],
              "is not the base this adapter was trained on"),
             (["export", str(tmp_path / "nowhere"), "--merged", str(tmp_path / "m2")], "no peft adapter")]
    for args, says in cases:
        r = subprocess.run(YETO + args, capture_output=True, text=True, timeout=300)
        lines = [line for line in r.stderr.splitlines() if line.strip()]
        assert r.returncode == 2 and len(lines) == 1 and says in lines[0], (args, r.stderr[-1500:])
    assert (full / "keep.txt").read_text() == "mine"


def test_init_adapter_starts_a_run_from_an_adapter_and_refuses_another_shape(trained, tmp_path):
    from yeto import YetoError
    from yeto.models.adapter import read_adapter
    from yeto.island.training import start_from_adapter
    from yeto.backends.torch.island import TorchIsland, TrainConfig

    source, adapter = trained
    island = TorchIsland(source.cfg, log=lambda s: None)
    fresh = island.adapter_state()
    saved = read_adapter(adapter)
    assert any(abs(fresh[k] - saved[k]).max() > 0 for k in saved)  # the run's own init is not the adapter
    start_from_adapter(island, str(adapter), log=lambda s: None)
    state = island.adapter_state()
    assert state.keys() == saved.keys() and all((state[k] == saved[k]).all() for k in saved)
    other = TrainConfig(**{**source.cfg.__dict__, "lora_r": 8})
    with pytest.raises(YetoError, match="its r is 4, this run's is 8"):
        start_from_adapter(TorchIsland(other, log=lambda s: None), str(adapter), log=lambda s: None)
    r = subprocess.run(YETO + ["train", "--model", source.cfg.model, "--data", str(DEMO_DATA), "--out",
                               str(tmp_path / "run"), "--lora-r", "8", "--seq-len", "64", "--init-adapter",
                               str(adapter), "--no-progress", "--max-steps", "1"],
                       capture_output=True, text=True, timeout=300)
    lines = [line for line in r.stderr.splitlines() if line.startswith("error:")]
    assert r.returncode == 2 and len(lines) == 1 and "cannot start this run" in lines[0], r.stderr[-1500:]
    assert "Traceback" not in r.stderr


def test_export_writes_the_models_own_dtype_unless_told_another(tiny_model, smollm2, tmp_path):
    import json

    from safetensors import safe_open
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from yeto.backends.torch.export import EXPORT_RECORD, export_merged
    from yeto.backends.torch.island import TorchIsland, TrainConfig

    half = tmp_path / "bf16-base"  # a base published in bfloat16, as most are
    AutoModelForCausalLM.from_pretrained(tiny_model("llama"), dtype=torch.bfloat16).save_pretrained(half)
    AutoTokenizer.from_pretrained(tiny_model("llama")).save_pretrained(half)
    cfg = TrainConfig(model=str(half), data=str(DEMO_DATA), seq_len=64, batch_size=2, max_steps=1, lora_r=4)
    adapter = TorchIsland(cfg, log=lambda s: None).save(tmp_path / "adapter")

    def written(out):
        with safe_open(str(next(out.glob("*.safetensors"))), framework="pt") as f:
            dtypes = {f.get_tensor(k).dtype for k in f.keys()}
        return dtypes, json.loads((out / "config.json").read_text())["dtype"], \
            json.loads((out / EXPORT_RECORD).read_text())["dtype"]

    r = subprocess.run(YETO + ["export", str(adapter), "--merged", str(tmp_path / "own")], capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert written(tmp_path / "own") == ({torch.bfloat16}, "bfloat16", "bfloat16")
    assert "bfloat16" in r.stdout  # the export says what it writes
    export_merged(adapter, tmp_path / "wide", dtype="float32", log=lambda s: None)
    assert written(tmp_path / "wide") == ({torch.float32}, "float32", "float32")
    # the packaged SmolLM2 is materialized in float32 from its GGUF; its own dtype is its hub checkpoint's
    from yeto.models.materialize import own_dtype

    assert own_dtype(smollm2) == "bfloat16"


def merged_computes_base_plus_adapter(out, island, adapter):
    """The exported checkpoint at `out`, loaded by transformers, computes what peft's base + `adapter` computes (and
    the adapter changes the logits, so the comparison has teeth); returns the loaded model."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    ids = torch.from_numpy(island.data.train.input_ids[:2])
    merged = AutoModelForCausalLM.from_pretrained(out).eval()
    base = AutoModelForCausalLM.from_pretrained(island.cfg.model)
    with torch.no_grad():
        plain = base(input_ids=ids).logits.clone()
        want = PeftModel.from_pretrained(base, str(adapter)).eval()(input_ids=ids).logits
        got = merged(input_ids=ids).logits
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert (want - plain).abs().max() > 1e-3
    return merged
