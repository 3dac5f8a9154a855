"""Every way a person can get a command wrong costs a few lines and exit 2, never a traceback.

Two tables, run as real subprocesses: usage errors (click's usage lines and one `Error:` line) on every command and
entry point, and bad input found by yeto's own checks (one `error:` line). The model named in the input cases does
not exist, so an error about the flag proves the check ran before any model was looked for.
"""

from __future__ import annotations

import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.conftest import DEMO_DATA, REPO

YETO = [sys.executable, "-m", "yeto"]
NO_MODEL = "/nonexistent/model"  # an error about it would mean the flag check came too late
TIMEOUT_S = 120
MAX_USAGE_LINES = 6  # click: "Usage: ...", "Try ... --help", a blank line, "Error: ..." (and a wrapped line)

USAGE = {  # name: argv; each must be a usage error
    "unknown command": YETO + ["nosuch"],
    "train unknown flag": YETO + ["train", "--bogus", "3"],
    "train bad int": YETO + ["train", "--max-steps", "x"],
    "train bad float": YETO + ["train", "--lr", "abc"],
    "syncer unknown flag": YETO + ["syncer", "--bogus"],
    "syncer bad int": YETO + ["syncer", "--port", "abc"],
    "status unknown flag": YETO + ["status", "--bogus"],
    "logs unknown flag": YETO + ["logs", "x", "--bogus"],
    "logs bad int": YETO + ["logs", "x", "--island", "q"],
    "down unknown flag": YETO + ["down", "x", "--bogus"],
    "keys init missing option": YETO + ["keys", "init"],
    "keys add bad int": YETO + ["keys", "add", "--out", "x", "--island", "q"],
    "keys revoke missing option": YETO + ["keys", "revoke", "--out", "x"],
    "keys list unknown flag": YETO + ["keys", "list", "--out", "x", "--bogus"],
    "tape missing argument": YETO + ["tape"],
    "tape unknown flag": YETO + ["tape", "x", "--bogus"],
    "dashboard missing argument": YETO + ["dashboard"],
    "dashboard bad port": YETO + ["dashboard", "x", "--port", "p"],
    "generate missing prompt": YETO + ["generate", "--adapter", "x"],
    "generate bad int": YETO + ["generate", "--adapter", "x", "--prompt", "p", "--max-new-tokens", "q"],
    "models unknown flag": YETO + ["models", "--bogus"],
    "shape missing model": YETO + ["shape"],
    "shape bad float": YETO + ["shape", "--model", "x", "--budget", "cheap"],
    "data task bad int": YETO + ["data", "task", "gcd", "--out", "x.jsonl", "--n", "many"],
    "python -m yeto.backends.torch": [sys.executable, "-m", "yeto.backends.torch", "--bogus"],
    "python -m yeto.backends.mlx": [sys.executable, "-m", "yeto.backends.mlx", "--lr", "abc"],
    "python -m yeto syncer": [sys.executable, "-m", "yeto", "syncer", "--bogus"],
}


