"""Tasks generated offline by reasoning-gym (the `yeto[tasks]` extra): its procedural datasets and their own scorers.

reasoning-gym builds item i of a dataset from seed + i, so two datasets whose seed ranges overlap share items: the
held-out set is built from `HELD_OUT_SEED` on, far past any training range, and a training file leaves out any
question the held-out set asks (small generators repeat questions across seeds).
"""

from __future__ import annotations

import dataclasses
import difflib
import json
from pathlib import Path
from typing import Any, Optional, Sequence

from yeto import YetoError

HELD_OUT_SUFFIX = ".heldout.jsonl"  # a task file's held-out twin: a data directory never trains on it
HELD_OUT_SEED = 1_000_000_000  # every held-out set starts here: the same records serve every arm of a comparison
DEFAULT_HELD_OUT = 200  # held-out examples (a Wilson interval of about +-7 points at 50%)
INSTALL_HINT = "pip install 'yeto[tasks]' (reasoning-gym)"
RUN_KEYS = ("seed", "size")  # a generator's config fields that --seed and --n set, not --setting
CLOSE_MATCHES = 3  # names suggested for a misspelt task or setting


def _gym() -> Any:
    try:
        import reasoning_gym
    except ImportError as e:
        raise YetoError(f"generated tasks need reasoning-gym: {INSTALL_HINT}") from e
    return reasoning_gym


def task_names() -> list[str]:
    """The generators reasoning-gym offers (empty when it is not installed)."""
    try:
        import reasoning_gym
    except ImportError:
        return []
    return sorted(reasoning_gym.factory.DATASETS)


def is_task_name(name: str) -> bool:
    return "/" not in name and not name.endswith((".jsonl", ".json")) and name in task_names()


def task_descriptions() -> dict[str, str]:
    """Each generator's name and the first line of its docstring (what `yeto data task --list` prints)."""
    datasets = _gym().factory.DATASETS
    return {name: ((datasets[name][0].__doc__ or "").strip().splitlines() or [""])[0] for name in sorted(datasets)}


def check_task_name(name: str) -> None:
    names = task_names() if _gym() else []
    if name not in names:
        close = difflib.get_close_matches(name, names, n=CLOSE_MATCHES)
        hint = f" (did you mean {', '.join(close)}?)" if close else ""
        raise YetoError(f"unknown task {name!r}{hint}: yeto data task --list names the {len(names)} there are")


def parse_config(pairs: Sequence[str]) -> dict[str, Any]:
    """`KEY=VALUE` pairs as a generator's settings: a value reads as JSON where it is JSON (2, 0.5, true, null,
    ["+", "-"]), else as text, so a number from the command line reaches the generator as a number."""
    config: dict[str, Any] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key.strip():
            raise YetoError(f"--setting {pair!r} is not KEY=VALUE (e.g. --setting max_digits=2)")
        try:
            config[key.strip()] = json.loads(value)
        except json.JSONDecodeError:
            config[key.strip()] = value
    return config


def task_settings(name: str) -> dict[str, Any]:
    """The settings generator `name` takes through --setting, with their defaults (seed and size are --seed, --n)."""
    check_task_name(name)
    out = {}
    for f in dataclasses.fields(_gym().factory.DATASETS[name][1]):
        if f.name in RUN_KEYS:
            continue
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        out[f.name] = None if default is dataclasses.MISSING else default
    return out


def check_config(name: str, config: dict[str, Any]) -> None:
    """A setting the generator does not take is one line naming the closest and the settings it does take."""
    settings = task_settings(name)
    for key in config:
        if key not in settings:
            close = difflib.get_close_matches(key, list(settings), n=CLOSE_MATCHES)
            hint = f" (did you mean {', '.join(close)}?)" if close else ""
            raise YetoError(f"task {name} has no setting {key!r}{hint}; it takes "
                            + ", ".join(f"{k}={json.dumps(v, default=str)}" for k, v in settings.items()))


def task_records(name: str, n: int, seed: int, config: Optional[dict[str, Any]] = None) -> list[dict[str, Any]]:
    """`n` chat records of generator `name` from `seed`: the question as the user's turn, the answer as the
    assistant's, and what the generator's scorer needs (the task's name, the reference, its metadata)."""
    check_config(name, config or {})
    out = []
    try:
        for item in _gym().create_dataset(name, size=n, seed=seed, **(config or {})):
            out.append({"messages": [{"role": "user", "content": item["question"]},
                                     {"role": "assistant", "content": str(item["answer"])}],
                        "answer": str(item["answer"]), "task": name,
                        "metadata": json.loads(json.dumps(item.get("metadata", {}), default=str))})
    except (AssertionError, TypeError, ValueError) as e:  # the generator's own check of its settings
        said = str(e) or type(e).__name__
        raise YetoError(f"task {name} refuses its settings {json.dumps(config or {})}: {said}") from e
    return out


def scorer(name: str):
    """The generator's own scorer as a yeto scorer: (answer, reference, record) -> score in [0, 1]."""
    check_task_name(name)
    score_answer = _gym().get_score_answer_fn(name)

    def score(answer: str, reference: str, record: dict) -> float:
        entry = {"question": record.get("messages", [{}])[0].get("content", ""), "answer": reference,
                 "metadata": record.get("metadata", {})}
        return float(score_answer(answer, entry))

    score.__name__ = f"{name}.score_answer"
    return score


def write_task(name: str, n: int, seed: int, out: Path, held_out: int = DEFAULT_HELD_OUT,
               config: Optional[dict[str, Any]] = None) -> dict[str, Any]:
    """`out` (training, `n` records from `seed`, minus any question the held-out set asks) and its held-out twin
    `<out stem>.heldout.jsonl` (`held_out` records from HELD_OUT_SEED); returns what was written."""
    if seed + n > HELD_OUT_SEED:
        raise YetoError(f"--seed {seed} with --n {n} reaches the held-out seeds ({HELD_OUT_SEED} on): use a smaller "
                        "--seed")
    test = task_records(name, held_out, HELD_OUT_SEED, config)
    asked = {r["messages"][0]["content"] for r in test}
    train = [r for r in task_records(name, n, seed, config) if r["messages"][0]["content"] not in asked]
    held_out_path = out.with_name(out.name.removesuffix(".jsonl") + HELD_OUT_SUFFIX)
    out.parent.mkdir(parents=True, exist_ok=True)
    for path, records in ((out, train), (held_out_path, test)):
        path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return {"task": name, "config": config or {}, "train": str(out), "train_records": len(train),
            "dropped": n - len(train), "seed": seed, "held_out": str(held_out_path), "held_out_records": len(test),
            "held_out_seed": HELD_OUT_SEED}
