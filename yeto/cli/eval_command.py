"""`yeto eval`: the base model and adapters answer a task's examples side by side, scored, each accuracy with its
95% interval and each model's paired difference against the first column (the same examples, so the comparison is
far tighter than two separate intervals would say)."""

from __future__ import annotations

import json
from contextlib import closing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Optional

import typer

from yeto import YetoError
from yeto.cli.usage import BASE_REVISION_HELP, RUNTIME_HELP, runtime, trust_remote_code_help
from yeto.eval.score import Interval, paired_difference
from yeto.eval.task import DEFAULT_BATCH_SIZE, DEFAULT_MAX_NEW_TOKENS, Task, TaskResult

BASE_LABEL = "base"  # the base model's column
EXAMPLES_SHOWN = 4  # rows of the examples table by default: half that every model got right, half some got wrong
SUMMARY_FILE = "summary.json"  # under --out, beside one <label>.jsonl per model
QUESTION_CHARS = 120  # a question longer than this is cut in the examples table
FULL_MARK, NO_MARK = "✓", "✗"  # an answer scored 1 / 0 in the examples table (partial credit shows its score)

ADAPTERS_HELP = ("Adapters to evaluate: each an adapter directory or a run's (a launch's --out: the syncer's merged "
                 "adapter; a syncer's or a yeto train's --out), or a launched run's name. All on one base model.")
TASK_HELP = ("The task: a JSONL of {messages | prompt, answer} records (a training file's held-out twin), or a "
             "generated task's name (reasoning-gym, yeto[tasks]: its held-out set and its own scorer).")
MODEL_HELP = ("The base model (alias, local directory or hub id): evaluated alone when no ADAPTER is given; with "
              "adapters, the base they record is used and a --model given must be that base.")
JSON_OUT_HELP = ("Print one JSON object instead of the tables (per model its summary and its paired difference "
                 "against the first column, as fractions); no progress bars.")
SCORER_HELP = ("exact_match (normalized: case, punctuation, number formatting do not count), or your function as "
               "module:function or path/to/file.py:function, taking (answer, reference, record) and returning a "
               "score in [0, 1] (default: a generated task's own scorer, else exact_match).")


@dataclass
class Column:
    """One model of the comparison: the base (no adapter) or an adapter on it, and its answers once evaluated."""

    label: str
    adapter: Optional[Path]
    result: Optional[TaskResult] = field(default=None)

    @property
    def scores(self) -> list[float]:
        return self.result.scores if self.result is not None else []


def adapter_labels(targets: list[str], adapter_dirs: list[Path]) -> list[str]:
    """A column name per adapter, unique and never `BASE_LABEL`: a launched run's name as given, else the directory's
    last path parts, as few as tell it apart (`demo`, then `a/island-0` beside `b/island-0`)."""
    tails = []
    for target, adapter_dir in zip(targets, adapter_dirs):
        given = Path(target).expanduser()
        parts = (given.resolve() if given.exists() else Path(target)).parts
        tails.append([p for p in parts if p not in ("/", "")] or [str(adapter_dir)])
    depth = [1] * len(tails)
    while True:
        labels = ["/".join(t[-d:]) for t, d in zip(tails, depth)]
        growable = [i for i, label in enumerate(labels) if depth[i] < len(tails[i]) and (label == BASE_LABEL or any(
            other == label and tails[j] != tails[i] for j, other in enumerate(labels)))]  # (not the same one twice)
        if not growable:
            break
        for i in growable:
            depth[i] += 1
    seen: dict[str, int] = {BASE_LABEL: 1}
    unique = []
    for label in labels:  # the same adapter twice (or paths alike to the root): numbered
        seen[label] = seen.get(label, 0) + 1
        unique.append(label if seen[label] == 1 else f"{label} ({seen[label]})")
    return unique


def file_name(label: str) -> str:
    """A label as a file name under --out (`a/island-0` -> `a_island-0`)."""
    return "".join(c if c.isalnum() or c in "-_.()" else "_" for c in label).strip(".") or "model"


def resolve_models(targets: list[str], model: Optional[str], model_revision: Optional[str]) -> tuple[Any, list[Path]]:
    """(the base model's artifact, the adapter directories): the base the adapters record (`--model`, when given,
    checked to be it), or `--model` alone; adapters on different bases are one line."""
    from yeto.launch.registry import run_adapter
    from yeto.models.adapter import adapter_base, find_adapter_dir
    from yeto.models.materialize import resolve_model

    if not targets:
        if model is None:
            raise YetoError("nothing to evaluate: give ADAPTER directories or runs, or --model for a base model alone")
        return resolve_model(model, model_revision), []
    adapter_dirs = [find_adapter_dir(run_adapter(t)) for t in targets]
    bases = [adapter_base(d, model, model_revision) for d in adapter_dirs]
    for target, base in zip(targets[1:], bases[1:]):
        if base.revision != bases[0].revision:
            raise YetoError(f"{targets[0]} and {target} adapt different base models ({bases[0].name} "
                            f"{bases[0].revision[:19]}, {base.name} {base.revision[:19]}): evaluate each base's "
                            "adapters in a command of their own")
    return bases[0], adapter_dirs


