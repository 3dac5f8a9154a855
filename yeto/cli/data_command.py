"""`yeto data`: a dataset as a run would read it, without a model's weights (`inspect`); a group other data commands
join."""

from __future__ import annotations

import json
from typing import Annotated, Any, Optional

import typer

from yeto.cli.usage import JSON_HELP
from yeto.island.train_config import TrainConfig

D = TrainConfig()
data_app = typer.Typer(no_args_is_help=True, help="Datasets as a run reads them: formats, tokens, loss masks.")
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
