"""The lean install: the syncer, the CLI, `yeto launch` and the MLX island run without torch (`pip install yeto`,
`yeto[mlx]`); the torch island is the `yeto[torch]` extra.

Each check runs in a subprocess whose `sitecustomize` blocks torch, peft and bitsandbytes (`sys.modules[name] = None`:
any import of them, or of a submodule, raises), as on a machine where they are not installed.
"""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import yaml

from tests.peers import QuadraticIsland, island_thread
from yeto.launch.local import free_port
from yeto.sync.shell.tape import read_tape

REPO = Path(__file__).resolve().parents[1]
BLOCKED = ("torch", "peft", "bitsandbytes")
DEMO_DATA = str(REPO / "data" / "demo")
# everything the syncer, the CLI, launch (local and cloud) and the MLX island import (and the torch backend's
# entry: torch loads only when it trains)
LEAN_MODULES = ("yeto.cli", "yeto.cli.syncer_command", "yeto.cli.train_command", "yeto.cli.launch_command",
                "yeto.cli.head_command",
                "yeto.sync.shell.server", "yeto.sync.shell.client", "yeto.sync.sim", "yeto.sync.shell.audit",
                "yeto.sync.shell.tape", "yeto.launch.head", "yeto.launch.local", "yeto.launch.tasks",
                "yeto.launch.join",
                "yeto.island.diloco", "yeto.island.training", "yeto.island.data", "yeto.models.adapter",
                "yeto.models.materialize",
                "yeto.island.lora_targets", "yeto.island.interface", "yeto.backends", "yeto.backends.mlx.backend",
                "yeto.backends.mlx.island", "yeto.backends.mlx.lora", "yeto.backends.torch.backend")


def torchless_env(tmp_path: Path, blocked: tuple[str, ...] = BLOCKED) -> dict[str, str]:
    site = tmp_path / "no-torch"
    site.mkdir(exist_ok=True)
    (site / "sitecustomize.py").write_text(f"import sys\nfor _name in {blocked!r}:\n    sys.modules[_name] = None\n")
    return dict(os.environ, PYTHONPATH=os.pathsep.join([str(site), str(REPO)]), YETO_RUNS=str(tmp_path / "runs"))


def run(args: list[str], env: dict[str, str], timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=timeout)


def test_the_blocker_blocks(tmp_path):
    r = run(["-c", "import torch"], torchless_env(tmp_path))
    assert r.returncode != 0 and "torch" in r.stderr


def test_syncer_cli_launch_and_mlx_island_import_without_torch(tmp_path):
    code = textwrap.dedent(f"""
        import importlib, sys
        for name in {LEAN_MODULES!r}:
            importlib.import_module(name)
        import yeto.cli
        yeto.cli._register()  # every command, as `yeto` builds them
        loaded = sorted(m for m in sys.modules if m.split(".")[0] in {BLOCKED!r} and sys.modules[m] is not None)
        assert not loaded, loaded
        print("imported", len({LEAN_MODULES!r}))
    """)
    r = run(["-c", code], torchless_env(tmp_path))
    assert r.returncode == 0, r.stderr
    assert f"imported {len(LEAN_MODULES)}" in r.stdout


def test_yeto_syncer_merges_rounds_without_torch(tmp_path):
    """The real `yeto syncer` in a torch-less process, two numpy islands against it over loopback, 4-bit sync."""
    port = free_port()
    out = tmp_path / "syncer"
    syncer = subprocess.Popen([sys.executable, "-m", "yeto", "syncer", "--host", "127.0.0.1", "--port", str(port),
                               "--islands", "2", "--quorum", "2", "--outer-steps", "3", "--inner-steps", "2",
                               "--sync-bits", "4", "--out", str(out), "--insecure"],
                              cwd=REPO, env=torchless_env(tmp_path), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True)
    try:
        results: dict = {}
        threads = [island_thread(QuadraticIsland(t, 100, shape_b=(200, 2)), port, lid, results)
                   for lid, t in enumerate((1.0, -2.0))]
        for t in threads:
            t.join(60)
        log, _ = syncer.communicate(timeout=60)
    finally:
        syncer.kill()
    assert syncer.returncode == 0, log
    assert all(isinstance(r, dict) and r["complete"] for r in results.values()), results
    merges = [e for e in read_tape(out) if e["event"] == "merge"]
    assert [sorted(e["responders"]) for e in merges] == [[0, 1]] * 3
    from safetensors.numpy import load_file

    weights = load_file(str(out / "adapter" / "adapter_model.safetensors"))
    b = next(v for k, v in weights.items() if "lora_B" in k)
    assert b.shape == (200, 2) and np.isfinite(b).all() and np.abs(b).max() > 0  # merged steps toward the targets
    r = run(["-m", "yeto", "tape", str(out)], torchless_env(tmp_path))
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr


def test_yeto_train_and_launch_without_torch_say_how_to_get_it_in_one_line(tmp_path):
    """(`yeto generate` and `yeto export` run on MLX where torch is missing: tests/test_mlx_inference.py.)"""
    env = torchless_env(tmp_path)
    r = run(["-m", "yeto", "train", "--help"], env)  # (the command of every backend: its help needs none)
    assert r.returncode == 0 and "--backend" in r.stdout, r.stderr
    for args in (["train", "--model", "smollm2-135m", "--data", DEMO_DATA],  # (auto off Apple silicon: torch)
                 ["launch", "--gpu", "local:2", "--model", "smollm2-135m", "--data", DEMO_DATA, "--out",
                  str(tmp_path / "local")]):
        r = run(["-m", "yeto", *args], env)
        assert r.returncode == 2 and "Traceback" not in r.stderr, (args, r.stderr)
        assert r.stderr.count("\n") == 1 and "pip install 'yeto[torch]'" in r.stderr, (args, r.stderr)
    assert not (tmp_path / "local").exists()  # refused before the syncer or any island started


def test_launch_dry_run_without_torch_shows_a_head_that_installs_no_torch(tmp_path):
    out = tmp_path / "run"
    r = run(["-m", "yeto", "launch", "--gpu", "aws:1xA10G@us-west-2", "--model", "smollm2-135m", "--data", DEMO_DATA,
             "--out", str(out), "--name", "lean", "--dry-run", "--outer-steps", "2", "--external-islands", "1"],
            torchless_env(tmp_path))
    assert r.returncode == 0, r.stderr
    body = r.stdout.split("# --- tasks (SkyPilot YAML) ---\n", 1)[1].split("# --- end of tasks ---", 1)[0]
    tasks = {d["name"]: d for d in yaml.safe_load_all(body)}
    head, island = tasks["lean-head"]["setup"], tasks["lean-island-0"]["setup"]
    assert "pip install" in head and "torch" not in head, head  # the syncer merges on numpy
    assert "[torch]" in island, island  # a cloud island is the torch one
    join = r.stdout.split("# --- join/1.sh", 1)[1]  # a machine of the user's own: MLX on a Mac, torch elsewhere
    assert 'Darwin-arm64) BACKEND="${YETO_BACKEND:-mlx}" ;;' in join
    assert '*) BACKEND="${YETO_BACKEND:-torch}" ;;' in join
    assert 'case "$BACKEND" in mlx) EXTRAS="[mlx]" ;; *) EXTRAS="[torch]" ;; esac' in join
    assert ' -m yeto train --backend "$BACKEND" ' in join

