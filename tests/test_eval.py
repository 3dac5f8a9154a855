"""Task evaluation: answer extraction, normalized exact match, the intervals, user scorers, task files, and `yeto eval`
end to end on a tiny random model (the base and adapters on it, side by side)."""

from __future__ import annotations

import json
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

from tests.conftest import DEMO_DATA, REPO
from yeto import YetoError
from yeto.eval.score import exact_match, extract_answer, normalize, paired_difference, wilson_interval
from yeto.eval.task import Task, evaluate_task, load_task, read_task_file

YETO = [sys.executable, "-m", "yeto"]
TIMEOUT_S = 300
NEW_TOKENS = 4  # a tiny model's answers: short, the suite stays fast
QUESTIONS = ("What is 2 + 3?", "Name a colour.", "Capital of Peru?", "Say hello.", "Count to three.", "Ahoy?")


@pytest.mark.parametrize("output, answer", [
    ("<answer> 42 </answer> and more", "42"),
    ("<ANSWER>Lima", "Lima"),  # an unclosed tag: the answer runs to the end
    ("working...\n#### 1,234", "1,234"),
    ("Let me think. The answer is 7.", "7"),  # (a sentence's full stop is not the answer's)
    ("The answer to 3 + 4 is: 7", "7"),
    ("3.5", "3.5"),
    ("so the final answer: blue", "blue"),
    ("\n\n  Paris  \nbecause it is", "Paris"),
    ("", ""),
])
def test_extract_answer_finds_tags_markers_and_the_first_line(output, answer):
    assert extract_answer(output) == answer


@pytest.mark.parametrize("a, b", [("1,234", "1234"), ("$5", "5"), ("50%", "50"), ("3.0", "3"), ("Lima.", "lima"),
                                  ("  The   Cat ", "the cat"), ('"yes"!', "yes"), ("-2", "-2.00")])
def test_normalize_ignores_case_punctuation_spacing_and_number_format(a, b):
    assert normalize(a) == normalize(b) and exact_match(a, b, {}) == 1.0


@pytest.mark.parametrize("a, b", [("12", "13"), ("Lima", "Lima Peru"), ("1.5", "15"), ("-2", "2")])
def test_exact_match_still_tells_different_answers_apart(a, b):
    assert exact_match(a, b, {}) == 0.0


@pytest.mark.parametrize("successes, n, low, high", [(0, 10, 0.0, 0.2775), (5, 10, 0.2366, 0.7634),
                                                     (10, 10, 0.7225, 1.0), (81, 100, 0.7222, 0.8749)])
def test_wilson_interval_matches_known_values(successes, n, low, high):
    ci = wilson_interval(successes, n)
    assert ci.value == pytest.approx(successes / n)
    assert (ci.low, ci.high) == (pytest.approx(low, abs=1e-4), pytest.approx(high, abs=1e-4))


def test_paired_difference_is_the_mean_change_with_the_paired_interval():
    a = [0, 0, 1, 1, 0, 1, 0, 0]
    b = [1, 0, 1, 1, 1, 1, 0, 1]  # three gained, none lost
    d = paired_difference(a, b)
    diffs = [y - x for x, y in zip(a, b)]
    mean = sum(diffs) / len(diffs)
    sd = (sum((x - mean) ** 2 for x in diffs) / (len(diffs) - 1)) ** 0.5
    assert d.value == pytest.approx(3 / 8)
    assert (d.low, d.high) == (pytest.approx(mean - 1.959964 * sd / 8 ** 0.5), pytest.approx(mean + 1.959964 * sd /
                                                                                              8 ** 0.5))
    assert paired_difference(a, a).as_dict() == {"value": 0.0, "low": 0.0, "high": 0.0}
    with pytest.raises(ValueError):
        paired_difference(a, b[:-1])


def _records(n: int = 4) -> list[dict]:
    return [{"messages": [{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}], "answer": f"a{i}"}
            for i in range(n)]


def test_a_scorer_that_gives_no_score_in_range_or_raises_is_one_line_naming_the_example(chat_file):
    task = Task("t", read_task_file(chat_file(_records())))
    answers = lambda prompts, _n: ["x"] * len(prompts)  # noqa: E731
    for scorer, says in ((lambda a, r, rec: 2, "the scorer gave 2 for example 0 of t: a score must be a number in "
                                               "[0, 1]"),
                         (lambda a, r, rec: 1 / 0, "the scorer failed on example 0 of t (ZeroDivisionError")):
        with pytest.raises(YetoError) as e:
            evaluate_task(answers, Task("t", task.examples, scorer))
        assert str(e.value).startswith(says) and "\n" not in str(e.value)


