"""A task: prompts with reference answers and the scorer that judges them, read from a JSONL file (or made by a
generator, `yeto.eval.gym`), and its evaluation through any backend's greedy, batched `generate`.

A record is `{"messages": [...], "answer": "..."}` or `{"prompt": "...", "answer": "..."}`. A conversation that
ends with the assistant's turn (a training record) is prompted without that turn, and the turn is the reference
when there is no `answer`; so the file a fleet trains on and its held-out twin have one format.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional, Sequence, Union

from yeto import YetoError
from yeto.eval.score import Scorer, checked_score, exact_match, extract_answer, load_scorer, summary

Prompt = Union[list[dict[str, str]], str]  # a conversation (rendered with the chat template) or raw text
Generate = Callable[[list[Prompt], int], list[str]]  # (prompts, max new tokens) -> outputs, greedy
DEFAULT_MAX_NEW_TOKENS = 32  # a short answer's room; longer answers (a worked solution) raise --max-new-tokens
DEFAULT_BATCH_SIZE = 16  # prompts per generate call
GENERATOR_KEY = "task"  # a record made by a generator names it; its own scorer then judges the answers


@dataclass(frozen=True)
class TaskExample:
    index: int
    prompt: Prompt
    reference: str
    record: dict[str, Any]

    def question(self) -> str:
        """The prompt's last user turn (what a table of examples shows)."""
        if isinstance(self.prompt, str):
            return self.prompt
        users = [m["content"] for m in self.prompt if m.get("role") == "user"]
        return users[-1] if users else self.prompt[-1]["content"]


@dataclass
class Task:
    name: str
    examples: list[TaskExample]
    scorer: Scorer = exact_match
    scorer_name: str = "exact_match"
    meta: dict[str, Any] = field(default_factory=dict)


def example_from_record(index: int, record: Any, where: str) -> TaskExample:
    """One record as an example, or a one-line error naming `where` (file:line) and what is wrong."""
    if not isinstance(record, dict):
        raise YetoError(f"{where}: a task record must be an object with 'messages' or 'prompt', and 'answer'")
    answer = record.get("answer")
    if answer is not None and not isinstance(answer, (str, int, float)):
        raise YetoError(f"{where}: 'answer' must be a string, got {type(answer).__name__}")
    if "messages" in record:
        messages = record["messages"]
        if not (isinstance(messages, list) and messages and all(
                isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                for m in messages)):
            raise YetoError(f"{where}: 'messages' must be a non-empty list of {{role, content}} strings")
        prompt: Prompt = [{"role": m["role"], "content": m["content"]} for m in messages]
        if prompt[-1]["role"] == "assistant":
            answer = answer if answer is not None else prompt[-1]["content"]
            prompt = prompt[:-1]
        if not prompt:
            raise YetoError(f"{where}: 'messages' holds no prompt before the assistant's answer")
    elif "prompt" in record:
        if not isinstance(record["prompt"], str):
            raise YetoError(f"{where}: 'prompt' must be a string (a conversation goes in 'messages')")
        prompt = record["prompt"]
    else:
        raise YetoError(f"{where}: a task record needs 'messages' or 'prompt' (got keys {sorted(record)})")
    if answer is None:
        raise YetoError(f"{where}: no 'answer' (and no assistant turn to take it from)")
    return TaskExample(index, prompt, str(answer), record)


