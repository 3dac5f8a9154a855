"""Every command that takes a run reads it through `yeto.launch.registry.find_run`: a launch's --out (its syncer's
tape and merged adapter), a syncer's, an island's or a standalone `yeto train`'s --out. Issue 36: `generate`, `tape`
and `export` refused the launch directory that `dashboard` took, and `dashboard` refused a standalone run."""

from __future__ import annotations

import shutil
import subprocess
import sys

import pytest

from tests.conftest import DEMO_DATA, REPO

YETO = [sys.executable, "-m", "yeto"]
TIMEOUT_S = 300
STEPS, EVAL_EVERY = 4, 2
WATCH_RUN = REPO / "tests" / "data" / "watch-run"


def yeto(*args) -> subprocess.CompletedProcess:
    return subprocess.run([*YETO, *map(str, args)], cwd=REPO, capture_output=True, text=True, timeout=TIMEOUT_S)


@pytest.fixture(scope="module")
def standalone(tiny_model, tmp_path_factory):
    """A finished standalone `yeto train` run (no syncer): its adapter, metrics.jsonl and summary.json."""
    out = tmp_path_factory.mktemp("standalone") / "run"
    r = yeto("train", "--model", tiny_model("llama"), "--data", DEMO_DATA, "--out", out, "--max-steps", STEPS,
             "--eval-every", EVAL_EVERY, "--seq-len", 64, "--batch-size", 2, "--lora-r", 4, "--no-progress")
    assert r.returncode == 0, r.stderr[-2000:]
    return out


@pytest.fixture(scope="module")
def launch(standalone, tmp_path_factory):
    """A launch's --out: the demo fleet's tape and islands, its syncer's merged adapter (the standalone one)."""
    out = tmp_path_factory.mktemp("launch") / "fleet"
    shutil.copytree(WATCH_RUN, out)
    shutil.copytree(standalone / "adapter", out / "syncer" / "adapter")
    return out


def test_the_dashboard_shows_a_standalone_run_its_loss_per_step_and_eval(standalone, tmp_path):
    from yeto.watch.dashboard import Dashboard, open_run

    snap = Dashboard(open_run(str(standalone))).snapshot()
    assert snap["run"]["standalone"] and snap["run"]["finished"] == "done"
    assert [(r["island"], r["state"], r["backend"]) for r in snap["fleet"]] == [(0, "done", "torch")]
    assert snap["fleet"][0]["tokens_per_s"] > 0
    assert [p[0] for p in snap["curves"]["steps"]["0"]] == list(range(1, STEPS + 1))
    assert [p[0] for p in snap["curves"]["eval"]["0"]] == [0, EVAL_EVERY, STEPS]  # at their steps
    page = tmp_path / "solo.html"
    r = yeto("dashboard", standalone, "--export", page)
    assert r.returncode == 0, r.stderr
    assert '"standalone":true' in page.read_text()


def test_tape_export_and_generate_take_a_launch_directory(launch, standalone, tmp_path):
    r = yeto("tape", launch, "--audit")
    assert r.returncode == 0 and "audit OK" in r.stdout, r.stdout + r.stderr
    r = yeto("tape", launch / "island-0")  # an island of the launch: its syncer's tape
    assert r.returncode == 0 and "event tape" in r.stdout, r.stderr
    r = yeto("tape", standalone)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1 and "standalone" in lines[0] and "dashboard" in lines[0], r.stderr
    merged = tmp_path / "merged"
    r = yeto("export", launch, "--merged", merged)
    assert r.returncode == 0 and (merged / "config.json").is_file(), r.stderr[-2000:]
    r = yeto("generate", "--adapter", launch, "--prompt", "Hello", "--max-new-tokens", 2)
    assert r.returncode == 0 and "with adapter" in r.stdout, r.stderr[-2000:]