def evaluate_columns(columns: list[Column], artifact: Any, task: Task, backend: str, device: str,
                     trust_remote_code: bool, max_new_tokens: int, batch_size: int, quiet: bool) -> None:
    """Each column's answers to the task, the base loaded once (a backend's `task_generators`), one progress bar
    per model on stderr while it runs (the libraries' own bars are off: an error after them stays one line)."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from yeto.eval.task import evaluate_task
    from yeto.models.materialize import quiet_progress_bars

    quiet_progress_bars()
    if backend == "mlx":
        from yeto.backends.mlx.generate import task_generators
    else:
        from yeto.backends.torch.generate import task_generators

    base = next((c for c in columns if c.adapter is None), None)  # None: --no-base (the base answers nothing)
    adapters = [c for c in columns if c.adapter is not None]
    progress = Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                        TimeElapsedColumn(), console=Console(stderr=True), disable=quiet, transient=True)
    models = task_generators(artifact, [c.adapter for c in adapters], device, trust_remote_code)
    with progress, closing(models):
        for column, generate in zip([base, *adapters], models):  # the base first, then the adapters in order
            if column is None:
                continue
            bar = progress.add_task(column.label, total=len(task.examples))
            column.result = evaluate_task(generate, task, max_new_tokens, batch_size,
                                          lambda done, _total, bar=bar: progress.update(bar, completed=done))


def report(columns: list[Column], task: Task, artifact: Any, max_new_tokens: int) -> dict[str, Any]:
    """What --json prints and --out's summary.json holds: per model its summary, and each later model's paired
    difference against the first (fractions, not percent)."""
    first = columns[0]
    models = []
    for c in columns:
        difference = paired_difference(first.scores, c.scores).as_dict() if c is not first else None
        models.append({"label": c.label, "adapter": str(c.adapter) if c.adapter else None, **c.result.summary(),
                       "difference_vs_first": difference})
    return {"task": task.name, "scorer": task.scorer_name, "n": len(task.examples), "max_new_tokens": max_new_tokens,
            "base_model": {"name": artifact.name, "revision": artifact.revision}, "first": first.label,
            "models": models}


def pick_examples(columns: list[Column], k: int) -> list[int]:
    """Up to `k` example positions: half every model got right, the rest some model got wrong (those the models
    disagree on first: they are what the comparison is about); a short side leaves its rows to the other."""
    n = len(columns[0].scores)
    right = [i for i in range(n) if all(c.scores[i] >= 1.0 for c in columns)]
    wrong = sorted((i for i in range(n) if i not in set(right)),
                   key=lambda i: (len({c.scores[i] for c in columns}) == 1, i))
    take_wrong = min(len(wrong), k - min(len(right), k // 2))
    take_right = min(len(right), k - take_wrong)
    return sorted(right[:take_right] + wrong[:take_wrong])


def mark(score: float) -> str:
    return FULL_MARK if score >= 1.0 else NO_MARK if score <= 0.0 else f"{score:.2f}"


def print_tables(columns: list[Column], task: Task, summary: dict[str, Any], examples: int) -> None:
    """The models' table (accuracy with its interval, n, seconds, difference against the first column in points),
    then a few examples with each model's answer and its mark."""
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    console = Console()
    first = columns[0]
    table = Table(title=f"{task.name}: {len(task.examples)} examples, scored by {task.scorer_name} "
                        f"(base {summary['base_model']['name']})")
    for name in ("model", "accuracy [95% CI]", "n", "seconds", f"vs {first.label} [95% CI], points"):
        table.add_column(escape(name), justify="left" if name == "model" else "right")
    for c, row in zip(columns, summary["models"]):
        accuracy = Interval(row["accuracy"], row["low"], row["high"]).text()
        difference = row["difference_vs_first"]
        vs = Interval(**difference).text(signed=True).removesuffix("%") if difference else "-"
        table.add_row(escape(c.label), accuracy, str(row["n"]), f"{row['seconds']:.1f}", vs)
    console.print(table)
    shown = pick_examples(columns, examples)
    if not shown:
        return
    rows = Table(title=f"{len(shown)} examples ({FULL_MARK} right, {NO_MARK} wrong)", show_lines=True)
    rows.add_column("#", justify="right")
    rows.add_column("question")
    rows.add_column("reference")
    for c in columns:
        rows.add_column(escape(c.label))
    for i in shown:
        e = first.result.examples[i]
        question = e.question if len(e.question) <= QUESTION_CHARS else e.question[:QUESTION_CHARS] + "..."
        rows.add_row(str(e.index), escape(question), escape(e.reference),
                     *(f"{mark(c.result.examples[i].score)} {escape(c.result.examples[i].answer)}" for c in columns))
    console.print(rows)


