"""Real fleets: a syncer process and torch island processes on loopback (tiny Llama)."""

import json
import os
import re
import signal
import subprocess
import sys
import time
import warnings

import pytest

from tests.conftest import DEMO_DATA, REPO
from yeto.launch.local import free_port
from yeto.testbed.netem import Link
from yeto.sync.core.config import DEFAULT_STALENESS_EXPONENT
from yeto.sync.shell.keys import JOIN_KEY_ENV, Keyring
from yeto.sync.merge.rules import capped_claims, staleness_factor
from yeto.sync.shell.tape import read_tape

ENV = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", COLUMNS="200")
LATE_CUT_S = 180.0  # the longest a late island may take to load its model on a loaded machine
TASK_EXAMPLES = 3  # an --eval-task this small scores in a fraction of a second on the tiny model


def syncer(port, out, *args, env=None):
    """A syncer process with the run's credentials made first (as `yeto launch` does); the islands started after
    it get its join key through the environment, and share it (--no-island-keys: bounded, expected ids too; the
    default, a key of its own per expected id, is tests/test_security.py's and `yeto launch`'s)."""
    ENV[JOIN_KEY_ENV] = Keyring.ensure(out).join.text()
    env = dict(env, **{JOIN_KEY_ENV: ENV[JOIN_KEY_ENV]}) if env is not None else ENV
    return subprocess.Popen([sys.executable, "-m", "yeto", "syncer", "--host", "127.0.0.1", "--port", str(port),
                             "--out", str(out), "--no-island-keys", *map(str, args)], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def start_island(model, port, lid, n, out, *args, key=None):
    """A torch island process; `n` None: no --islands (the syncer says the shard); `key`: its own key's text (else
    the join key)."""
    shards = ["--islands", str(n)] if n is not None else []
    return subprocess.Popen([sys.executable, "-m", "yeto.backends.torch", "--model", str(model),
                             "--data", str(DEMO_DATA),
                             "--syncer", f"127.0.0.1:{port}", "--island-id", str(lid), *shards,
                             "--out", str(out), "--seq-len", "64", "--batch-size", "2", "--lora-r", "4",
                             "--threads", "1", "--no-progress", *map(str, args)], cwd=REPO,
                            env=ENV if key is None else dict(ENV, **{JOIN_KEY_ENV: key}),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def wait_for(path, event, timeout=120, **fields):
    """Block until the tape at `path` has an `event` whose fields include `fields`."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        if (path / "tape.jsonl").exists() and any(
                e["event"] == event and all(e.get(k) == v for k, v in fields.items()) for e in read_tape(path)):
            return
        time.sleep(0.1)
    raise AssertionError(f"no {event} {fields or ''} on the tape within {timeout}s")


def _evaluated(out):
    metrics = out / "metrics.jsonl"
    return metrics.exists() and '"eval"' in metrics.read_text()


def loss_token_weights(merge, deltas):
    """The weights a default merge records: loss-bearing tokens (as claimed by a trusted island, any other's at most
    the round's low median), normalised, a stale delta's times (1+lag)^-0.5."""
    mine = [deltas[(merge["round"], lid)] for lid in merge["responders"]]
    assert merge["lags"] == [d["lag"] for d in mine]
    toks = capped_claims([d["loss_tokens"] for d in mine], [d["tier"] for d in mine])
    return [t / sum(toks) * staleness_factor(d["lag"], DEFAULT_STALENESS_EXPONENT) for t, d in zip(toks, mine)]


def finish(procs, timeout=240):
    outs = {}
    for name, p in procs.items():
        out, _ = p.communicate(timeout=timeout)
        outs[name] = (p.returncode, out)
    return outs


def test_weighted_merges_late_joiner_and_refusal(tiny_model, tmp_path):
    model, port, s_out = tiny_model("llama"), free_port(), tmp_path / "syncer"
    procs = {"syncer": syncer(port, s_out, "--islands", 2, "--quorum", 2, "--outer-steps", 4, "--inner-steps", 10,
                              "--sync-bits", 4)}
    procs[0] = start_island(model, port, 0, None, tmp_path / "l0", "--step-delay", 0.3)  # the syncer says the shards
    procs[1] = start_island(model, port, 1, None, tmp_path / "l1", "--max-inner-steps", 1)  # 10x fewer steps per round
    late = Link(port)  # the late ones start now (a loaded machine takes long to load a model) behind a cut link
    late.cut(LATE_CUT_S)
    procs[2] = start_island(model, late.port, 2, None, tmp_path / "l2")  # joins late: an id beyond --islands (extra)
    procs["bad"] = start_island(model, late.port, 3, 4, tmp_path / "bad", "--lora-r", "8")  # another adapter layout
    wait_for(s_out, "merge", round=1)
    deadline = time.time() + LATE_CUT_S
    while not all(_evaluated(tmp_path / d) for d in ("l2", "bad")) and time.time() < deadline:
        time.sleep(0.1)  # both late islands loaded their model (they evaluate it, then knock)
    procs[0].send_signal(signal.SIGSTOP)  # the run cannot end before island 2 joins it
    try:
        late.heal()
        wait_for(s_out, "join", island=2)
    finally:
        procs[0].send_signal(signal.SIGCONT)
    outs = finish(procs)
    late.close()
    assert outs["syncer"][0] == 0, outs["syncer"][1][-3000:]
    for lid in (0, 1, 2):
        assert outs[lid][0] == 0, outs[lid][1][-3000:]
    code, text = outs["bad"]
    assert code == 2 and "refused this island" in text and "lora_A" in text and "[8, 64]" in text
    shards = {lid: json.loads((tmp_path / f"l{lid}" / "summary.json").read_text())["shard"] for lid in (0, 1, 2)}
    assert shards == {0: [0, 2], 1: [1, 2], 2: [0, 2]}  # --islands 2 shards; the one beyond shares shard 0

    events = read_tape(s_out)
    merges = [e for e in events if e["event"] == "merge"]
    assert len(merges) == 4 and merges[0]["responders"] == [0, 1]
    deltas = {(e["round"], e["island"]): e for e in events if e["event"] == "delta"}
    for m in merges:  # every merge names its responders, weighted by loss-bearing tokens, a stale one discounted
        assert m["weights"] == pytest.approx(loss_token_weights(m, deltas))
    r1 = {r: deltas[(1, r)] for r in (0, 1)}
    assert r1[0]["inner_steps"] == 10 and r1[1]["inner_steps"] == 1
    w = dict(zip(merges[0]["responders"], merges[0]["weights"]))
    if len(w) == 2:  # on the join key (bounded), in a pair the longer claim counts as the shorter
        assert w[0] == pytest.approx(w[1])  # (on keys of their own, trusted, they weigh by tokens: test_attacks)
    tiers = {e["island"]: e["tier"] for e in events if e["event"] == "join"}
    assert tiers == {0: "bounded", 1: "bounded", 2: "extra"}
    for m in merges:  # the extra id counts for no more than the expected ids' low median claim
        if 2 in m["responders"]:
            counted = dict(zip(m["responders"], m["counted"]))
            assert counted[2] <= min(c for lid, c in counted.items() if lid != 2) + 1e-9
    join2 = next(e for e in events if e["event"] == "join" and e["island"] == 2)
    assert join2["round"] >= 2  # it joined a round already open: it trains that round from its base version
    rounds_with_2 = [m["round"] for m in merges if 2 in m["responders"]]
    assert rounds_with_2 and min(rounds_with_2) >= join2["round"]
    assert any(e["event"] == "refuse" and e["island"] == 3 for e in events)
    assert sum(1 for e in events if e["event"] == "checkpoint") >= 4
    t = subprocess.run([sys.executable, "-m", "yeto", "tape", str(s_out), "--plot"], cwd=REPO, env=ENV,
                       capture_output=True, text=True)
    assert t.returncode == 0 and "responders" in t.stdout and "refuse" in t.stdout, t.stderr
    assert (s_out / "tape.png").stat().st_size > 10_000

    from peft import PeftModel
    from safetensors.numpy import load_file
    from transformers import AutoModelForCausalLM

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(model), str(s_out / "adapter"))
    assert not [w for w in caught if "missing" in str(w.message).lower() or "unexpected" in str(w.message).lower()]
    merged = load_file(s_out / "adapter" / "adapter_model.safetensors")
    for lid in (0, 1, 2):  # every island ends on the merged global adapter
        mine = load_file(tmp_path / f"l{lid}" / "adapter" / "adapter_model.safetensors")
        assert sorted(mine) == sorted(merged) and all((mine[k] == merged[k]).all() for k in merged)


def test_quorum_two_of_three_with_a_straggler(tiny_model, tmp_path):
    model, port, s_out = tiny_model("llama"), free_port(), tmp_path / "syncer"
    procs = {"syncer": syncer(port, s_out, "--islands", 3, "--quorum", 2, "--outer-steps", 2, "--inner-steps", 4,
                              "--straggler-timeout", 2)}
    for lid in (0, 1):
        procs[lid] = start_island(model, port, lid, 3, tmp_path / f"l{lid}")
    procs[2] = start_island(model, port, 2, 3, tmp_path / "l2", "--step-delay", 3)
    outs = finish(procs)
    assert all(code == 0 for code, _ in outs.values()), {k: v[1][-2000:] for k, v in outs.items() if v[0]}
    merges = [e for e in read_tape(s_out) if e["event"] == "merge"]
    assert [m["responders"] for m in merges] == [[0, 1], [0, 1]]
    assert all(m["stragglers"] == [2] for m in merges)


def test_launch_local_fleet_and_ctrl_c(tiny_model, tmp_path):
    """A launched fleet runs, scores its --eval-task on each global, and stops on Ctrl-C."""
    model = tiny_model("llama")
    base = [sys.executable, "-m", "yeto", "launch", "--gpu", "local:2", "--model", str(model), "--data", str(DEMO_DATA),
            "--seq-len", "64", "--batch-size", "2", "--lora-r", "4"]
    task = write_task(tmp_path / "sums.jsonl")
    r = subprocess.run(base + ["--out", str(tmp_path / "ok"), "--outer-steps", "2", "--inner-steps", "3",
                               "--eval-task", str(task), "--eval-task-every", "1", "--eval-task-max-new-tokens", "4"],
                       cwd=REPO, env=ENV, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]
    check_task_evals(tmp_path / "ok")
    assert "merged adapter:" in r.stdout and (tmp_path / "ok" / "syncer" / "adapter" / "adapter_config.json").is_file()
    assert "[island-1]" in r.stdout and "[syncer]" in r.stdout
    tape = read_tape(tmp_path / "ok" / "syncer")  # each island on a key of its own: trusted, weighs by its tokens
    assert {e["tier"] for e in tape if e["event"] in ("join", "delta")} == {"trusted"}
    assert all(e["tiers"] == ["trusted", "trusted"] for e in tape if e["event"] == "merge")
    keys = sorted(p.name for p in (tmp_path / "ok" / "syncer" / "keys" / "islands").glob("*.key"))
    assert keys == ["0.key", "1.key"]

    p = subprocess.Popen(base + ["--out", str(tmp_path / "int"), "--outer-steps", "1000", "--inner-steps", "2"],
                         cwd=REPO, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                         start_new_session=True)
    wait_for(tmp_path / "int" / "syncer", "merge")
    os.killpg(p.pid, signal.SIGINT)  # what Ctrl-C in a terminal does: the whole foreground group
    out, _ = p.communicate(timeout=60)
    assert p.returncode == 130, out[-2000:]
    time.sleep(0.5)
    leftover = subprocess.run(["pgrep", "-f", str(tmp_path / "int")], capture_output=True, text=True).stdout.split()
    assert not leftover, f"processes left running: {leftover}"


def write_task(path, n=TASK_EXAMPLES):
    path.write_text("".join(json.dumps({"messages": [{"role": "user", "content": f"What is {i} + {i}?"}],
                                        "answer": str(2 * i)}) + "\n" for i in range(n)))
    return path


def check_task_evals(out):
    """--eval-task --eval-task-every 1 over 2 rounds: each island scored its first global (v0, at step 0) and the
    next (v1, at step 3), each while it waited for that round's merge, then the run's last (v2); its round-2 delta
    carried v0's score (round 1's went before its global was scored), which the tape records and `yeto tape`
    shows."""
    for island in (0, 1):
        lines = (out / f"island-{island}" / "metrics.jsonl").read_text().splitlines()
        scored = [e for e in map(json.loads, lines) if e["event"] == "task_eval"]
        assert [(e["round"], e["version"], e["step"]) for e in scored] == [(1, 0, 0), (2, 1, 3), (None, 2, 6)]
        assert all(e["n"] == TASK_EXAMPLES and e["task"] == "sums" and 0 <= e["held_s"] <= e["seconds"]
                   for e in scored) and scored[-1]["held_s"] == 0
        summary = json.loads((out / f"island-{island}" / "summary.json").read_text())
        assert summary["task_evals"] == 3 and summary["task_accuracy_after"] == scored[-1]["accuracy"]
    deltas = [e for e in read_tape(out / "syncer") if e["event"] == "delta"]
    assert sorted((d["round"], d["island"], d.get("task_eval", {}).get("version")) for d in deltas) == [
        (1, 0, None), (1, 1, None), (2, 0, 0), (2, 1, 0)]
    shown = subprocess.run([sys.executable, "-m", "yeto", "tape", str(out)], cwd=REPO, env=ENV, capture_output=True,
                           text=True, timeout=60)
    assert shown.returncode == 0 and "task acc" in shown.stdout and re.search(r"1: \d+\.\d% of v0", shown.stdout), \
        shown.stdout


def test_the_syncer_starts_a_run_from_an_existing_adapter(tiny_model, tmp_path):
    """`yeto syncer --init-adapter DIR`: version 0 is that adapter, exactly (its digest on the tape), whatever the
    founding island's own LoRA init; an island of another LoRA shape is refused in one line naming the flag."""
    from yeto.models.adapter import read_adapter
    from yeto.sync.wire.layout import build_layout, flatten
    from yeto.sync.wire.protocol import array_digest

    model = tiny_model("llama")
    first = subprocess.run([sys.executable, "-m", "yeto.backends.torch", "--model", str(model),
                            "--data", str(DEMO_DATA),
                            "--out", str(tmp_path / "first"), "--seq-len", "64", "--batch-size", "2", "--lora-r", "4",
                            "--max-steps", "3", "--eval-every", "0", "--threads", "1", "--no-progress"], cwd=REPO,
                           env=ENV, capture_output=True, text=True, timeout=240)
    assert first.returncode == 0, first.stdout[-2000:] + first.stderr[-2000:]
    init = read_adapter(tmp_path / "first" / "adapter")
    port, s_out = free_port(), tmp_path / "syncer"
    procs = {"syncer": syncer(port, s_out, "--islands", 1, "--quorum", 1, "--outer-steps", 1, "--inner-steps", 2,
                              "--init-adapter", tmp_path / "first")}
    bad = start_island(model, port, 1, None, tmp_path / "bad", "--lora-r", "8")
    out, _ = bad.communicate(timeout=240)
    assert bad.returncode == 2 and "--init-adapter" in out and "its r is 4, this run's is 8" in out, out[-2000:]
    procs[0] = start_island(model, port, 0, None, tmp_path / "l0", "--seed", "7")  # its own LoRA init is not version 0
    outs = finish(procs)
    for name, (code, text) in outs.items():
        assert code == 0, (name, text[-3000:])
    tape = read_tape(s_out)
    founded = next(e for e in tape if e["event"] == "init")
    assert founded["source"] == str(tmp_path / "first")
    assert founded["digest"] == array_digest(flatten(build_layout(init), init))
    assert sum(1 for e in tape if e["event"] == "merge") == 1
