"""`--config run.yaml` on train, syncer and launch (keys by long name, command line wins, one line for a bad file),
`--print-config`'s round trip, and `--epochs` as the run's length (its steps from the shard's blocks)."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.conftest import DEMO_DATA

YETO = [sys.executable, "-m", "yeto"]
TIMEOUT_S = 120
RECORDS = 24  # a small chat file: a few blocks, so --epochs trains in seconds
HEADER = "#"  # --print-config's first line is a comment saying what reads it back


def _run(argv: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run(argv, capture_output=True, text=True, timeout=TIMEOUT_S, stdin=subprocess.DEVNULL)


def _all(cases: dict[str, list[str]]) -> dict[str, subprocess.CompletedProcess]:
    with ThreadPoolExecutor(max_workers=2) as pool:
        return dict(zip(cases, pool.map(_run, cases.values())))


def _printed(r: subprocess.CompletedProcess) -> dict:
    import yaml

    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.startswith(HEADER), r.stdout[:200]
    return yaml.safe_load(r.stdout)


def _write(path: Path, text: str) -> str:
    path.write_text(text)
    return str(path)


def test_print_config_reads_back_unchanged_and_the_command_line_wins(tmp_path):
    run = _write(tmp_path / "run.yaml", "seq_len: 64\nlr: 1e-3\nlora-r: 8\nmax-steps: 7\nfull-logits: true\n"
                                        "num-learners: 2\n")  # (an old spelling is a flag too)
    syncer = _write(tmp_path / "syncer.yaml", "outer-steps: 9\ngrace: 2.5\nsync_bits: 8\n")
    results = _all({
        "train": YETO + ["train", "--config", run, "--print-config"],
        "train, flags win": YETO + ["train", "--config", run, "--lora-r", "4", "--no-progress", "--print-config"],
        "syncer": YETO + ["syncer", "--config", syncer, "--sync-bits", "4", "--print-config"],
    })
    train = _printed(results["train"])
    assert (train["seq-len"], train["lr"], train["lora-r"], train["max-steps"], train["full-logits"]) == (
        64, 0.001, 8, 7, True)
    assert train["islands"] == 2 and "num-learners" not in train  # the old spelling's value, under its flag
    assert "seq_len" not in train and "config" not in train and "print-config" not in train
    won = _printed(results["train, flags win"])
    assert (won["lora-r"], won["seq-len"], won["progress"]) == (4, 64, False)
    assert _printed(results["syncer"])["sync-bits"] == 4 and _printed(results["syncer"])["outer-steps"] == 9
    again = {name: _write(tmp_path / f"{name}.yaml", results[name].stdout) for name in ("train", "syncer")}
    back = _all({name: YETO + [name, "--config", path, "--print-config"] for name, path in again.items()})
    for name, r in back.items():
        assert r.returncode == 0, (name, r.stderr[-2000:])
        assert r.stdout == results[name].stdout, name


def test_launch_takes_its_own_the_syncers_and_the_islands_flags_from_a_file(tmp_path):
    run = _write(tmp_path / "fleet.yaml", f"data: {DEMO_DATA}\nouter-steps: 5\nsync-bits: 8\nseq-len: 64\n"
                                          "lora-freeze-a: true\nlr: 1e-3\n")
    out = str(tmp_path / "fleet")
    results = _all({
        "printed": YETO + ["launch", "--config", run, "--sync-bits", "4", "--print-config"],
        "dry run": YETO + ["launch", "--config", run, "--out", out, "--sync-bits", "4", "--dry-run"],
    })
    printed = _printed(results["printed"])
    assert (printed["outer-steps"], printed["sync-bits"], printed["seq-len"], printed["lr"],
            printed["lora-freeze-a"]) == (5, 4, 64, 0.001, True)
    again = _run(YETO + ["launch", "--config", _write(tmp_path / "again.yaml", results["printed"].stdout),
                         "--print-config"])
    assert again.stdout == results["printed"].stdout, again.stderr[-2000:]
    r = results["dry run"]
    assert r.returncode == 0, r.stderr[-2000:]
    plan = json.loads(r.stdout[r.stdout.index("{"):])
    syncer, islands = " ".join(plan["syncer_args"]), " ".join(plan["island_args"])
    assert "--outer-steps 5" in syncer and "--sync-bits 4" in syncer and "--sync-bits 8" not in syncer
    assert "--seq-len 64" in islands and "--lora-freeze-a" in islands and "--lr 1e-3" in islands


def test_a_bad_config_file_is_one_line_and_exit_2(tmp_path):
    cases = {  # name: (command, the file's text, what the one line says)
        "unknown key": ("train", "seq-lenn: 3\n", "unknown key 'seq-lenn' (did you mean 'seq-len'?)"),
        "unknown key on launch": ("launch", "outer-step: 3\n", "unknown key 'outer-step' (did you mean "
                                                               "'outer-steps'?)"),
        "not a mapping": ("syncer", "- port: 1\n", "holds a list, not a mapping"),
        "not YAML": ("train", "lr: [\n", "is not valid YAML at line 2"),
        "nested": ("train", "lora:\n  r: 8\n", "'lora' is not `flag-name: value`"),
        "bad value": ("train", "seq-len: many\n", "seq-len: Invalid value for '--seq-len'"),
        "bad value passed on": ("launch", "seq-len: many\n", "seq-len: Invalid value for '--seq-len'"),
        "both lengths in the file": ("train", "max-steps: 5\nepochs: 2\n", "--max-steps 5 and --epochs 2 both set"),
    }
    paths = {name: _write(tmp_path / f"{i}.yaml", text) for i, (name, (_, text, _)) in enumerate(cases.items())}
    argv = {name: YETO + [command, "--config", paths[name], "--model", "/nonexistent/model"]
            for name, (command, _, _) in cases.items()}
    argv["no such file"] = YETO + ["train", "--config", str(tmp_path / "nowhere.yaml")]
    argv["both lengths on the line"] = YETO + ["train", "--max-steps", "5", "--epochs", "2"]
    expected = {**{name: said for name, (_, _, said) in cases.items()}, "no such file": "no such file",
                "both lengths on the line": "--max-steps 5 and --epochs 2 both set the run's length"}
    for name, r in _all(argv).items():
        lines = [line for line in r.stderr.splitlines() if line.strip()]
        assert r.returncode == 2, (name, r.returncode, r.stderr[-2000:])
        assert len(lines) == 1 and lines[0].startswith("error: "), (name, lines)
        assert expected[name] in lines[0], (name, lines[0])


def test_epochs_on_the_command_line_wins_over_the_files_max_steps(tmp_path):
    run = _write(tmp_path / "run.yaml", "max-steps: 5\n")
    printed = _printed(_run(YETO + ["train", "--config", run, "--epochs", "2", "--print-config"]))
    assert (printed["epochs"], printed["max-steps"]) == (2.0, None)


@pytest.mark.parametrize("epochs, blocks, per_step, steps", [
    (1, 10, 4, 3), (2, 10, 4, 5), (0.5, 10, 4, 2), (1.1, 10, 1, 11), (3, 8, 4, 6), (0.01, 10, 4, 1)])
def test_epoch_steps_count_a_partial_last_batch_as_a_step(epochs, blocks, per_step, steps):
    from yeto.island.shard import epoch_steps

    assert epoch_steps(epochs, blocks, per_step) == steps


def test_epochs_train_the_steps_of_that_many_passes_over_the_shard(tiny_model, tokenizer, chat_file, tmp_path):
    from yeto.island.data import read_data
    from yeto.island.train_config import TrainConfig

    data = str(chat_file([{"messages": [{"role": "user", "content": f"question {i}?"},
                                        {"role": "assistant", "content": f"answer {i} " * (i % 5 + 1)}]}
                          for i in range(RECORDS)]))
    d = TrainConfig()
    seq_len, batch, accum, epochs = 64, 2, 2, 1.5
    blocks = len(read_data(data, tokenizer, seq_len, d.eval_fraction, d.seed).shard(0, 1).train)
    expected = math.ceil(epochs * blocks / (batch * accum))
    assert expected != math.ceil(blocks / (batch * accum))  # (not what one epoch would give)
    out = tmp_path / "run"
    r = _run(YETO + ["train", "--backend", "torch", "--model", str(tiny_model("llama")), "--data", data,
                     "--out", str(out), "--seq-len", str(seq_len), "--batch-size", str(batch), "--grad-accum",
                     str(accum), "--epochs", str(epochs), "--lora-r", "4", "--eval-every", "0", "--device", "cpu",
                     "--no-progress"])
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"--epochs 1.5: {expected} steps ({blocks} training blocks" in " ".join(r.stderr.split())
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == expected
    assert json.loads((out / "run.json").read_text())["config"]["epochs"] == epochs
