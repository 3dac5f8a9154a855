"""Generated tasks (`yeto data task`, yeto.eval.gym on reasoning-gym): a training file and a held-out set that share no
question, records the training reader takes as chats, each task's own scorer on them, and the command's errors."""

import json
import subprocess
import sys

import pytest

from tests.conftest import REPO
from tests.test_data import one_error_line, run_yeto
from yeto import YetoError

pytest.importorskip("reasoning_gym", reason="reasoning-gym is not installed (the tasks extra)")
from yeto.eval import gym  # noqa: E402
from yeto.eval.task import load_task  # noqa: E402

SMALL = {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1}  # a few hundred distinct sums in all
LARGE = "gcd"  # pairs of numbers up to 1000: questions hardly ever repeat across seeds


def questions(records):
    return [r["messages"][0]["content"] for r in records]


def read_jsonl(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_overlapping_seed_ranges_share_questions():
    """Why the held-out set starts past every training range: item i is made from seed + i."""
    first, shifted = gym.task_records(LARGE, 100, 0), gym.task_records(LARGE, 100, 50)
    assert questions(first)[50:] == questions(shifted)[:50]
    apart = gym.task_records(LARGE, 100, 10_000)
    assert not set(questions(first)) & set(questions(apart))


def test_the_training_file_and_the_held_out_set_share_no_question(tmp_path):
    out = tmp_path / "gcd.jsonl"
    wrote = gym.write_task(LARGE, 300, 7, out, held_out=60)
    train, held = read_jsonl(out), read_jsonl(tmp_path / "gcd.heldout.jsonl")
    assert (wrote["train_records"], wrote["held_out_records"], len(held)) == (len(train), 60, 60)
    assert held == gym.task_records(LARGE, 60, gym.HELD_OUT_SEED)  # every arm of a comparison gets these
    assert not set(questions(train)) & set(questions(held))
    # a held-out range inside the training seeds would drop its 60 questions from the file; past them, none is
    assert wrote["dropped"] == 0 and train == gym.task_records(LARGE, 300, 7)


def test_the_default_held_out_file_is_the_task_eval_generates_by_name(tmp_path):
    """`yeto eval --task gcd` and `--task gcd.heldout.jsonl` written with the defaults score the same examples."""
    from yeto.eval.task import generated_task

    gym.write_task(LARGE, 10, 0, tmp_path / "gcd.jsonl")
    by_file, by_name = load_task(str(tmp_path / "gcd.heldout.jsonl")), generated_task(LARGE)
    assert [e.record for e in by_file.examples] == [e.record for e in by_name.examples]
    assert len(by_name.examples) == gym.DEFAULT_HELD_OUT


def test_a_small_generator_repeats_questions_and_the_training_file_drops_those_held_out(tmp_path):
    raw = gym.task_records("basic_arithmetic", 400, 0, SMALL)
    held_raw = gym.task_records("basic_arithmetic", 50, gym.HELD_OUT_SEED, SMALL)
    asked = set(questions(held_raw))
    repeated = [q for q in questions(raw) if q in asked]
    assert repeated  # disjoint seed ranges, the same questions: seeds alone do not keep them apart
    out = tmp_path / "sums.jsonl"
    wrote = gym.write_task("basic_arithmetic", 400, 0, out, held_out=50, config=SMALL)
    train = read_jsonl(out)
    assert wrote["dropped"] == len(repeated) and len(train) == 400 - len(repeated)
    assert not set(questions(train)) & set(questions(read_jsonl(tmp_path / "sums.heldout.jsonl")))


def test_the_records_are_chats_the_training_reader_learns_the_answer_of(tmp_path, tokenizer):
    from yeto.island.data import inspect_data, read_data

    out = tmp_path / "tasks" / "spell.jsonl"
    gym.write_task("spell_backward", 40, 0, out, held_out=10)
    report = inspect_data(read_data(str(out), tokenizer, 256, eval_fraction=0.1))
    assert report["formats"] == {"chat": 40} and report["unusable"] == {}
    first = read_jsonl(out)[0]
    sample = report["sample"]
    learned = [t for t, m in zip(sample["ids"], sample["mask"]) if m]
    assert tokenizer.decode(learned).startswith(first["answer"])  # the assistant's turn: the answer alone
    assert first["messages"][0]["content"] in tokenizer.decode(sample["ids"])
    # the held-out twin beside it: a directory of both trains on the training file alone, and says so
    both = inspect_data(read_data(str(out.parent), tokenizer, 256, eval_fraction=0.1))
    assert both["formats"] == {"chat": 40}
    assert any("spell.heldout.jsonl" in s and "held-out" in s for s in both["skipped_files"]), both["skipped_files"]


@pytest.mark.parametrize("name,config", [("gcd", {}), ("spell_backward", {}), ("basic_arithmetic", SMALL)])
def test_held_out_records_score_one_on_their_reference_and_zero_on_a_wrong_answer(tmp_path, name, config):
    out = tmp_path / f"{name}.jsonl"
    gym.write_task(name, 5, 0, out, held_out=20, config=config)
    task = load_task(str(tmp_path / f"{name}.heldout.jsonl"))
    assert task.scorer_name == f"{name} (its own scorer)" and len(task.examples) == 20
    for e, other in zip(task.examples, task.examples[1:] + task.examples[:1]):
        assert task.scorer(e.reference, e.reference, e.record) == 1.0
        assert task.scorer("", e.reference, e.record) == 0.0
        if other.reference != e.reference:  # another question's answer (spell_backward gives partial credit)
            assert task.scorer(other.reference, e.reference, e.record) < 1.0


def test_config_values_read_as_json_where_they_are():
    assert gym.parse_config(["max_digits=2", "allow_negation=false", "operators=[\"+\", \"-\"]", "style=natural",
                             "ratio=0.5", "note=a=b"]) == {
        "max_digits": 2, "allow_negation": False, "operators": ["+", "-"], "style": "natural", "ratio": 0.5,
        "note": "a=b"}
    with pytest.raises(YetoError, match="'max_digits' is not KEY=VALUE"):
        gym.parse_config(["max_digits"])


def test_the_settings_reach_the_generator():
    shape = [(r["metadata"]["num_terms"], r["metadata"]["num_digits"]) for r in gym.task_records("basic_arithmetic",
                                                                                                 30, 0)]
    assert max(shape) > (2, 1)  # the defaults: up to 6 terms of up to 4 digits
    records = gym.task_records("basic_arithmetic", 30, 0, gym.parse_config(["max_digits=1", "max_terms=2"]))
    assert {(r["metadata"]["num_terms"], r["metadata"]["num_digits"]) for r in records} == {(2, 1)}


def test_data_task_writes_both_files_and_says_what_it_wrote(tmp_path):
    out = tmp_path / "sums.jsonl"
    r = run_yeto("data", "task", "basic_arithmetic", "--n", 400, "--seed", 0, "--out", out, "--held-out", 50,
                 *[a for k, v in SMALL.items() for a in ("--setting", f"{k}={v}")], timeout=120)
    assert r.returncode == 0, r.stderr
    train, held = read_jsonl(out), read_jsonl(tmp_path / "sums.heldout.jsonl")
    dropped = 400 - len(train)
    assert dropped > 0 and len(held) == 50
    lines = r.stdout.splitlines()
    assert lines[0].startswith(f"basic_arithmetic with {json.dumps(SMALL)}: {len(train)} training records to {out} "
                               f"(seeds 0..399; {dropped} dropped: the held-out set asks them)")
    assert lines[1] == f"held out: 50 records to {tmp_path / 'sums.heldout.jsonl'} (seeds {gym.HELD_OUT_SEED} on)"
    r = run_yeto("data", "task", "gcd", "--n", 20, "--out", tmp_path / "g.jsonl", "--held-out", 5, "--json",
                 timeout=120)
    assert json.loads(r.stdout)["train_records"] == 20 and json.loads(r.stdout)["held_out_seed"] == gym.HELD_OUT_SEED
    r = run_yeto("data", "task", "--list", timeout=120)
    assert r.returncode == 0 and any(line.split()[:1] == ["gcd"] for line in r.stdout.splitlines())


@pytest.mark.parametrize("args,message", [
    (["basic_arithmetc"], r"unknown task 'basic_arithmetc' \(did you mean basic_arithmetic, .*yeto data task --list"),
    (["gcd", "--setting", "max_valu=9"], r"task gcd has no setting 'max_valu' \(did you mean max_value, .*\); it takes "
                                        r"min_numbers=2, "),
    (["gcd", "--setting", "min_value=-5"], r"task gcd refuses its settings \{\"min_value\": -5\}: min_value must be "),
    (["gcd", "--setting", "min_value"], r"--setting 'min_value' is not KEY=VALUE"),
    (["gcd", "--seed", "999999999"], r"--seed 999999999 with --n 2000 reaches the held-out seeds \(1000000000 on\)"),
    (["gcd", "--n", "0"], r"--n must be at least 1, got 0"),
    ([], r"name a task: yeto data task NAME --out FILE"),
])
def test_data_task_errors_are_one_line(tmp_path, args, message):
    import re

    extra = ["--out", str(tmp_path / "t.jsonl")] if args else []
    line = one_error_line(run_yeto("data", "task", *args, *extra, timeout=120))
    assert re.search(message, line), line
    assert not (tmp_path / "t.jsonl").exists()


def test_without_reasoning_gym_data_task_names_the_extra(tmp_path):
    blocked = ("import sys; sys.modules['reasoning_gym'] = None; sys.argv = ['yeto'] + sys.argv[1:]; "
               "from yeto.cli import main; main()")
    for args in (["gcd", "--out", str(tmp_path / "t.jsonl")], ["--list"]):
        r = subprocess.run([sys.executable, "-c", blocked, "data", "task", *args], capture_output=True, text=True,
                           cwd=REPO, timeout=120)
        assert "pip install 'yeto[tasks]'" in one_error_line(r)
