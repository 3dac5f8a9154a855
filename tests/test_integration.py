"""Real processes: the CLI on a tiny model, clear errors, and the real SmolLM2 learning the demo data."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import DEMO_DATA, REPO

YETO = [sys.executable, "-m", "yeto"]


def run(args, **kw):
    return subprocess.run(args, capture_output=True, text=True, cwd=REPO, timeout=600, **kw)


# a tqdm bar's counter ("20/20 [00:00<00:00, ...it/s]"): transformers' "Loading weights", the hub's downloads
BAR = re.compile(r"\d+/\d+ \[")


def test_island_module_trains_and_saves_with_no_library_noise(tiny_model, tmp_path):
    out = tmp_path / "run"
    r = run([sys.executable, "-m", "yeto.backends.torch", "--model", str(tiny_model("lfm2")), "--data", str(DEMO_DATA),
             "--out", str(out), "--max-steps", "4", "--seq-len", "64", "--batch-size", "2", "--grad-accum", "2",
             "--eval-every", "2", "--lora-r", "4", "--no-progress"])
    assert r.returncode == 0, r.stderr
    assert not BAR.search(r.stderr), r.stderr  # --no-progress silences every bar, the libraries' too
    events = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [e for e in events if e["event"] == "step"]
    assert [e["step"] for e in steps] == [1, 2, 3, 4]
    assert all(e["tokens"] == 2 * 2 * 64 and 0 < e["loss_tokens"] < e["tokens"] for e in steps)
    assert [e["step"] for e in events if e["event"] == "eval"] == [0, 2, 4]
    assert (out / "adapter" / "adapter_model.safetensors").is_file()
    g = run(YETO + ["generate", "--model", str(tiny_model("lfm2")), "--adapter", str(out), "--prompt", "Hi",
                    "--max-new-tokens", "4"])
    assert g.returncode == 0, g.stderr
    assert "with adapter" in g.stdout
    assert "clean_up_tokenization_spaces" not in g.stderr, g.stderr  # the decode says what it wants


def test_an_island_that_never_reached_its_syncer_says_its_adapter_holds_no_global(tiny_model, tmp_path):
    from yeto.launch.local import free_port

    out = tmp_path / "island"
    r = run(YETO + ["train", "--model", str(tiny_model("llama")), "--data", str(DEMO_DATA), "--out", str(out),
                    "--syncer", f"127.0.0.1:{free_port()}", "--insecure", "--syncer-timeout", "1",
                    "--give-up-after", "2", "--seq-len", "64", "--no-progress"], env={**os.environ, "COLUMNS": "300"})
    assert r.returncode == 2 and "giving up" in r.stderr, r.stderr[-2000:]
    stopped = [line for line in r.stderr.splitlines() if "stopped early" in line]
    assert len(stopped) == 1 and "received no global" in stopped[0], r.stderr[-2000:]
    assert "the last global it received" not in r.stderr
    assert (out / "adapter" / "adapter_model.safetensors").is_file()
    events = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [e.get("global_version", "absent") for e in events if e["event"] == "aborted"] == [None]


@pytest.mark.parametrize("args,message", [
    (["--model", "smollm9"], "error: unknown model 'smollm9'"),
    (["--data", "no/such.jsonl"], "error: data file not found: no/such.jsonl"),
    (["--loss-function", "focal"], "error: unknown --loss-function 'focal'"),
])
def test_cli_errors_are_one_clear_line(args, message, tiny_model):
    base = ["--model", str(tiny_model("llama")), "--data", str(DEMO_DATA), "--max-steps", "1", "--no-progress"]
    r = run(YETO + ["train"] + base + args)
    assert r.returncode == 2
    assert message in r.stderr and "Traceback" not in r.stderr


def test_cli_reports_a_bad_record(tmp_path, tiny_model):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"text": "fine"}) + "\n" + json.dumps({"answer": 42}) + "\n")
    r = run(YETO + ["train", "--model", str(tiny_model("llama")), "--data", str(bad), "--no-progress"])
    assert r.returncode == 2 and "bad.jsonl:2: record fits no format" in r.stderr


def help_lines(args):
    r = run(args + ["--help"], env={"COLUMNS": "300", "TERM": "dumb", "PATH": "/usr/bin:/bin"})
    assert r.returncode == 0, r.stderr
    return r.stdout


def test_every_command_documents_every_flag():
    import dataclasses

    import inspect

    from yeto.cli.syncer_command import syncer_command
    from yeto.cli.train_command import make_train_command
    from yeto.cli.usage import flag_of
    from yeto.island.train_config import TrainConfig
    from yeto.sync.core.syncer import SyncerConfig
    from yeto.cli.test_hooks import HIDDEN_TRAIN_FLAGS

    def flags(command):
        return {name: flag_of(p) for name, p in inspect.signature(command, eval_str=True).parameters.items()}

    train_flags = flags(make_train_command(lambda cfg, progress: None, doc=""))
    cases = [(YETO + ["train"], TrainConfig, train_flags),
             ([sys.executable, "-m", "yeto.backends.torch"], TrainConfig, train_flags),
             ([sys.executable, "-m", "yeto.backends.mlx"], TrainConfig, train_flags),
             (YETO + ["syncer"], SyncerConfig, flags(syncer_command))]
    for args, cfg, flag in cases:
        out = help_lines(args)
        for field in (f.name for f in dataclasses.fields(cfg) if f.init and f.name not in HIDDEN_TRAIN_FLAGS):  # (the
            # others are derived, not flags; test hooks work but --help does not show them)
            assert re.search(re.escape(flag[field]) + r"\b", out), (args, field)
        assert "learner" not in out and "--step-delay" not in out  # old spellings and a test hook: hidden
    for cmd in (["train"], ["syncer"], ["launch"], ["generate"], ["tape"], ["models"]):
        out = help_lines(YETO + cmd)
        # every option row carries a help text, not just a type and a default
        for line in out.splitlines():
            m = re.match(r"\W*(--[a-z-]+)(?:\s+--no-[a-z-]+)?\s+<\w+>\s*(.*)", line)
            if m and m.group(1) != "--help":
                assert m.group(2) and not m.group(2).startswith("[default"), (cmd, line)


@pytest.mark.slow
def test_smollm2_learns_the_demo_data(tmp_path):
    from yeto.backends.torch.generate import compare
    from yeto.backends.torch.backend import TorchBackend
    from yeto.island.train_config import TrainConfig
    from yeto.island.training import train

    cfg = TrainConfig(model="smollm2-135m", data=str(DEMO_DATA), out=str(tmp_path / "run"), seq_len=128, batch_size=4,
                      max_steps=12, lr=1e-3, warmup_steps=2, eval_every=0)
    s = train(cfg, TorchBackend(), show_progress=False)
    assert s["eval_loss_after"] < s["eval_loss_before"] - 0.2, s
    steps = [json.loads(line) for line in Path(cfg.out, "metrics.jsonl").read_text().splitlines() if '"step"' in line]
    losses = [e["loss"] for e in steps if e["event"] == "step"]
    assert sum(losses[-3:]) / 3 < sum(losses[:3]) / 3
    ((_, base, tuned),) = compare("smollm2-135m", s["adapter"], ["What is the capital of France?"], max_new_tokens=24)
    assert "Paris" in base
    assert tuned != base
