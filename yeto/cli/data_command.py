"""`yeto data`: a dataset as a run would read it, without a model's weights (`inspect`), and generated task data with
its disjoint held-out set (`task`); a group other data commands join."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any, Optional

import typer

from yeto.cli.usage import JSON_HELP
from yeto.eval.gym import DEFAULT_HELD_OUT, HELD_OUT_SEED
from yeto.island.train_config import TrainConfig

D = TrainConfig()
data_app = typer.Typer(no_args_is_help=True, help="Datasets as a run reads them (formats, tokens, loss masks) and "
                                                  "generated tasks to train and evaluate on.")
DEFAULT_TASK_RECORDS = 2000  # a generated task's training records (a few passes of a short run's batches)
SHOWN_TOKENS = 400  # the sample's tokens printed (a long record is cut, and says so)
LEARNED = ("[[", "]]")  # around the sample's tokens that carry loss (the ones the model is trained to produce)


@data_app.command("inspect")
def inspect_command(
    data: Annotated[str, typer.Argument(help="A file, a directory, a saved dataset or a hub dataset id (as --data).")],
    model: Annotated[str, typer.Option(help="The model whose tokenizer and chat template count and render the "
                                            "records (its weights are not loaded).")] = D.model,
    seq_len: Annotated[int, typer.Option(help="Tokens per packed block, as the run's --seq-len.")] = D.seq_len,
    columns: Annotated[Optional[str], typer.Option(help="As yeto train's --columns: COLUMN=FIELD,...")] = None,
    data_split: Annotated[str, typer.Option(help="As yeto train's --data-split.")] = D.data_split,
    data_config: Annotated[Optional[str], typer.Option(help="As yeto train's --data-config.")] = None,
    data_revision: Annotated[Optional[str], typer.Option(help="As yeto train's --data-revision.")] = None,
    eval_fraction: Annotated[float, typer.Option(help="As yeto train's --eval-fraction.")] = D.eval_fraction,
    as_json: Annotated[bool, typer.Option("--json", help=JSON_HELP)] = False,
) -> None:
    """Show what a run would read from DATA: formats, records, tokens per record, files and records skipped and
    why, and one record rendered with the tokens it learns [[bracketed]]."""
    from yeto.island.data import inspect_data, read_data
    from yeto.island.shard import counting_tokenizer
    from yeto.sync.core.checks import check_range

    check_range(seq_len, "--seq-len", low=2)
    tokenizer = counting_tokenizer(model, None, seq_len)
    report = inspect_data(read_data(data, tokenizer, seq_len, eval_fraction, revision=data_revision,
                                    split=data_split, config=data_config, columns=columns))
    if as_json:
        typer.echo(json.dumps(report, indent=2))
        return
    typer.echo(render_report(data, report, tokenizer))


def render_report(data: str, report: dict[str, Any], tokenizer: Any) -> str:
    """The report as text: counts first, then the sample with its learned tokens bracketed."""
    formats = ", ".join(f"{k} {v}" for k, v in report["formats"].items())
    held = f"{report['eval_records']} held out" + (f" (split {report['eval_split']!r})" if report["eval_split"]
                                                   else "")
    lines = [f"{data}: {report['records']} records ({formats}), split {report['split']!r}; {held}"]
    if report.get("columns"):
        lines.append("columns: " + ", ".join(f"{k} -> {v}" for k, v in report["columns"].items()))
    t = report["tokens_per_record"]
    if t:
        lines.append(f"tokens per record: min {t['min']}, median {t['median']:g}, max {t['max']} "
                     f"(of {t['counted']} records; {t['over_seq_len']} longer than --seq-len, cut by packing)")
    for reason, n in report["unusable"].items():
        lines.append(f"skipped {n} record(s): {reason} (first: {report['unusable_first'].get(reason)})")
    for f in report["skipped_files"]:
        lines.append(f"skipped file: {f}")
    sample = report["sample"]
    if sample:
        ids, mask = sample["ids"][:SHOWN_TOKENS], sample["mask"][:SHOWN_TOKENS]
        lines += [f"sample ({sample['origin']}; {LEARNED[0]}learned{LEARNED[1]}, the rest is context):",
                  render_masked(ids, mask, tokenizer)
                  + (f" ... ({len(sample['ids']) - SHOWN_TOKENS} more tokens)" if len(sample["ids"]) > SHOWN_TOKENS
                     else "")]
    return "\n".join(lines)


def render_masked(ids: list[int], mask: list[int], tokenizer: Any) -> str:
    """The tokens decoded in runs of equal mask, the loss-bearing runs between LEARNED's brackets."""
    out, start = [], 0
    for i in range(1, len(ids) + 1):
        if i == len(ids) or mask[i] != mask[start]:
            text = tokenizer.decode(ids[start:i], clean_up_tokenization_spaces=False)
            out.append(f"{LEARNED[0]}{text}{LEARNED[1]}" if mask[start] else text)
            start = i
    return "".join(out)


