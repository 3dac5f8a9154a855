"""bench/gpu_check.py in its CPU mode (--device cpu --tiny): every case the GPU check runs (both loops, checkpointing,
micro-batches, the probe, sizing's predictions, one case in its own process as on a GPU), on tiny configs, so the
script a GPU machine runs once cannot rot here."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest

from tests.conftest import REPO

SCRIPT = REPO / "bench" / "gpu_check.py"
MODELS = {"llama3.2-1b", "qwen3-4b", "llama3.1-8b"}
AUTO_BATCH = 8
TINY = ["--device", "cpu", "--tiny", "--steps", "1", "--warmup", "0", "--auto-batch", str(AUTO_BATCH)]


@pytest.fixture(scope="module")
def gpu_check():
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules["gpu_check"] = module  # (its dataclasses look their module up)
    spec.loader.exec_module(module)
    return module


def test_every_case_runs_on_tiny_configs(gpu_check, tmp_path, capsys):
    assert gpu_check.main([*TINY, "--out", str(tmp_path)]) == 0
    printed = capsys.readouterr().out
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    cases, summary = report["cases"], report["summary"]
    assert report["settings"]["dtype"] == "float32" and all(c["status"] == "ok" for c in cases)
    by = {c["name"]: c for c in cases}
    for tag in ("1b", "8b"):  # both loops timed at the same batch, and the ratio reported
        plain, yeto = by[f"{tag} plain"], by[f"{tag} yeto"]
        assert plain["batch"] == yeto["batch"] and plain["tok_s"] > 0 and yeto["tok_s"] > 0
        assert summary["yeto_over_plain_tok_s"][tag] == pytest.approx(yeto["tok_s"] / plain["tok_s"])
        assert plain["adapter_bytes"] == yeto["adapter_bytes"]  # the same LoRA: every linear, the same rank
        assert summary["checkpointing"][tag]["tok_s_with_over_without"] > 0
    memory = [c for c in cases if " mb" in c["name"]]  # three models at micro-batches 1 and 4, each predicted
    assert {(c["alias"], c["micro_batch_used"]) for c in memory} == {(m, mb) for m in MODELS for mb in (1, 4)}
    for c in memory:
        assert c["predicted_gib"] > 0 and c["predicted_tok_s"] > 0
        assert c["peak_gib"] is None  # no peak to measure on the CPU, and none made up
    # what the CPU can check of sizing's memory: the weights and the adapter it predicts are what the island holds
    assert set(summary["weights_allocated_over_predicted"].values()) == {1.0}
    assert set(summary["adapter_allocated_over_predicted"].values()) == {1.0}
    for tag in ("1b", "8b"):  # nothing runs out of memory on a tiny config: the probe takes the whole batch
        auto = summary["micro_batch_auto"][tag]
        assert auto["probed"] == AUTO_BATCH and 1 <= auto["predicted"] <= AUTO_BATCH
        assert "tok_s" not in by[f"{tag} yeto auto"]  # the probe case times no steps
    assert "yeto / plain tokens/s" in printed and "sized as H100" in printed


def test_a_case_in_its_own_process_as_on_a_gpu(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(REPO)}  # the script as a GPU machine runs it: spawned cases
    proc = subprocess.run([sys.executable, str(SCRIPT), *TINY, "--out", str(tmp_path), "--isolate", "--only",
                           "8b plain"], capture_output=True, text=True, timeout=300, env=env, cwd=REPO)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    (case,) = json.loads((tmp_path / "gpu_check.json").read_text())["cases"]
    assert case["status"] == "ok" and case["tok_s"] > 0 and case["adapter_bytes"] > 0


def test_past_the_budget_cases_are_skipped_and_said_so(gpu_check, tmp_path):
    assert gpu_check.main([*TINY, "--out", str(tmp_path), "--budget-s", "0", "--only", "1b"]) == 1
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert len(report["cases"]) > 1 and all(c["status"].startswith("skipped") for c in report["cases"])


def test_a_full_check_on_the_cpu_is_refused_in_one_line(gpu_check, tmp_path, capsys):
    assert gpu_check.main(["--device", "cpu", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error:") and "--tiny" in err and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("name, gib, sized", [("NVIDIA H100 80GB HBM3", 79.2, "H100"), ("NVIDIA H200", 139.8, "H200"),
                                              ("NVIDIA A100-SXM4-40GB", 39.4, "A100"),
                                              ("NVIDIA A100-SXM4-80GB", 79.2, "A100-80GB"), ("Tesla T4", 14.6, "T4"),
                                              ("NVIDIA GeForce RTX 4090", 23.6, "RTX4090")])
def test_a_gpu_is_sized_as_its_row_of_the_gpu_table(gpu_check, name, gib, sized):
    assert gpu_check.sized_as({"name": name, "memory_gib": gib}, None) == sized


def test_a_gpu_the_table_lacks_is_named_with_the_fix(gpu_check):
    from yeto import YetoError

    with pytest.raises(YetoError, match="--gpu"):
        gpu_check.sized_as({"name": "Some Accelerator X1", "memory_gib": 64.0}, None)
    assert gpu_check.sized_as({"name": "Some Accelerator X1", "memory_gib": 64.0}, "H100") == "H100"
    with pytest.raises(YetoError, match="not in yeto.launch.gpus"):
        gpu_check.sized_as({}, "H1000")
