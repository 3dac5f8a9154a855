"""The island shapes a model fits, ranked, and the fleet `yeto shape` proposes (pure: numbers and prices in).

Every candidate island (a GPU type x GPUs per VM x strategy, on the base precision asked for) is sized by
`yeto.launch.sizing`; what fits is priced from a `PriceBook` (cheapest cloud and region) and ranked by

    cost per million tokens = hourly price / (tokens per second x 3600) x 1e6     (the fleet size does not change it)
    time to N tokens        = N / (islands x tokens per second)                     (merges and transfers not counted)

where `islands` is what the budget buys (`fleet_islands`). Without prices, `--by cost` ranks by size instead (the
island's device memory together, the smallest first: what a price would most likely favour) and says so. A shape
that is not ranked says why (`Rejection`). For each option the fleet is sized so that a round of `inner_steps`
takes about `TARGET_ROUND_S`: long enough that the delta's transfer and the merge (seconds) are a small share of it,
short enough that a preempted spot island loses minutes of work, not hours; and shorter where `--tokens` would
otherwise make fewer than `MIN_OUTER_STEPS` rounds (a merge or two is no DiLoCo run). Machines the user owns
(`--own`: a Mac, a box) join as `--external-islands` at the fleet's `--batch-size` (the MLX island takes the whole
batch at once); with one among them the rounds become time windows of `TARGET_ROUND_S` (`--round-seconds`), so a
slower machine adds the steps it managed, weighted by its tokens, instead of holding every round back.
"""

from __future__ import annotations

import math
import shlex
from dataclasses import asdict, dataclass, field, replace
from enum import Enum
from typing import Any, Optional

from yeto.launch.gpus import GPUS
from yeto.launch.prices import Offer, PriceBook
from yeto.launch.sizing import IslandShape, ModelSize, island_gib, largest_micro_batch, memory, tokens_per_second

COUNTS = (1, 2, 4, 8)  # GPUs per VM the clouds sell (one VM per island: multi-node islands are not proposed)
STRATEGIES = ("ddp", "fsdp")  # the frozen base replicated on every device, or sharded across them
DEFAULT_TOKENS = 100_000_000  # time to N tokens when --tokens is not given
DEFAULT_SEQ_LEN = 2048
TARGET_ROUND_S = 300.0  # a round (inner steps between merges) takes about five minutes
MIN_INNER_STEPS = 10  # fewer steps make a round mostly transfer and merge, whatever the speed
MAX_INNER_STEPS = 2000  # past this the islands drift apart between merges (DiLoCo runs use 500 or so)
MIN_OUTER_STEPS = 4  # rounds --tokens is cut into at the least (fewer inner steps where needed): merges to average
MIN_DILOCO_ISLANDS = 2  # merging needs two islands; what the fleet is without a budget
MAX_FLEET_ISLANDS = 8  # DiLoCo's published runs use up to 8 replicas; past that each merge averages smaller steps
SPOT_QUORUM_SLACK_FROM = 3  # spot fleets this large merge without their slowest island (one preemption)
MAX_DEVICE_BATCH_TOKENS = 32_768  # a device's batch stops growing here: more is memory, not speed, and a big inner
#                                  batch trains less per token
GIB = 1024 ** 3
MINUTE_S = 60.0


class Rejection(Enum):
    DOES_NOT_FIT = "does not fit"  # not even one block of --seq-len fits in a device's memory
    OVER_BUDGET = "over budget"  # one island costs more per hour than the budget
    NO_PRICE = "no price"  # no cloud asked sells this GPU at this count (or spot) in the catalogs read
    NF4_UNSUPPORTED = "nf4 unsupported"  # bitsandbytes' NF4 base: NVIDIA devices, one per island (yeto.launch.sizing)
    NOT_A_CLOUD_GPU = "not a cloud GPU"  # Apple machines join a fleet as --external-islands


class Order(str, Enum):
    COST = "cost"  # without prices: SIZE
    TIME = "time"
    SIZE = "size"  # the island's device memory together, the smallest first


@dataclass(frozen=True)
class ShapeRequest:
    """What `yeto shape` was asked: the candidates, where, on what terms."""

    model: str  # as the user wrote it (alias, directory, hub id): it goes into the launch line
    gpus: tuple[str, ...] = ()  # default: every cloud GPU of yeto.launch.gpus
    clouds: tuple[str, ...] = ()  # default: every cloud priced
    spot: bool = True
    seq_len: int = DEFAULT_SEQ_LEN
    base: str = "bf16"  # "bf16" or "nf4"
    budget: Optional[float] = None  # USD per hour for the whole fleet (islands)
    tokens: int = DEFAULT_TOKENS
    order: Order = Order.COST
    own: tuple[str, ...] = ()  # machines of yeto.launch.gpus the user owns, joining as --external-islands


