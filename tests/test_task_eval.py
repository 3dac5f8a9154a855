"""Accuracy on a task during a run (`--eval-task`): standalone, a bad task file, and the syncer's reading of a
delta's `task_eval` header (a fleet's islands, the tape and `yeto tape`: tests/test_fleet.py's launched fleet)."""

import json
import os
import subprocess
import sys

import pytest

from tests.conftest import DEMO_DATA, REPO
from yeto.sync.core.deltas import task_eval_of

ENV = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
EXAMPLES = 3  # a task this small scores in a fraction of a second on the tiny model


def write_task(path, n=EXAMPLES):
    path.write_text("".join(json.dumps({"messages": [{"role": "user", "content": f"What is {i} + {i}?"}],
                                        "answer": str(2 * i)}) + "\n" for i in range(n)))
    return path


def events(out, name="task_eval"):
    return [e for e in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if e["event"] == name]


def test_a_standalone_run_scores_its_task_at_the_start_every_n_steps_and_the_end(tiny_model, tmp_path):
    from yeto.backends.torch.backend import TorchBackend
    from yeto.island.train_config import TrainConfig
    from yeto.island.training import train

    task = write_task(tmp_path / "sums.jsonl")
    cfg = TrainConfig(model=str(tiny_model("llama")), data=str(DEMO_DATA), out=str(tmp_path / "run"), seq_len=64,
                      batch_size=2, lora_r=4, max_steps=4, eval_every=0, eval_task=str(task), eval_task_every=2,
                      eval_task_max_new_tokens=4)
    s = train(cfg, TorchBackend(), show_progress=False)
    scored = events(tmp_path / "run")
    assert [e["step"] for e in scored] == [0, 2, 4]  # start, every 2 steps (not the last: the end's), end
    assert all(e["round"] is None and e["version"] is None and e["task"] == "sums" and e["n"] == EXAMPLES
               and 0 <= e["low"] <= e["accuracy"] and e["accuracy"] <= e["high"] <= 1
               and e["held_s"] == e["seconds"] for e in scored)
    assert s["task_accuracy_before"] == scored[0]["accuracy"] and s["task_accuracy_after"] == scored[-1]["accuracy"]
    assert s["task_eval_seconds"] > 0 and s["task_evals"] == 3
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["task_eval_seconds"] == s["task_eval_seconds"]