def test_task_files_take_prompts_or_conversations_and_training_records(chat_file):
    path = chat_file([{"prompt": "2+2=", "answer": 4},
                      {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ahoy"}]}])
    first, second = read_task_file(path)
    assert (first.prompt, first.reference) == ("2+2=", "4")
    assert (second.prompt, second.reference) == ([{"role": "user", "content": "hi"}], "ahoy")  # the answer turn out
    assert len(load_task(str(path), limit=1).examples) == 1


@pytest.fixture(scope="module")
def adapters(tiny_model, tmp_path_factory):
    """Two adapters of the tiny llama whose greedy answers differ from the base's and from each other's; the second
    adapts fewer linears (a first one's layers left on the others would change its answers)."""
    from yeto.backends.torch.island import TorchIsland, TrainConfig

    made = []
    for name, steps, lr, targets in (("first", 5, 0.1, "all-linear"), ("second", 5, 0.1, "attention")):
        cfg = TrainConfig(model=str(tiny_model("llama")), data=str(DEMO_DATA), seq_len=64, batch_size=2,
                          max_steps=steps, lora_r=4, lora_targets=targets, lora_dropout=0.0, lr=lr)
        island = TorchIsland(cfg, log=lambda s: None)
        for _ in range(steps):
            island.step()
        made.append(island.save(tmp_path_factory.mktemp(name) / "adapter"))
    return made


def _prompts() -> list[list[dict]]:
    return [[{"role": "user", "content": q}] for q in QUESTIONS]


@pytest.fixture(scope="module")
def fresh_answers(tiny_model, adapters):
    """The base's, then each adapter's greedy answers, each on a freshly loaded base (peft's own loading)."""
    from peft import PeftModel

    from yeto.backends.torch.generate import greedy_batch
    from yeto.models.materialize import load_model, load_tokenizer, resolve_model

    artifact = resolve_model(str(tiny_model("llama")))
    tokenizer = load_tokenizer(artifact)
    fresh = []
    for adapter in (None, *adapters):
        model = load_model(artifact, "cpu").eval()
        model = PeftModel.from_pretrained(model, str(adapter)).eval() if adapter else model
        fresh.append(greedy_batch(model, tokenizer, _prompts(), NEW_TOKENS))
    assert len({tuple(answers) for answers in fresh}) == 3, fresh  # base, first and second answer differently
    return fresh


@pytest.mark.parametrize("backend", ["torch", "mlx"])
def test_the_base_is_clean_between_adapters(backend, tiny_model, adapters, fresh_answers):
    """Each adapter in one session answers as it does on a freshly loaded base: the layers of the adapter before
    are gone when the next loads (base, first and second answer differently, so a leftover would show). MLX's
    session answers what torch's peft does."""
    from yeto.models.materialize import resolve_model

    if backend == "mlx":
        pytest.importorskip("mlx_lm")
        from yeto.backends.mlx.generate import task_generators
    else:
        from yeto.backends.torch.generate import task_generators
    artifact = resolve_model(str(tiny_model("llama")))
    session = [generate(_prompts(), NEW_TOKENS)
               for generate in task_generators(artifact, [adapters[0], adapters[1], adapters[0]], "cpu")]
    assert session == [*fresh_answers, fresh_answers[1]]


def _yeto(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([*YETO, *args], cwd=REPO, capture_output=True, text=True, timeout=TIMEOUT_S)


def _yeto_eval_here(*args: str) -> Any:
    """`yeto eval ARGS` in this process, which has torch loaded already (a subprocess would import it again: the
    subprocess cases are the refusals, where exit 2 and the one line are what counts)."""
    import typer
    from typer.testing import CliRunner

    from yeto.cli.eval_command import eval_command

    single = typer.Typer(add_completion=False)
    single.command()(eval_command)
    result = CliRunner().invoke(single, list(args))
    assert result.exit_code == 0, (result.output[-3000:], result.exception)
    return result


def test_yeto_eval_scores_base_and_adapters_side_by_side(tiny_model, adapters, chat_file, tmp_path):
    """References are the base's own answers on half the examples: its accuracy is 1/2 by construction, and the
    adapters' rows, files and differences must agree with each other."""
    from yeto.backends.torch.generate import greedy_batch
    from yeto.models.materialize import load_model, load_tokenizer, resolve_model

    artifact = resolve_model(str(tiny_model("llama")))
    said = greedy_batch(load_model(artifact, "cpu").eval(), load_tokenizer(artifact), list(QUESTIONS), NEW_TOKENS)
    half = len(QUESTIONS) // 2
    records = [{"prompt": q, "answer": extract_answer(s) if i < half else "no such answer"}
               for i, (q, s) in enumerate(zip(QUESTIONS, said))]
    task = chat_file(records, "task.jsonl")
    out = tmp_path / "answers"
    r = _yeto_eval_here(str(adapters[0]), str(adapters[1]), "--task", str(task), "--max-new-tokens", str(NEW_TOKENS),
                        "--batch-size", "4", "--device", "cpu", "--out", str(out))
    summary = json.loads((out / "summary.json").read_text())
    labels = [m["label"] for m in summary["models"]]
    named = [f"{a.parent.name}/{a.name}" for a in adapters]  # (both adapters are in a directory named adapter)
    assert labels == ["base", *named] and summary["first"] == "base"
    base = summary["models"][0]
    assert (base["accuracy"], base["n"], base["difference_vs_first"]) == (0.5, len(QUESTIONS), None)
    rows = {label: [json.loads(line) for line in (out / f"{label.replace('/', '_')}.jsonl").read_text().splitlines()]
            for label in labels}
    assert [r["output"] for r in rows["base"]] == said
    assert [r["index"] for r in rows["base"]] == list(range(len(QUESTIONS)))
    assert set(rows["base"][0]) == {"index", "question", "reference", "output", "answer", "score"}
    for model in summary["models"]:
        scores = [r["score"] for r in rows[model["label"]]]
        assert model["accuracy"] == pytest.approx(sum(scores) / len(scores))
        assert (model["low"], model["high"]) == pytest.approx(
            (wilson_interval(sum(scores), len(scores)).low, wilson_interval(sum(scores), len(scores)).high))
        if model["difference_vs_first"]:
            assert model["difference_vs_first"] == pytest.approx(
                paired_difference([r["score"] for r in rows["base"]], scores).as_dict())
    assert [r["output"] for r in rows[named[0]]] != said  # the adapter answers otherwise: the check has teeth
    table = r.stdout
    assert "accuracy [95% CI]" in table and "vs base" in table and "50.0 [" in table, table
    assert all(label in table for label in named) and "examples (" in table, table


def test_yeto_eval_takes_a_scorer_from_a_file_and_a_base_model_alone(tiny_model, chat_file, tmp_path):
    scorer = tmp_path / "my_scorer.py"
    scorer.write_text("def credit(answer, reference, record):\n    return record['credit']\n")
    records = [{**r, "credit": c} for r, c in zip(_records(4), (1.0, 0.5, 0.0, 1.0))]
    r = _yeto_eval_here("--model", str(tiny_model("llama")), "--task", str(chat_file(records)), "--scorer",
                        f"{scorer}:credit", "--json", "--max-new-tokens", "1", "--limit", "3", "--device", "cpu")
    (model,) = json.loads(r.stdout)["models"]
    assert (model["label"], model["n"], model["accuracy"]) == ("base", 3, 0.5)
    assert json.loads(r.stdout)["scorer"] == f"{scorer}:credit" and not r.stderr.strip()  # --json: no progress


def test_yeto_eval_refuses_bad_input_in_one_line(tiny_model, adapters, chat_file, tmp_path):
    """A task file that is not JSON, has no answer or is missing; an unknown scorer; a scorer giving 2; nothing to
    evaluate; adapters on different bases: one `error:` line naming it, exit 2."""
    from safetensors.numpy import load_file, save_file

    other = tmp_path / "other-base"  # the first adapter, recorded as another base's (peft's record alone)
    other.mkdir()
    save_file(load_file(str(adapters[0] / "adapter_model.safetensors")), str(other / "adapter_model.safetensors"))
    config = json.loads((adapters[0] / "adapter_config.json").read_text())
    (other / "adapter_config.json").write_text(json.dumps({**config, "base_model_name_or_path":
                                                           str(tiny_model("lfm2"))}))
    not_json = tmp_path / "not.jsonl"
    not_json.write_text('{"prompt": "a", "answer": "b"}\n{"prompt": oops}\n')
    no_answer = chat_file([{"prompt": "a"}], "no_answer.jsonl")
    good = chat_file(_records(2), "good.jsonl")
    two = tmp_path / "two.py"
    two.write_text("def score(answer, reference, record):\n    return 2\n")
    tiny = str(tiny_model("llama"))
    cases = [(["--model", tiny, "--task", str(not_json)], f"{not_json}:2: not JSON"),
             (["--model", tiny, "--task", str(no_answer)], f"{no_answer}:1: no 'answer'"),
             (["--model", tiny, "--task", str(tmp_path / "missing.jsonl")], "task file not found"),
             (["--model", tiny, "--task", str(good), "--scorer", "nosuch"], "--scorer 'nosuch': give"),
             (["--model", tiny, "--task", str(good), "--scorer", f"{two}:score", "--max-new-tokens", "1"],
              "the scorer gave 2 for example 0"),
             (["--task", str(good)], "nothing to evaluate"),
             ([str(adapters[0]), str(other), "--task", str(good)], "adapt different base models")]
    with ThreadPoolExecutor(2) as pool:
        results = list(pool.map(lambda case: _yeto("eval", *case[0], "--device", "cpu"), cases))
    for (args, says), r in zip(cases, results):
        lines = [line for line in r.stderr.splitlines() if line.strip()]
        assert r.returncode == 2 and len(lines) == 1 and says in lines[0], (args, r.stderr[-2000:])


def test_adapter_labels_are_run_names_or_the_fewest_path_parts_that_tell_them_apart(tmp_path):
    from yeto.cli.eval_command import adapter_labels, file_name

    for d in ("a/island-0", "b/island-0", "fleet", "x/base"):
        (tmp_path / d).mkdir(parents=True)
    targets = [str(tmp_path / "a/island-0"), str(tmp_path / "b/island-0"), str(tmp_path / "fleet") + "/", "pirate",
               str(tmp_path / "x/base"), str(tmp_path / "fleet")]
    labels = adapter_labels(targets, [tmp_path] * len(targets))
    assert labels == ["a/island-0", "b/island-0", "fleet", "pirate", "x/base", "fleet (2)"]
    assert [file_name(label) for label in labels[:2]] == ["a_island-0", "b_island-0"]