@dataclass(frozen=True)
class OwnMachine:
    """A machine the user owns, sized at the fleet's batch: it joins the fleet if it fits."""

    name: str
    fits: bool
    tokens_per_s: float  # 0 where it stays out
    memory_gib: float  # per device at the fleet's batch
    out: str = ""  # why it stays out of the fleet


@dataclass(frozen=True)
class Option:
    """One island shape that fits, with its speed and (when known) its cheapest offer."""

    shape: IslandShape
    tokens_per_s: float
    memory_gib: float  # per device at shape.micro_batch
    offer: Optional[Offer] = None

    @property
    def hourly(self) -> Optional[float]:
        return None if self.offer is None else self.offer.hourly

    @property
    def usd_per_mtok(self) -> Optional[float]:
        return None if self.offer is None else self.offer.hourly / (self.tokens_per_s * 3600) * 1e6


@dataclass(frozen=True)
class Rejected:
    shape: IslandShape
    reason: Rejection
    detail: str  # the numbers behind the reason, for people


@dataclass(frozen=True)
class Fleet:
    """The fleet proposed for one option: how many islands, the quorum, the round's length, the launch line."""

    option: Option
    cloud: str
    islands: int
    quorum: int
    inner_steps: int  # 0: time-window rounds (--round-seconds), with a machine the user owns in the fleet
    outer_steps: int
    tokens: int
    hours: float  # to `tokens` (merges and transfers not counted)
    cost: Optional[float]  # USD for `tokens` (islands; the head VM not counted)
    why: tuple[str, ...]  # one line each: islands, quorum, inner steps
    gpu: str  # the --gpu value
    island_args: tuple[str, ...]  # the island flags the island was sized for
    launch: str
    own: tuple[OwnMachine, ...] = ()

    @property
    def joining(self) -> list[OwnMachine]:
        return [m for m in self.own if m.fits]


@dataclass
class ShapePlan:
    request: ShapeRequest
    options: list[Option]  # ranked, best first
    fleets: list[Fleet]  # one per option, same order
    rejected: list[Rejected]
    prices: Optional[str] = None  # one line where prices are unavailable
    notes: list[str] = field(default_factory=list)
    unproposed: str = ""  # why no fleet is proposed although shapes fit (a budget nothing can be priced against)
    ranked_by: Order = Order.COST  # the request's order, or SIZE where cost was asked and there are no prices

    @property
    def best(self) -> Optional[Fleet]:
        """The fleet proposed: the first ranked, unless none may be (`unproposed`)."""
        return self.fleets[0] if self.fleets and not self.unproposed else None

    def to_json(self) -> dict[str, Any]:
        def option(o: Option) -> dict[str, Any]:
            return {"shape": asdict(o.shape), "tokens_per_s": o.tokens_per_s, "memory_gib": o.memory_gib,
                    "offer": None if o.offer is None else asdict(o.offer), "usd_per_hour": o.hourly,
                    "usd_per_million_tokens": o.usd_per_mtok}

        def fleet(f: Fleet) -> dict[str, Any]:
            return {"option": option(f.option), **{k: v for k, v in asdict(f).items() if k != "option"}}

        request = {**asdict(self.request), "order": self.request.order.value}
        return {"request": request, "ranked_by": self.ranked_by.value, "prices": self.prices,
                "options": [fleet(f) for f in self.fleets],
                "rejected": [{"shape": asdict(r.shape), "reason": r.reason.name, "detail": r.detail}
                             for r in self.rejected], "notes": self.notes}


def candidates(request: ShapeRequest) -> list[IslandShape]:
    """Every island shape to try: GPU x count x strategy (one device: ddp only; Apple: one machine), at the request's
    precision."""
    gpus = request.gpus or tuple(name for name, g in GPUS.items() if not g.apple)
    return [IslandShape(gpu, count, strategy, request.base, request.seq_len)
            for gpu in gpus for count in ((1,) if GPUS[gpu].apple else COUNTS)
            for strategy in STRATEGIES if count > 1 or strategy == "ddp"]


