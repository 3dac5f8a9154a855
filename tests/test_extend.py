"""A finished fleet extended: `yeto launch` again on its --out with more --outer-steps continues it (the syncer from
its tape and checkpoint, every island from its state), the same --outer-steps is refused before anything starts, and
--fresh starts the whole run over (tiny Llama, local:2)."""

import json
import os
import subprocess
import sys

from tests.conftest import DEMO_DATA, REPO
from tests.test_fleet import ENV
from yeto.island.checkpoint import load_state
from yeto.sync.shell.tape import read_tape

INNER = 2


def launch(model, out, outer, *args, timeout=300):
    env = dict(ENV, YETO_RUNS=str(out.parent / "runs"))
    return subprocess.run([sys.executable, "-m", "yeto", "launch", "--gpu", "local:2", "--model", str(model),
                           "--data", str(DEMO_DATA), "--out", str(out), "--outer-steps", str(outer), "--inner-steps",
                           str(INNER), "--seq-len", "64", "--batch-size", "2", "--lora-r", "4", *args], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=timeout)


def metrics(out):
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_a_finished_fleet_is_extended_refused_when_there_is_nothing_to_do_and_started_over(tiny_model, tmp_path):
    model, out = tiny_model("llama"), tmp_path / "fleet"
    first = launch(model, out, 2)
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-2000:]

    more = launch(model, out, 4)
    assert more.returncode == 0, more.stdout[-4000:] + more.stderr[-2000:]
    tape = read_tape(out / "syncer")
    merges = [e for e in tape if e["event"] == "merge"]
    assert [m["version"] for m in merges] == [1, 2, 3, 4]
    assert all(m["responders"] == [0, 1] for m in merges), [m["responders"] for m in merges]
    assert not [e for e in tape if e["event"] == "given_up"]
    assert [e["version"] for e in tape if e["event"] == "resume"] == [2]
    for i in (0, 1):
        island = out / f"island-{i}"
        state = load_state(island)
        assert state.meta["finished"] and state.meta["step"] == 4 * INNER  # its steps went on from round 2's
        log = metrics(island)
        resumed = next(k for k, e in enumerate(log) if e["event"] == "resumed")
        assert log[resumed]["step"] == 2 * INNER
        rounds = [e["round"] for e in log[resumed:] if e["event"] == "round"]
        assert rounds == [3, 4]
        done = [e for e in log if e["event"] == "done"]
        assert len(done) == 2
        # the second session's baseline is the global it resumed from (the first one's end), not the base model
        assert done[1]["eval_loss_before"] == done[0]["eval_loss_after"], done

    again = launch(model, out, 4)
    assert again.returncode == 2, again.stdout[-2000:] + again.stderr[-2000:]
    lines = [line for line in again.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "--outer-steps" in lines[0] and "--fresh" in lines[0], again.stderr
    assert not (out / "logs" / "syncer.log").read_text().count("resumed at version 4")  # nothing started

    fresh = launch(model, out, 1, "--fresh")
    assert fresh.returncode == 0, fresh.stdout[-3000:] + fresh.stderr[-2000:]
    tape = read_tape(out / "syncer")
    assert [e["version"] for e in tape if e["event"] == "merge"] == [1]
    assert not [e for e in tape if e["event"] == "resume"]
    for i in (0, 1):
        assert load_state(out / f"island-{i}").meta["step"] == INNER
        assert "resumed" not in {e["event"] for e in metrics(out / f"island-{i}")}
    assert os.path.isfile(out / "syncer" / "keys" / "islands" / "0.key")  # the run's credentials stay
