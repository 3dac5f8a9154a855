"""`yeto shape`: the island shapes a model fits, ranked by price per token and time to N tokens, and the fleet."""

from __future__ import annotations

import json
from typing import Annotated, Optional

import typer

from yeto import YetoError
from yeto.cli.usage import JSON_HELP, trust_remote_code_help, with_help_panels
from yeto.launch.shape import DEFAULT_SEQ_LEN, DEFAULT_TOKENS, Order, Rejected, ShapePlan, ShapeRequest, duration

BASES = {"none": "bf16", "nf4": "nf4"}  # --base-quantization (yeto train's spelling) -> the sizing's base precision
TOP = 12  # options the table shows (--json has them all)


def split_list(text: Optional[str]) -> tuple[str, ...]:
    return tuple(p.strip() for p in (text or "").split(",") if p.strip())


def check_request(budget: Optional[float], tokens: int, seq_len: int, base_quantization: str, gpus: tuple[str, ...],
                  own: tuple[str, ...] = ()) -> None:
    """One line for what no plan can come of (before SkyPilot or the model is read)."""
    from yeto.launch.gpus import gpu

    if budget is not None and not budget > 0:
        raise YetoError(f"--budget {budget:g}: give the fleet's price limit in USD per hour, above 0")
    if tokens < 1:
        raise YetoError(f"--tokens {tokens}: give how many tokens to train on, at least 1")
    if seq_len < 2:
        raise YetoError(f"--seq-len {seq_len}: a block needs at least 2 tokens")
    if base_quantization not in BASES:
        raise YetoError(f"--base-quantization {base_quantization!r}: use one of {', '.join(BASES)}")
    for name in gpus + own:
        gpu(name)


def make_plan(model: str, budget: Optional[float] = None, tokens: int = DEFAULT_TOKENS, gpus: Optional[str] = None,
              clouds: Optional[str] = None, spot: bool = True, seq_len: int = DEFAULT_SEQ_LEN,
              base_quantization: str = "none", order: Order = Order.COST, trust_remote_code: bool = False,
              own: Optional[str] = None) -> ShapePlan:
    """The ranked plan for these flags (shared by `yeto shape` and `yeto launch --budget`)."""
    from yeto.launch.prices import load_prices
    from yeto.launch.shape import plan_shapes
    from yeto.launch.spec import CLOUD_ALIASES
    from yeto.launch.sizing import model_size

    gpu_names, own_names = split_list(gpus), split_list(own)
    check_request(budget, tokens, seq_len, base_quantization, gpu_names, own_names)
    cloud_names = tuple(CLOUD_ALIASES.get(c.lower(), c.lower()) for c in split_list(clouds))
    size = model_size(model, trust_remote_code)
    request = ShapeRequest(model, gpu_names, cloud_names, spot, seq_len, BASES[base_quantization], budget, tokens,
                           order, own_names)
    return plan_shapes(size, request, load_prices(cloud_names or None))


def money(value: Optional[float]) -> str:
    return "-" if value is None else f"${value:,.2f}" if value >= 0.1 else f"${value:.2g}"


