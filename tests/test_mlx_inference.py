"""`yeto generate` and `yeto export` on a Mac's install, `yeto[mlx]` without torch: run as real subprocesses whose
`sitecustomize` blocks torch and peft (tests/test_lean.py's blocker), on MLX's CPU backend with OpenBLAS preloaded.
What they give is checked against the torch backend's, in this (torch-having) test process."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.conftest import DEMO_DATA, REPO
from tests.test_export import merged_computes_base_plus_adapter
from tests.test_lean import BLOCKED, torchless_env
from yeto.backends import MLX_MODULES

TIMEOUT_S = 300
PROMPTS = ("What is the capital of Peru?", "Hello")
NEW_TOKENS = 6
STEPS, LR = 20, 0.1  # enough for the adapted tiny model's greedy answers to differ from the base's


@pytest.fixture(scope="module")
def trained(tiny_model, tmp_path_factory):
    """A peft adapter of a tiny llama from torch steps that change its greedy answers (every linear adapted)."""
    from yeto.backends.torch.island import TorchIsland, TrainConfig

    cfg = TrainConfig(model=str(tiny_model("llama")), data=str(DEMO_DATA), seq_len=64, batch_size=2, max_steps=STEPS,
                      lora_r=4, lora_targets="all-linear", lora_dropout=0.0, lr=LR)
    island = TorchIsland(cfg, log=lambda s: None)
    for _ in range(STEPS):
        island.step()
    return island, island.save(tmp_path_factory.mktemp("mlx-inference") / "adapter")


def yeto_without_torch(tmp_path, *args: str, block_mlx: bool = False) -> subprocess.CompletedProcess:
    env = torchless_env(tmp_path, BLOCKED + (MLX_MODULES if block_mlx else ()))
    return subprocess.run([sys.executable, "-m", "yeto", *args], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=TIMEOUT_S)


def test_generate_runs_on_mlx_without_torch_and_answers_as_torch_does(trained, tmp_path):
    """It said `pip install 'yeto[torch]'` on a Mac with yeto[mlx]; now mlx-lm's generate answers, greedy, what the
    torch backend answers."""
    from yeto.backends.torch.generate import compare

    _, adapter = trained
    args = ["generate", "--adapter", str(adapter), "--max-new-tokens", str(NEW_TOKENS)]
    r = yeto_without_torch(tmp_path, *args, *[a for p in PROMPTS for a in ("--prompt", p)])
    assert r.returncode == 0, r.stderr[-3000:]
    want = compare(None, adapter, list(PROMPTS), NEW_TOKENS, device="cpu")
    table = " ".join(r.stdout.split())
    for prompt, before, after in want:
        assert prompt in table and " ".join(after.split()) in table and " ".join(before.split()) in table, (want, table)
    assert any(before != after for _, before, after in want)  # the adapter changes the answers: the check has teeth


def test_export_runs_on_mlx_without_torch_and_fuses_what_peft_merges(trained, tmp_path):
    """mlx-lm's fuse and save: a checkpoint transformers loads, computing what base + adapter computes in peft."""
    from transformers import AutoTokenizer

    island, adapter = trained
    out = tmp_path / "merged"
    r = yeto_without_torch(tmp_path, "export", str(adapter), "--merged", str(out), "--dtype", "float32")
    assert r.returncode == 0, r.stderr[-3000:]
    assert "LoRA layers fused by mlx-lm" in r.stdout and (out / "yeto_export.json").is_file(), r.stdout
    merged_computes_base_plus_adapter(out, island, adapter)
    assert AutoTokenizer.from_pretrained(out).chat_template
    again = yeto_without_torch(tmp_path, "export", str(adapter), "--merged", str(out))
    assert again.returncode == 2 and again.stderr.strip().splitlines() == [
        f"error: --merged {out} exists and is not empty: pick a new directory, or pass --force to replace it"]


def test_without_torch_or_mlx_generate_and_export_name_both_extras_in_one_line(tmp_path):
    for args in (["generate", "--adapter", str(tmp_path), "--prompt", "hi"],
                 ["export", str(tmp_path), "--merged", str(tmp_path / "m")]):
        r = yeto_without_torch(tmp_path, *args, block_mlx=True)
        lines = r.stderr.strip().splitlines()
        assert r.returncode == 2 and len(lines) == 1, (args, r.stderr)
        assert "this install has neither: pip install 'yeto[torch]' (on a Mac: pip install 'yeto[mlx]')" in lines[0]


def test_mlx_refuses_a_torch_device_in_one_line(trained, tmp_path):
    _, adapter = trained
    r = yeto_without_torch(tmp_path, "generate", "--adapter", str(adapter), "--prompt", "hi", "--device", "cuda")
    assert r.returncode == 2 and r.stderr.strip().splitlines() == [
        "error: --device 'cuda': MLX runs on the Apple GPU or the CPU, use auto or cpu (or --backend torch for a "
        "torch device)"], r.stderr