def write_out(out: Path, columns: list[Column], summary: dict[str, Any]) -> None:
    """One JSONL per model (a line per example: index, question, reference, output, answer, score) and the
    summary."""
    out.mkdir(parents=True, exist_ok=True)
    for c in columns:
        with open(out / f"{file_name(c.label)}.jsonl", "w", encoding="utf-8") as f:
            f.writelines(json.dumps(e.as_dict()) + "\n" for e in c.result.examples)
    (out / SUMMARY_FILE).write_text(json.dumps(summary, indent=1) + "\n")


def eval_command(
    task: Annotated[str, typer.Option(help=TASK_HELP)],
    adapters: Annotated[Optional[list[str]], typer.Argument(help=ADAPTERS_HELP, show_default=False)] = None,
    model: Annotated[Optional[str], typer.Option(help=MODEL_HELP)] = None,
    model_revision: Annotated[Optional[str], typer.Option(help=BASE_REVISION_HELP)] = None,
    base: Annotated[bool, typer.Option(help="Evaluate the base model too, as the first column.")] = True,
    scorer: Annotated[Optional[str], typer.Option(help=SCORER_HELP, show_default=False)] = None,
    limit: Annotated[Optional[int], typer.Option(help="Evaluate the task's first N examples only.")] = None,
    max_new_tokens: Annotated[int, typer.Option(help="Tokens generated per answer (greedy); a worked solution "
                                                     "needs more.")] = DEFAULT_MAX_NEW_TOKENS,
    batch_size: Annotated[int, typer.Option(help="Prompts generated at once.")] = DEFAULT_BATCH_SIZE,
    examples: Annotated[int, typer.Option(help="Rows of the examples table (0: none).")] = EXAMPLES_SHOWN,
    json_out: Annotated[bool, typer.Option("--json", help=JSON_OUT_HELP)] = False,
    out: Annotated[Optional[str], typer.Option(help="Write DIR/<model>.jsonl (each example's question, reference, "
                                                    "output, extracted answer and score) and DIR/summary.json.")
                   ] = None,
    device: Annotated[str, typer.Option(help="auto, cpu, cuda or mps (MLX: auto or cpu).")] = "auto",
    backend: Annotated[str, typer.Option(help=RUNTIME_HELP)] = "auto",
    trust_remote_code: Annotated[bool, typer.Option(help=trust_remote_code_help())] = False,
) -> None:
    """Score the base model and adapters on a task, side by side on the same examples: accuracy with its 95%
    interval, each model's paired difference against the first column, a few examples right and wrong."""
    from yeto.eval.task import load_task
    from yeto.sync.core.checks import check_range

    targets = list(adapters or [])
    for value, flag, low in ((max_new_tokens, "--max-new-tokens", 1), (batch_size, "--batch-size", 1),
                             (examples, "--examples", 0), *([(limit, "--limit", 1)] if limit is not None else [])):
        check_range(value, flag, low=low)
    if not targets and not base:
        raise YetoError("--no-base with no ADAPTER leaves nothing to evaluate: give adapters, or drop --no-base")
    out_dir = Path(out).expanduser() if out else None
    if out_dir is not None and out_dir.exists() and not out_dir.is_dir():
        raise YetoError(f"--out {out_dir} is a file: pass a directory")
    name = runtime(backend, "yeto eval")
    evaluated = load_task(task, scorer, limit)  # (a bad task file or scorer says so before any model loads)
    artifact, adapter_dirs = resolve_models(targets, model, model_revision)
    columns = ([Column(BASE_LABEL, None)] if base else []) + [
        Column(label, d) for label, d in zip(adapter_labels(targets, adapter_dirs), adapter_dirs)]
    evaluate_columns(columns, artifact, evaluated, name, device, trust_remote_code, max_new_tokens, batch_size,
                     quiet=json_out)
    summary = report(columns, evaluated, artifact, max_new_tokens)
    if out_dir is not None:
        write_out(out_dir, columns, summary)
    if json_out:
        typer.echo(json.dumps(summary, indent=1))
        return
    print_tables(columns, evaluated, summary, examples)
    if out_dir is not None:
        typer.echo(f"answers: {out_dir}/<model>.jsonl, summary: {out_dir / SUMMARY_FILE}")