@data_app.command("task")
def task_command(
    name: Annotated[Optional[str], typer.Argument(help="A reasoning-gym generator (--list names them).",
                                                  show_default=False)] = None,
    n: Annotated[int, typer.Option("--n", help="Training records to generate (fewer are written when the held-out "
                                               "set asks some of their questions: they are dropped).")
             ] = DEFAULT_TASK_RECORDS,
    seed: Annotated[int, typer.Option(help="The training records' first seed (record i is made from seed + i).")] = 0,
    out: Annotated[Optional[Path], typer.Option(help="The training file (JSONL); its held-out set is written beside "
                                                     "it as <stem>.heldout.jsonl.", show_default=False)] = None,
    held_out: Annotated[int, typer.Option(help=f"Held-out records, from seed {HELD_OUT_SEED} on (past any "
                                               "training range): the same ones for every run of a comparison.")
                    ] = DEFAULT_HELD_OUT,
    setting: Annotated[Optional[list[str]], typer.Option(
        "--setting", help="A generator setting KEY=VALUE, the value read as JSON where it is (max_digits=2, "
                         "allow_negation=false); repeat it for more. An unknown key names those the task takes.",
        show_default=False)] = None,
    list_tasks: Annotated[bool, typer.Option("--list", help="Print the generators and what each makes.")] = False,
    as_json: Annotated[bool, typer.Option("--json", help=JSON_HELP)] = False,
) -> None:
    """Write a generated task (a reasoning-gym generator, installed by the tasks extra) as chat records to train on,
    and a held-out set no training question appears in, for `yeto eval --task` and `--eval-task`."""
    from yeto import YetoError
    from yeto.eval import gym
    from yeto.sync.core.checks import check_range

    if list_tasks:
        described = gym.task_descriptions()
        width = max(map(len, described))
        typer.echo(json.dumps(described, indent=2) if as_json else
                   "\n".join(f"{k:<{width}}  {v}" for k, v in described.items()))
        return
    if name is None:
        raise YetoError("name a task: yeto data task NAME --out FILE (yeto data task --list names them)")
    if out is None:
        raise YetoError(f"--out is needed: the training file to write (e.g. --out tasks/{name}.jsonl)")
    check_range(n, "--n", low=1)
    check_range(held_out, "--held-out", low=1)
    check_range(seed, "--seed", low=0)
    gym.check_task_name(name)
    wrote = gym.write_task(name, n, seed, out, held_out, gym.parse_config(setting or []))
    if as_json:
        typer.echo(json.dumps(wrote, indent=2))
        return
    typer.echo(render_task(wrote))


def render_task(wrote: dict[str, Any]) -> str:
    """What `yeto data task` wrote, and the commands that use it."""
    last = wrote["seed"] + wrote["train_records"] + wrote["dropped"] - 1
    settings = f" with {json.dumps(wrote['config'])}" if wrote["config"] else ""
    return "\n".join([
        f"{wrote['task']}{settings}: {wrote['train_records']} training records to {wrote['train']} (seeds "
        f"{wrote['seed']}..{last}; {wrote['dropped']} dropped: the held-out set asks them)",
        f"held out: {wrote['held_out_records']} records to {wrote['held_out']} (seeds {wrote['held_out_seed']} on)",
        f"train with --data {wrote['train']} (a directory of both skips *.heldout.jsonl), evaluate on "
        f"--task {wrote['held_out']}"])