def show(plan: ShapePlan) -> None:
    from rich.console import Console
    from rich.table import Table

    from yeto.launch.shape import Rejection

    console = Console(width=200)
    r = plan.request
    terms = f"{'spot' if r.spot else 'on-demand'}, seq {r.seq_len}, base {r.base}, {r.tokens:,} tokens" + (
        f", budget ${r.budget:g}/h" if r.budget is not None else "")
    by = plan.ranked_by.value + (" (no prices)" if plan.ranked_by is not r.order else "")
    table = Table(title=f"{r.model}: {len(plan.fleets)} island shapes that fit ({terms}), by {by}")
    for col in ("#", "island", "cloud", "region", "$/h", "$/M tok", "tok/s", "GiB/dev", "islands", "time", "cost"):
        table.add_column(col, justify="left" if col in ("island", "cloud", "region") else "right")
    for i, f in enumerate(plan.fleets[:TOP], 1):
        s, o = f.option.shape, f.option
        table.add_row(str(i), f"{s.count}x{s.gpu} {s.strategy} mb{s.micro_batch}", o.offer.cloud if o.offer else "-",
                      o.offer.region if o.offer else "-", money(o.hourly), money(o.usd_per_mtok),
                      f"{o.tokens_per_s:,.0f}", f"{o.memory_gib:.1f}", str(f.islands), duration(f.hours),
                      money(f.cost))
    console.print(table)
    if len(plan.fleets) > TOP:
        console.print(f"... and {len(plan.fleets) - TOP} more (--json lists every one)")
    for reason in Rejection:
        by_gpu: dict[str, list[Rejected]] = {}
        for x in plan.rejected:
            if x.reason is reason:
                by_gpu.setdefault(x.shape.gpu, []).append(x)
        if by_gpu:  # per GPU, the counts, and the largest count's numbers (the nearest miss)
            shown = "; ".join(f"{'/'.join(str(x.shape.count) for x in xs)}x{name} ({xs[-1].shape.count}x: "
                              f"{xs[-1].detail})" for name, xs in by_gpu.items())
            console.print(f"rejected, {reason.value}: {shown}", highlight=False, soft_wrap=True)
    for line in [plan.prices, *plan.notes]:
        if line:
            console.print(line, style="yellow", markup=False, highlight=False, soft_wrap=True)
    best = plan.best
    if plan.unproposed:
        console.print(plan.unproposed, style="red", markup=False, highlight=False, soft_wrap=True)
        return
    if best is None:
        console.print("[red]no island shape fits: try --base-quantization nf4, a shorter --seq-len, or bigger "
                      "--gpus[/red]")
        return
    console.print(f"\nproposed fleet: {best.islands} x {best.option.shape.count}x{best.option.shape.gpu} on "
                  f"{best.cloud}, {duration(best.hours)} to {best.tokens:,} tokens"
                  + (f", {money(best.cost)}" if best.cost is not None else ", unpriced"), highlight=False,
                  soft_wrap=True)
    for why in best.why:
        console.print(f"  {why}", highlight=False, soft_wrap=True)
    console.print(best.launch, markup=False, highlight=False, soft_wrap=True)


def shape_command(
    model: Annotated[str, typer.Option(help="Model alias or local model directory (its config.json is sized).")],
    budget: Annotated[Optional[float], typer.Option(help="The fleet's price limit, USD per hour.")] = None,
    tokens: Annotated[int, typer.Option(help="Tokens to train on (time and cost to reach them).")] = DEFAULT_TOKENS,
    gpus: Annotated[Optional[str], typer.Option(help="GPU types to try, comma-separated (default: every cloud "
                                                     "GPU yeto knows).")] = None,
    clouds: Annotated[Optional[str], typer.Option(help="Clouds to price, comma-separated (default: every cloud "
                                                       "with a SkyPilot catalog here).")] = None,
    spot: Annotated[bool, typer.Option("--spot/--on-demand", help="Spot or on-demand prices.")] = True,
    seq_len: Annotated[int, typer.Option(help="Tokens per block.")] = DEFAULT_SEQ_LEN,
    base_quantization: Annotated[str, typer.Option(help="none (bf16 base) or nf4 (QLoRA).")] = "none",
    own: Annotated[Optional[str], typer.Option(help="Machines you own that join as --external-islands, comma-"
                                                    "separated (e.g. M3-Ultra-512GB, RTX4090): sized at the fleet's "
                                                    "batch, with their share of a round.")] = None,
    by: Annotated[Order, typer.Option(help="Rank by cost per million tokens, time to --tokens, or island size (the "
                                           "devices' memory together; what cost falls back to without prices).")
              ] = Order.COST,
    json_out: Annotated[bool, typer.Option("--json", help=JSON_HELP)] = False,
    trust_remote_code: Annotated[bool, typer.Option(help=trust_remote_code_help())] = False,
) -> None:
    """Every island shape the model fits, ranked by price per token and time to --tokens, with why the others are
    rejected, the fleet it proposes and its `yeto launch` line. Prices come from SkyPilot's catalog; without one the
    smallest island that fits leads, and the table says the prices are missing."""
    plan = make_plan(model, budget, tokens, gpus, clouds, spot, seq_len, base_quantization, by, trust_remote_code,
                     own)
    if json_out:
        typer.echo(json.dumps(plan.to_json(), indent=1))
        return
    show(plan)


with_help_panels(shape_command, advanced=("seq_len", "by", "trust_remote_code"))