def read_task_file(path: str | Path) -> list[TaskExample]:
    """The examples of a JSONL task file; a missing or empty file, or a bad line, is a one-line error naming it."""
    p = Path(path).expanduser()
    if not p.is_file():
        raise YetoError(f"task file not found: {p} (a JSONL of {{messages | prompt, answer}} records, or a task "
                        "name: yeto data task --list)")
    examples = []
    with open(p, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise YetoError(f"{p}:{number}: not JSON ({e.msg}); a task file has one JSON record a line") from e
            examples.append(example_from_record(len(examples), record, f"{p}:{number}"))
    if not examples:
        raise YetoError(f"{p}: no task records in it")
    return examples


def load_task(spec: str, scorer: Optional[str] = None, limit: Optional[int] = None) -> Task:
    """A task from a JSONL file, scored by `scorer` (a spec for `load_scorer`), by default by the generator that made
    its records (their "task" field, `yeto.eval.gym`) or else by exact match; `limit`: its first N examples."""
    from yeto.eval import gym

    path = Path(spec).expanduser()
    if not path.exists() and gym.is_task_name(spec):
        return generated_task(spec, limit, scorer)
    examples = read_task_file(path)
    if limit is not None:
        examples = examples[:limit]
    generators = {e.record.get(GENERATOR_KEY) for e in examples} - {None}
    if scorer is None and len(generators) == 1:
        name = generators.pop()
        return Task(path.stem, examples, gym.scorer(name), f"{name} (its own scorer)", {"file": str(path)})
    scorer = scorer or "exact_match"
    return Task(path.stem, examples, load_scorer(scorer), scorer, {"file": str(path)})


def generated_task(name: str, limit: Optional[int] = None, scorer: Optional[str] = None) -> Task:
    """Generator `name`'s held-out set (`yeto.eval.gym.HELD_OUT_SEED` on), scored by the generator or by `scorer`."""
    from yeto.eval import gym

    records = gym.task_records(name, limit or gym.DEFAULT_HELD_OUT, gym.HELD_OUT_SEED)
    examples = [example_from_record(i, r, f"{name}[{i}]") for i, r in enumerate(records)]
    meta = {"task": name, "seed": gym.HELD_OUT_SEED}
    if scorer:
        return Task(name, examples, load_scorer(scorer), scorer, meta)
    return Task(name, examples, gym.scorer(name), f"{name} (its own scorer)", meta)


@dataclass
class ExampleResult:
    index: int
    question: str
    reference: str
    output: str
    answer: str
    score: float

    def as_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


@dataclass
class TaskResult:
    """One model's answers to a task: per-example results and the accuracy with its Wilson interval."""

    task: str
    scorer: str
    examples: list[ExampleResult]
    seconds: float

    @property
    def scores(self) -> list[float]:
        return [e.score for e in self.examples]

    def summary(self) -> dict[str, Any]:
        return {"task": self.task, "scorer": self.scorer, **summary(self.scores), "seconds": round(self.seconds, 2)}


def evaluate_task(generate: Generate, task: Task, max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS,
                  batch_size: int = DEFAULT_BATCH_SIZE,
                  progress: Optional[Callable[[int, int], None]] = None) -> TaskResult:
    """Generate an answer to every example (greedy, `batch_size` prompts at a time), extract and score it."""
    t0 = time.perf_counter()
    results: list[ExampleResult] = []
    examples: Sequence[TaskExample] = task.examples
    for start in range(0, len(examples), batch_size):
        batch = examples[start:start + batch_size]
        outputs = generate([e.prompt for e in batch], max_new_tokens)
        for e, output in zip(batch, outputs):
            answer = extract_answer(output)
            score = checked_score(task.scorer, answer, e.reference, e.record, f"example {e.index} of {task.name}")
            results.append(ExampleResult(e.index, e.question(), e.reference, output, answer, score))
        if progress is not None:
            progress(len(results), len(examples))
    return TaskResult(task.name, task.scorer_name, results, time.perf_counter() - t0)


def prompt_text(prompt: Prompt, tokenizer: Any) -> str:
    """The text a model continues: a conversation through its chat template with the generation prompt (as training
    renders the turns before an answer, `yeto.island.data.encode_chat`), raw text as it is."""
    if isinstance(prompt, str):
        return prompt
    if not getattr(tokenizer, "chat_template", None):
        raise YetoError("a chat task (records with 'messages'), but the tokenizer has no chat template: use "
                        "'prompt' records for this model")
    return tokenizer.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True)