def test_a_bad_task_file_is_one_line_before_any_model_loads(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "2+2?", "answer": "4"}\nnot json\n')
    r = subprocess.run([sys.executable, "-m", "yeto", "train", "--model", str(tmp_path / "no-such-model"),
                        "--out", str(tmp_path / "run"), "--eval-task", str(bad)], cwd=REPO, env=ENV,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stderr[-2000:]
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and f"{bad}:2: not JSON" in lines[0], r.stderr
    assert not (tmp_path / "run").exists()  # (nor was the missing model looked for)


def test_the_syncer_records_a_well_formed_task_eval_and_drops_a_malformed_one():
    good = {"version": 2, "accuracy": 0.5, "n": 200}
    assert task_eval_of(good, 3) == good
    assert task_eval_of({**good, "accuracy": 1}, 3) == {**good, "accuracy": 1.0}
    for bad in (None, "0.5", [2, 0.5, 200], {**good, "version": 4}, {**good, "version": -1}, {**good, "version": 2.0},
                {**good, "accuracy": 1.5}, {**good, "accuracy": float("nan")}, {**good, "accuracy": True},
                {**good, "accuracy": "0.5"}, {**good, "n": 0}, {**good, "n": True}, {"version": 2, "accuracy": 0.5}):
        assert task_eval_of(bad, 3) is None, bad


def test_a_delta_with_a_malformed_task_eval_is_merged_and_its_score_dropped():
    """The cores: each island's delta reports a score (RoundCounts.task_eval); the syncer records a well-formed one
    on the delta's tape record and drops a malformed one, merging both deltas all the same."""
    from tests.test_core import Fleet
    from yeto.sync.core.island import RoundCounts, StepVerdict

    f = Fleet(n=2, outer_steps=1)
    scores = {0: {"version": 0, "accuracy": 0.25, "n": 8}, 1: {"version": 0, "accuracy": 2.0, "n": 8}}
    for lid, score in scores.items():
        c = f.islands[lid]
        task = c.next_task(f.now)
        assert c.after_step(2, f.now) is StepVerdict.PUSH
        counts = RoundCounts(100, 50, 2, 1.0, 0.1, task_eval=score)
        assert counts.header()["task_eval"] == score
        f.to_syncer(lid, c.push(task.adapter + 0.01, counts))
        f.run()
    (merge,) = [e for e in f.tape if e["event"] == "merge"]
    assert merge["responders"] == [0, 1]
    deltas = {e["island"]: e for e in f.tape if e["event"] == "delta"}
    assert deltas[0]["task_eval"] == scores[0] and "task_eval" not in deltas[1]


def test_a_torchrun_island_relays_generate_so_every_rank_takes_the_same_forward_passes():
    """A sharded base's forward needs every rank: rank 0's `generate` goes to the others first, and they make it."""
    pytest.importorskip("torch")
    from yeto.backends.torch.torchrun import RelayedIsland, follow

    class Group:
        def __init__(self, commands=()):
            self.sent, self.queue = [], list(commands)

        def share(self, obj=None):
            if obj is not None:
                self.sent.append(obj)
                return obj
            return self.queue.pop(0)

    class Island:
        backend = "torch"

        def __init__(self):
            self.calls = []

        def generate(self, prompts, max_new_tokens):
            self.calls.append((prompts, max_new_tokens))
            return [p.upper() for p in prompts]

    leader, group = Island(), Group()
    assert RelayedIsland(leader, group).generate(["a", "b"], 4) == ["A", "B"]
    assert group.sent == [{"op": "generate", "prompts": ["a", "b"], "max_new_tokens": 4}]
    other = Island()
    follow(other, Group([*group.sent, {"op": "exit"}]))
    assert other.calls == leader.calls == [(["a", "b"], 4)]


def test_an_evaluation_in_a_fleet_holds_the_round_only_past_the_wait_for_the_merge(tmp_path):
    """held_s: what the evaluation kept the island from its next round, counted from the last batch boundary at which
    it still waited for the merge (all of it when the merge had come, none when it still has not)."""
    import time

    from yeto.eval.task import DEFAULT_BATCH_SIZE, load_task
    from yeto.island.task_eval import TaskEvals

    batch_s = 0.2  # each batch's generation (a sleep): room for a loaded machine's slack

    class Island:
        step_count = 7

        def generate(self, prompts, max_new_tokens):
            time.sleep(batch_s)
            return ["0"] * len(prompts)

    task = load_task(str(write_task(tmp_path / "sums.jsonl", n=2 * DEFAULT_BATCH_SIZE)))
    evals = TaskEvals(task, every=1, max_new_tokens=4, report=lambda e: None)
    polls = []

    def merge_comes_in_the_second_batch():
        polls.append(None)
        return len(polls) < 3  # waiting at the start and after batch 1, not after batch 2

    cases = ((lambda: True, 0.0), (lambda: False, 2 * batch_s), (merge_comes_in_the_second_batch, batch_s))
    for waiting, held in cases:
        e = evals.evaluate(Island(), 3, 2, waiting)
        assert e["accuracy"] == 1 / len(task.examples) and (e["round"], e["version"], e["step"]) == (3, 2, 7)
        assert held <= e["held_s"] < held + batch_s, (held, e)
    standalone = evals.evaluate(Island())
    assert standalone["held_s"] == standalone["seconds"] and evals.header() == {"version": 2, "accuracy": e["accuracy"],
                                                                               "n": 2 * DEFAULT_BATCH_SIZE}
