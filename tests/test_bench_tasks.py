"""bench/tasks.py's smoke arm (the task benchmark itself is not run in CI): a generated task, the base model, one
machine and a 2-island fleet on a tiny random model, scored on the same held-out examples."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
pytest.importorskip("reasoning_gym")


def test_the_task_benchmark_runs_its_smoke_arm(tiny_model, tmp_path):
    out = tmp_path / "tasks.json"
    r = subprocess.run([sys.executable, str(REPO / "bench" / "tasks.py"), "--smoke", "--model",
                        str(tiny_model("llama")), "--tasks", "chain_sum", "--json", str(out)],
                       cwd=REPO, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    results = json.loads(out.read_text())["chain_sum"]["0"]
    assert list(results) == ["base model", "one machine", "2 islands"]
    for arm, res in results.items():
        assert res["n"] == len(res["scores"]) == 8, arm
        assert res["low"] <= res["accuracy"] <= res["high"], arm
    assert results["2 islands"]["merges"] == 2  # 4 inner steps in rounds of 2
    assert "| 2 islands |" in r.stdout and "vs one machine" in r.stdout
    # --from-json: earlier runs' files as one table (a later file's arm replaces the earlier one's) and one plot
    later = tmp_path / "later.json"
    later.write_text(json.dumps({"chain_sum": {"0": {"2 islands": {**results["2 islands"], "accuracy": 0.5,
                                                                   "low": 0.2, "high": 0.8}}}}))
    png = tmp_path / "tasks.png"
    r = subprocess.run([sys.executable, str(REPO / "bench" / "tasks.py"), "--from-json", f"{out},{later}",
                        "--png", str(png)], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "| 2 islands | 50.0 [20.0, 80.0]%" in r.stdout and "| one machine |" in r.stdout
    assert png.stat().st_size > 0