def size(model: ModelSize, shape: IslandShape) -> Optional[Option]:
    """The shape at its largest micro batch, with its speed; None where not even one block fits."""
    largest = largest_micro_batch(model, shape)
    if largest < 1:
        return None
    micro = min(largest, max(1, MAX_DEVICE_BATCH_TOKENS // shape.seq_len))
    shape = replace(shape, micro_batch=micro)
    return Option(shape, tokens_per_second(model, shape), memory(model, shape).total / GIB)


def fleet_islands(hourly: Optional[float], budget: Optional[float]) -> tuple[int, str]:
    """How many islands the budget buys (at most MAX_FLEET_ISLANDS), and why that many."""
    if budget is None or hourly is None:
        why = "no --budget" if budget is None else "no price"
        return MIN_DILOCO_ISLANDS, f"{MIN_DILOCO_ISLANDS} islands: the smallest DiLoCo fleet ({why} to size it by)"
    n = min(MAX_FLEET_ISLANDS, math.floor(budget / hourly))
    if n >= MAX_FLEET_ISLANDS:
        return n, (f"{n} islands (${n * hourly:.2f}/h of ${budget:g}/h): the most a merge averages well; spend the "
                   "rest on a bigger island")
    if n == 1:
        return 1, (f"1 island: ${budget:g}/h buys one at ${hourly:.2f}/h, so it trains alone (no merging); "
                   f"${MIN_DILOCO_ISLANDS * hourly:.2f}/h buys a DiLoCo pair")
    return n, f"{n} islands: what ${budget:g}/h buys at ${hourly:.2f}/h each"


def fleet_quorum(islands: int, spot: bool) -> tuple[int, str]:
    """All islands, except one on a spot fleet large enough that a merge without it still averages several."""
    if spot and islands >= SPOT_QUORUM_SLACK_FROM:
        return islands - 1, (f"quorum {islands - 1} of {islands}: a preempted spot island does not hold a round "
                             "back; it rejoins when relaunched")
    if spot and islands > 1:
        return islands, (f"quorum {islands}: with {islands} islands a merge needs both; a preempted one is "
                         "relaunched and the round waits (--recover-timeout)")
    return islands, f"quorum {islands}: every island in every merge (on-demand islands are not preempted)"


def tokens_per_step(shape: IslandShape) -> int:
    """Tokens one inner step trains on: a batch of micro_batch blocks on each device."""
    return shape.micro_batch * shape.seq_len * shape.count


def inner_steps(option: Option, islands: int, tokens: int) -> tuple[int, str]:
    """Inner steps that make a round take about TARGET_ROUND_S at this island's speed, fewer where `tokens` would
    otherwise make fewer than MIN_OUTER_STEPS rounds."""
    step_s = tokens_per_step(option.shape) / option.tokens_per_s
    by_time = round(TARGET_ROUND_S / step_s)
    by_tokens = tokens // (MIN_OUTER_STEPS * islands * tokens_per_step(option.shape))
    n = max(MIN_INNER_STEPS, min(MAX_INNER_STEPS, by_time, by_tokens))
    round_s = n * step_s
    why = f"{n} inner steps of {step_s:.2f}s: a round of about " + (
        f"{round_s:.0f} s" if round_s < MINUTE_S else f"{round_s / MINUTE_S:.1f} min")
    if by_tokens < min(MAX_INNER_STEPS, by_time):
        why += f", so that {tokens:,} tokens make {MIN_OUTER_STEPS}+ rounds (--outer-steps) to merge"
    return n, why


def duration(hours: float) -> str:
    """A time for people: seconds under a minute (a fast island's round is not '0 min'), then min, h, days."""
    return (f"{hours * 3600:.0f} s" if hours < 1 / 60 else f"{hours * 60:.0f} min" if hours < 1
            else f"{hours:,.1f} h" if hours < 48 else f"{hours / 24:,.1f} d")


def gpu_arg(shape: IslandShape, cloud: str, islands: int) -> str:
    """The --gpu value, in yeto's grammar (no @region: SkyPilot places each island in the cheapest region first)."""
    return ",".join([f"{cloud}:{shape.count}x{shape.gpu}"] * islands)


def island_args(shape: IslandShape) -> tuple[str, ...]:
    """The island flags that make an island the shape it was sized as."""
    args = ["--seq-len", str(shape.seq_len), "--batch-size", str(shape.micro_batch)]
    if shape.count > 1 and shape.strategy == "fsdp":
        args += ["--shard", "fsdp"]
    if shape.base == "nf4":
        args += ["--base-quantization", "nf4"]
    return tuple(args)


def launch_line(request: ShapeRequest, gpu: str, quorum: int, round_policy: list[str], outer: int,
                island: tuple[str, ...], external: int, priced: bool) -> str:
    """The `yeto launch` command for this fleet (with the budget it was sized by, which launch then checks)."""
    own = ["--external-islands", str(external)] if external else []
    budget = ["--budget", f"{request.budget:g}"] if request.budget is not None and priced else []
    return shlex.join(["yeto", "launch", "--gpu", gpu, *own, "--model", request.model,
                       "--spot" if request.spot else "--on-demand", *budget, "--outer-steps", str(outer),
                       *round_policy, "--quorum", str(quorum), *island])


def size_own(model: ModelSize, request: ShapeRequest, batch: int) -> tuple[OwnMachine, ...]:
    """Each owned machine at the fleet's per-device batch (one device: an Apple machine or one GPU of a box)."""
    machines = []
    for name in request.own:
        device = GPUS[name]
        no_nf4 = request.base == "nf4" and not device.cuda  # (sized on the bf16 base it would have to train)
        shape = IslandShape(name, 1, "ddp", "bf16" if no_nf4 else request.base, request.seq_len, micro_batch=batch)
        need_gib = memory(model, shape).total / GIB
        tps = tokens_per_second(model, shape)
        if no_nf4:
            out = ("--base-quantization nf4 is the torch island's (bitsandbytes, NVIDIA); a machine without one "
                   "joins a fleet with a bf16 base")
        elif need_gib > device.memory_gib:
            out = f"it needs {need_gib:.1f} GiB at the fleet's batch, it has {device.memory_gib:g}"
        elif (step_s := tokens_per_step(shape) / tps) > TARGET_ROUND_S:
            out = (f"one step at the fleet's batch takes it {step_s:,.0f} s, longer than a round "
                   f"({TARGET_ROUND_S:g} s): it would never push in time")
        else:
            out = ""
        machines.append(OwnMachine(name, not out, 0.0 if out else tps, need_gib, out))
    return tuple(machines)


def own_why(own: tuple[OwnMachine, ...], island_tps: float, islands: int) -> list[str]:
    """One line per owned machine: in the fleet (its pace and share of a window's tokens) or not (why)."""
    joining = sum(m.tokens_per_s for m in own)
    total = islands * island_tps + joining
    lines = []
    for m in own:
        if m.fits:
            lines.append(f"{m.name} joins ({m.memory_gib:.1f} GiB): {m.tokens_per_s:,.0f} tok/s, "
                         f"{island_tps / m.tokens_per_s:,.1f}x slower than an island, "
                         f"{m.tokens_per_s / total:.1%} of a round's tokens")
        else:
            lines.append(f"{m.name} stays out: {m.out}")
    return lines


def propose(request: ShapeRequest, option: Option, default_cloud: str, model: ModelSize) -> Fleet:
    islands, why_islands = fleet_islands(option.hourly, request.budget)
    quorum, why_quorum = fleet_quorum(islands, request.spot)
    own = size_own(model, request, option.shape.micro_batch)
    joining = [m for m in own if m.fits]
    fleet_tps = islands * option.tokens_per_s + sum(m.tokens_per_s for m in joining)
    if joining:  # time windows: each island adds what it did in the window, weighted by its tokens
        inner = 0
        round_policy = ["--round-seconds", f"{TARGET_ROUND_S:g}"]
        why_round = (f"rounds of {TARGET_ROUND_S:g} s (--round-seconds): a machine you own adds the steps it "
                     "managed instead of holding the round back; the quorum counts the cloud islands only")
        per_round = fleet_tps * TARGET_ROUND_S
    else:
        inner, why_round = inner_steps(option, islands, request.tokens)
        round_policy = ["--inner-steps", str(inner)]
        per_round = islands * inner * tokens_per_step(option.shape)
    outer = max(1, math.ceil(request.tokens / per_round))
    hours = request.tokens / fleet_tps / 3600
    cost = None if option.hourly is None else islands * option.hourly * hours
    cloud = option.offer.cloud if option.offer else default_cloud
    gpu, island = gpu_arg(option.shape, cloud, islands), island_args(option.shape)
    return Fleet(option, cloud, islands, quorum, inner, outer, request.tokens, hours, cost,
                 (why_islands, why_quorum, why_round, *own_why(own, option.tokens_per_s, islands)), gpu, island,
                 launch_line(request, gpu, quorum, round_policy, outer, island, len(joining),
                             option.hourly is not None), own)


def unsupported(shape: IslandShape) -> Optional[Rejected]:
    """A shape yeto does not run, whatever the memory."""
    device = GPUS[shape.gpu]
    if device.apple:
        return Rejected(shape, Rejection.NOT_A_CLOUD_GPU, "Apple machines join as --external-islands")
    if shape.base == "nf4" and not device.cuda:
        return Rejected(shape, Rejection.NF4_UNSUPPORTED, f"{shape.gpu} is not an NVIDIA device")
    if shape.base == "nf4" and shape.count > 1:
        return Rejected(shape, Rejection.NF4_UNSUPPORTED, "an NF4 base trains on one device per island")
    return None


def _rejection(model: ModelSize, shape: IslandShape) -> Rejected:
    device = GPUS[shape.gpu]
    need = memory(model, replace(shape, micro_batch=1)).total / GIB
    return Rejected(shape, Rejection.DOES_NOT_FIT, f"needs {need:.1f} GiB per device of {device.memory_gib:g}")


def plan_shapes(model: ModelSize, request: ShapeRequest, prices: PriceBook) -> ShapePlan:
    """Every candidate island ranked or rejected, and a fleet per ranked option."""
    best: dict[tuple[str, int], Option] = {}  # per GPU x count: the faster strategy
    rejected: dict[tuple[str, int], Rejected] = {}
    for shape in candidates(request):
        key = (shape.gpu, shape.count)
        refused = unsupported(shape)
        option = None if refused else size(model, shape)
        if option is None:
            rejected[key] = refused or _rejection(model, shape)  # the last strategy tried (fsdp) needs the least
        elif key not in best or option.tokens_per_s > best[key].tokens_per_s:
            best[key] = option
    for key in best:
        rejected.pop(key, None)
    priced = not prices.empty
    clouds = request.clouds or None
    options: list[Option] = []
    for key, option in best.items():
        offer = prices.cheapest(option.shape.gpu, option.shape.count, request.spot, clouds) if priced else None
        where = f"on {', '.join(request.clouds)}" if request.clouds else "in the catalogs read"
        if priced and offer is None:
            rejected[key] = Rejected(option.shape, Rejection.NO_PRICE,
                                     f"no {'spot' if request.spot else 'on-demand'} "
                                     f"{option.shape.count}x{option.shape.gpu} {where}")
        elif offer is not None and request.budget is not None and offer.hourly > request.budget:
            rejected[key] = Rejected(option.shape, Rejection.OVER_BUDGET,
                                     f"${offer.hourly:.2f}/h on {offer.cloud} > ${request.budget:g}/h")
        else:
            options.append(replace(option, offer=offer))
    default_cloud = request.clouds[0] if request.clouds else "aws"
    fleets = [propose(request, o, default_cloud, model) for o in options]

    order = Order.SIZE if request.order is Order.COST and not priced else request.order

    def rank(f: Fleet) -> tuple[bool, float, float, float]:
        """A fleet that can merge (2+ islands) first; then by the order asked, the others breaking ties."""
        cost = f.option.usd_per_mtok if f.option.usd_per_mtok is not None else math.inf
        solo = f.islands < MIN_DILOCO_ISLANDS
        size = island_gib(f.option.shape)
        return {Order.COST: (solo, cost, f.hours, size), Order.TIME: (solo, f.hours, cost, size),
                Order.SIZE: (solo, size, f.hours, cost)}[order]

    fleets.sort(key=rank)
    by_size = "size (the island's device memory together), the smallest first; --by time ranks the fastest first"
    notes = [] if priced else [f"prices missing: ranked by {by_size if order is Order.SIZE else order.value}; the "
                               f"launch lines name {default_cloud} (--clouds names yours)"]
    unproposed = "" if priced or request.budget is None else (
        f"no fleet proposed: --budget ${request.budget:g}/h needs prices to size a fleet by, and none could be read "
        "(see above); refresh SkyPilot's catalog (`sky check`, then `sky show-gpus`), or leave --budget out to "
        "see the shapes unpriced")
    return ShapePlan(request, [f.option for f in fleets], fleets,
                     sorted(rejected.values(), key=lambda r: (r.reason.name, r.shape.gpu, r.shape.count)),
                     prices.unavailable, notes, unproposed, order)