def _input_cases(tmp: Path) -> dict[str, tuple[list[str], str]]:
    """name: (argv, a fragment the one error line must hold)."""
    a_file = tmp / "a-file"
    a_file.write_text("not a directory")
    tape_dir = tmp / "damaged"
    tape_dir.mkdir()
    (tape_dir / "tape.jsonl").write_text('{"seq": 0, "event": "start"}\nGARBAGE\n{"seq": 1, "event": "x"}\n')
    train = YETO + ["train", "--model", NO_MODEL, "--data", str(DEMO_DATA), "--out", str(tmp / "run"), "--no-progress"]
    return {
        "lr zero": (train + ["--lr", "0"], "--lr"),
        "lr negative": (train + ["--lr", "-1"], "--lr"),
        "lora rank 0": (train + ["--lora-r", "0"], "--lora-r"),
        "lora alpha 0": (train + ["--lora-alpha", "0"], "--lora-alpha"),
        "lora dropout 1": (train + ["--lora-dropout", "1"], "--lora-dropout"),
        "min lr ratio 2": (train + ["--min-lr-ratio", "2"], "--min-lr-ratio"),
        "max grad norm 0": (train + ["--max-grad-norm", "0"], "--max-grad-norm"),
        "warmup negative": (train + ["--warmup-steps", "-1"], "--warmup-steps"),
        "weight decay negative": (train + ["--weight-decay", "-0.1"], "--weight-decay"),
        "eval every negative": (train + ["--eval-every", "-1"], "--eval-every"),
        "save every negative": (train + ["--save-every", "-1"], "--save-every"),
        "eval fraction 1": (train + ["--eval-fraction", "1"], "--eval-fraction"),
        "batch size 0": (train + ["--batch-size", "0"], "--batch-size"),
        "unknown dtype": (train + ["--dtype", "f8"], "--dtype"),
        "unknown device": (train + ["--device", "foo"], "--device"),
        "cuda without CUDA": (train + ["--device", "cuda"], "no CUDA"),
        "syncer not HOST:PORT": (train + ["--syncer", "nohost", "--insecure"], "HOST:PORT"),
        "syncer port out of range": (train + ["--syncer", "127.0.0.1:99999", "--insecure"], "1-65535"),
        # a renamed flag's old spelling still works (it feeds the new flag, whose check names it) and is not doubled
        "old spelling works": (train + ["--num-learners", "2", "--learner-id", "3"], "[0, 2) with --islands 2"),
        "both spellings": (train + ["--islands", "2", "--learners", "2"],  # old spelling
                           "--learners is the old spelling of --islands: give one of them"),  # old spelling
        "train out is a file": (YETO + ["train", "--model", NO_MODEL, "--out", str(a_file)], "is a file"),
        "mlx lr zero": ([sys.executable, "-m", "yeto.backends.mlx", "--model", NO_MODEL, "--lr", "0"], "--lr"),
        "syncer port 99999": (YETO + ["syncer", "--port", "99999", "--out", str(tmp / "s1")], "1-65535"),
        "syncer port 0": (YETO + ["syncer", "--port", "0", "--out", str(tmp / "s2")], "1-65535"),
        "syncer out is a file": (YETO + ["syncer", "--out", str(a_file), "--insecure", "--host", "127.0.0.1"],
                                 "is a file"),
        # the grace is in seconds; --grace-ms, its older spelling, still works (converted: -1500 ms is -1.5 s)
        "syncer grace negative": (YETO + ["syncer", "--grace", "-2", "--out", str(tmp / "s3")], "--grace must be >= 0 "
                                  "seconds (0: close a round as soon as quorum is in), got -2"),
        "syncer grace-ms converted": (YETO + ["syncer", "--grace-ms", "-1500", "--out", str(tmp / "s4")], "got -1.5"),
        "syncer broadcast bits 3": (YETO + ["syncer", "--broadcast-bits", "3", "--out", str(tmp / "s6")],
                                    "--broadcast-bits must be one of (2, 4, 8, 16, 32), got 3"),
        "syncer grace twice": (YETO + ["syncer", "--grace", "2", "--grace-ms", "100", "--out", str(tmp / "s5")],
                               "--grace-ms is the old spelling of --grace: give one of them"),
        "tape damaged line": (YETO + ["tape", str(tape_dir)], "tape.jsonl:2"),
        "tape missing": (YETO + ["tape", str(tmp / "nowhere")], "nowhere does not exist: give a run's directory"),
        "status missing": (YETO + ["status", str(tmp / "nowhere")], "nowhere does not exist: give a run's directory"),
        "shape budget negative": (YETO + ["shape", "--model", NO_MODEL, "--budget", "-1"], "--budget -1"),
        "shape unknown GPU": (YETO + ["shape", "--model", NO_MODEL, "--gpus", "L4,H1000"], "unknown GPU 'H1000'"),
        "shape seq len 1": (YETO + ["shape", "--model", NO_MODEL, "--seq-len", "1"], "--seq-len 1"),
        "launch budget zero": (YETO + ["launch", "--model", NO_MODEL, "--budget", "0"], "--budget 0"),
        "generate no adapter": (YETO + ["generate", "--adapter", str(tmp / "nowhere"), "--prompt", "p"],
                                "no peft adapter"),
        "data task unknown": (YETO + ["data", "task", "gcdd", "--out", str(tmp / "t.jsonl")], "unknown task 'gcdd'"),
    }


