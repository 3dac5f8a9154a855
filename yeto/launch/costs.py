"""What a cloud fleet costs: each island's hourly price, and the run's estimated cost (`yeto launch --dry-run`,
`yeto launch --budget`).

An island's price is its VM's in the region it names, else in its cloud's cheapest region (where SkyPilot's
optimizer places it first), times its nodes. The run's length comes from the speed model (`yeto.launch.sizing`):

    round = inner steps x tokens per step / tokens per second   (the quorum-th fastest island)
    run   = outer steps x round                                  (merges, transfers, start-up not counted)

The head VM (a small CPU machine) is not counted.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from yeto import YetoError
from yeto.island.train_config import TrainConfig
from yeto.launch.plan import FleetPlan
from yeto.launch.prices import Offer, PriceBook
from yeto.launch.spec import IslandSpec

NF4 = "nf4"


def flag_values(args: list[str], flag: str) -> list[str]:
    """Every value `flag` is given in a command line (`--flag V` and `--flag=V`), in order."""
    values = []
    for i, a in enumerate(args):
        if a == flag and i + 1 < len(args):
            values.append(args[i + 1])
        elif a.startswith(flag + "="):
            values.append(a.split("=", 1)[1])
    return values


def flag_value(args: list[str], flag: str) -> Optional[str]:
    """The value of `flag` in a command line (`--flag V` or `--flag=V`; the last one given wins)."""
    values = flag_values(args, flag)
    return values[-1] if values else None


def without_flag(args: list[str], flag: str) -> list[str]:
    """A command line less every `flag` and its value (`--flag V` or `--flag=V`)."""
    kept, i = [], 0
    while i < len(args):
        if args[i] == flag:
            i += 2
            continue
        if not args[i].startswith(flag + "="):
            kept.append(args[i])
        i += 1
    return kept


@dataclass(frozen=True)
class IslandPrice:
    island: IslandSpec
    offer: Optional[Offer]  # one node's VM

    @property
    def hourly(self) -> Optional[float]:
        return None if self.offer is None else self.offer.hourly * self.island.nodes


def island_prices(plan: FleetPlan, book: PriceBook) -> list[IslandPrice]:
    return [IslandPrice(i, book.island(i.cloud, i.gpu or "", i.count, plan.spot, i.region)) for i in plan.islands]


def fleet_hourly(prices: list[IslandPrice]) -> Optional[float]:
    """The fleet's USD per hour, None when any island's price is unknown."""
    hourly = [p.hourly for p in prices]
    return None if any(h is None for h in hourly) else sum(h for h in hourly if h is not None)


def run_hours(plan: FleetPlan) -> Optional[float]:
    """The run's estimated length from the speed model, None where the model or a GPU cannot be sized here."""
    from yeto.launch.gpus import GPUS
    from yeto.launch.sizing import IslandShape, model_size, tokens_per_second

    defaults = TrainConfig()
    args = plan.island_args
    try:
        seq_len = int(flag_value(args, "--seq-len") or defaults.seq_len)
        batch = int(flag_value(args, "--batch-size") or defaults.batch_size)
        accum = int(flag_value(args, "--grad-accum") or defaults.grad_accum)
        inner = int(flag_value(plan.syncer_args, "--inner-steps") or 0)
        outer = int(flag_value(plan.syncer_args, "--outer-steps") or 0)
        quorum = int(flag_value(plan.syncer_args, "--quorum") or len(plan.islands))
        size = model_size(plan.model)
    except (ValueError, KeyError, TypeError, YetoError):  # a bad number, or a config the model cannot size
        return None
    shard = flag_value(args, "--shard") or "ddp"
    base = "nf4" if flag_value(args, "--base-quantization") == NF4 else "bf16"
    round_s = []
    for island in plan.islands:
        if island.gpu not in GPUS:
            return None
        shape = IslandShape(island.gpu, island.gpus, shard if island.gpus > 1 else "ddp", base, seq_len, batch)
        step_tokens = batch * accum * seq_len * island.gpus
        round_s.append(inner * step_tokens / tokens_per_second(size, shape))
    if not round_s or not inner or not outer:
        return None
    waited = sorted(round_s)[min(max(quorum, 1), len(round_s)) - 1]  # a round closes when the quorum has answered
    return outer * waited / 3600


def price_lines(plan: FleetPlan, book: PriceBook, hours: Optional[float]) -> list[str]:
    """Each island's hourly price and the run's estimated cost, as `# ...` lines for a dry run."""
    prices = island_prices(plan, book)
    kind = "spot" if plan.spot else "on-demand"
    lines = []
    for lid, p in enumerate(prices):
        if p.offer is None:
            lines.append(f"# island {lid} {p.island.text}: price unknown ({kind})")
        else:
            nodes = f" x {p.island.nodes} nodes" if p.island.nodes > 1 else ""
            lines.append(f"# island {lid} {p.island.text}: ${p.hourly:.2f}/h {kind} ({p.offer.cloud} "
                         f"{p.offer.region}, {p.offer.instance_type}{nodes})")
    hourly = fleet_hourly(prices)
    if hourly is None:
        lines.append("# fleet: price unknown" + (f" ({book.unavailable})" if book.unavailable else ""))
    elif hours is None:
        lines.append(f"# fleet: ${hourly:.2f}/h (the head VM not counted); run length unknown, so its cost too")
    else:
        lines.append(f"# fleet: ${hourly:.2f}/h (the head VM not counted); estimated run {hours:.2f} h, "
                     f"${hourly * hours:.2f}")
    return lines


def check_budget(plan: FleetPlan, book: PriceBook, budget: float) -> None:
    """Refuse a fleet whose hourly price is over `budget`, or cannot be known (a budget is a promise, not a hope)."""
    hourly = fleet_hourly(island_prices(plan, book))
    kind = "spot" if plan.spot else "on-demand"
    if hourly is None:
        unknown = [i.text for i, p in zip(plan.islands, island_prices(plan, book)) if p.offer is None]
        raise YetoError(f"--budget ${budget:g}/h cannot be checked: no {kind} price for {', '.join(unknown)}"
                        + (f" ({book.unavailable})" if book.unavailable else "")
                        + "; refresh SkyPilot's catalog (`sky check`), or leave --budget out to launch with no price "
                          "limit")
    if hourly > budget:
        raise YetoError(f"the fleet costs ${hourly:.2f}/h ({kind}), over --budget ${budget:g}/h: name fewer or "
                        "cheaper --gpu islands, or leave --gpu out and launch picks a fleet within the budget")
    return None