def _run(argv: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run(argv, capture_output=True, text=True, timeout=TIMEOUT_S, stdin=subprocess.DEVNULL)


def _all(cases: dict[str, list[str]]) -> dict[str, subprocess.CompletedProcess]:
    with ThreadPoolExecutor(max_workers=4) as pool:
        return dict(zip(cases, pool.map(_run, cases.values())))


def test_usage_errors_are_clicks_few_lines_and_exit_2_on_every_command():
    results = _all(USAGE)
    for name, r in results.items():
        out = r.stdout + r.stderr
        assert r.returncode == 2, (name, r.returncode, out[-2000:])
        assert "Traceback" not in out, (name, out[-2000:])
        lines = [line for line in r.stderr.splitlines() if line.strip()]
        assert 1 <= len(lines) <= MAX_USAGE_LINES, (name, lines)
        assert lines[-1].startswith("Error:"), (name, lines)


def test_bad_input_is_one_error_line_and_exit_2_before_any_model_loads(tmp_path):
    cases = _input_cases(tmp_path)
    results = _all({name: argv for name, (argv, _) in cases.items()})
    for name, r in results.items():
        lines = [line for line in r.stderr.splitlines() if line.strip()]
        assert r.returncode == 2, (name, r.returncode, r.stderr[-2000:])
        assert "Traceback" not in r.stdout + r.stderr, (name, r.stderr[-2000:])
        assert len(lines) == 1 and lines[0].startswith("error: "), (name, lines)
        assert cases[name][1] in lines[0], (name, lines[0])
        assert NO_MODEL not in lines[0], (name, lines[0])  # the check came before the model was looked for


def test_the_audit_of_an_empty_tape_is_not_ok_and_a_torn_last_line_is_said(tmp_path):
    (tmp_path / "tape.jsonl").write_text("")
    r = _run(YETO + ["tape", str(tmp_path), "--audit"])
    assert r.returncode == 1 and "empty" in r.stdout, r.stdout + r.stderr
    (tmp_path / "tape.jsonl").write_text('{"seq": 0, "event": "start"}\n{"seq": 1, "ev')
    from yeto.sync.shell.tape import read_tape

    assert read_tape(tmp_path) == [{"seq": 0, "event": "start"}]  # the torn last line is left out, not an error
    r = _run(YETO + ["tape", str(tmp_path)])
    assert "torn last line" in r.stderr and "Traceback" not in r.stderr, r.stderr


@pytest.fixture(scope="module")
def adapter(tiny_model, tmp_path_factory):
    from yeto.backends.torch.island import TorchIsland, TrainConfig

    cfg = TrainConfig(model=str(tiny_model("llama")), data=str(DEMO_DATA), seq_len=64, batch_size=2, max_steps=1,
                      lora_r=4, lora_dropout=0.0)
    island = TorchIsland(cfg, log=lambda s: None)
    island.step()
    return island.save(tmp_path_factory.mktemp("gen") / "adapter")


def test_generate_uses_the_base_the_adapter_records(adapter):
    from yeto.backends.torch.generate import adapter_base

    recorded = adapter_base(adapter, None, None)
    assert Path(recorded.path).resolve() == Path(adapter_base(adapter, recorded.path, None).path).resolve()
    r = _run(YETO + ["generate", "--adapter", str(adapter), "--prompt", "Hi", "--max-new-tokens", "2"])
    assert r.returncode == 0, r.stderr[-2000:]
    assert "with adapter" in r.stdout


def test_generate_refuses_a_model_that_is_not_the_adapters_base(adapter, tiny_model):
    r = _run(YETO + ["generate", "--adapter", str(adapter), "--model", str(tiny_model("lfm2")), "--prompt", "Hi"])
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert r.returncode == 2 and len(lines) == 1, r.stderr[-2000:]
    assert "is not the base this adapter was trained on" in lines[0]


@pytest.mark.parametrize("command", [["train"], ["syncer"]])
def test_help_shows_everyday_flags_first_and_hides_test_hooks(command):
    """--help: the everyday flags, then the Advanced panel (research and tuning knobs); test hooks are not shown."""
    r = subprocess.run([sys.executable, "-m", "yeto", *command, "--help"], cwd=REPO, capture_output=True, text=True,
                       env=dict(os.environ, COLUMNS="120"), timeout=120)
    assert r.returncode == 0, r.stderr
    everyday, _, advanced = r.stdout.partition("Advanced (defaults need no touching)")
    assert advanced, r.stdout[-2000:]
    assert "--step-delay" not in r.stdout
    first, knob = ("--max-steps", "--weight-decay") if command == ["train"] else ("--outer-steps", "--robust-k")
    assert first in everyday and knob in advanced and knob not in everyday
