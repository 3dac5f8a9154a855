"""The launch commands: `yeto launch`, `yeto status`, `yeto logs`, `yeto down`."""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Annotated, Any, Optional

import typer

from yeto.cli.config_file import passed_on_args
from yeto.cli.usage import OldSpelling, click_command, with_help_panels

from yeto import YetoError
from yeto.cli.launch_flags import PassedFlags, check_passed_flags, command_flags
from yeto.island.records import DEMO_DATA
from yeto.launch.costs import flag_value, without_flag
from yeto.launch.plan import SYNCER_PORT, FleetPlan, pin_revision, split_extra_args
from yeto.launch.registry import live_run, runs_dir
from yeto.launch.rundir import check_run_dir
from yeto.report.trackers import report_to_help
from yeto.launch.spec import GRAMMAR, parse_gpu

DEFAULT_GPU = "local:2"
DEFAULT_INNER_STEPS = 10
GIVE_UP_MARGIN_S = 300.0  # polls, teardown and the syncer's rescan between a give-up and the lowered quorum


def quorum_timeout_args(syncer_extra: list[str], recover_timeout: float) -> list[str]:
    """A round short of quorum must outwait the controller's relaunches: by default the syncer waits
    --recover-timeout plus a margin (it would give up first otherwise); a shorter explicit value is refused."""
    given = [a for a in syncer_extra if a.split("=", 1)[0] == "--quorum-timeout"]
    needed = recover_timeout + GIVE_UP_MARGIN_S
    if not given:
        return ["--quorum-timeout", f"{needed:g}"]
    i = syncer_extra.index(given[0])
    value = given[0].split("=", 1)[1] if "=" in given[0] else syncer_extra[i + 1]
    try:
        ok = float(value) >= needed
    except ValueError:
        ok = True  # (not reached: check_passed_flags has named the bad value already)
    if not ok:
        raise YetoError(f"--quorum-timeout {value} would end the run before a lost island is given up "
                        f"(--recover-timeout {recover_timeout:g}s): use at least {needed:g}, or lower "
                        "--recover-timeout")
    return []


@dataclass(frozen=True)
class ChosenFleet:
    """What `--budget` without `--gpu` takes from `yeto shape`'s first option."""

    launch_gpu: str
    inner_steps: int
    quorum: int
    island_args: list[str]  # the batch size (and sharding) the island was sized with, where not passed


def choose_fleet(model: str, budget: float, spot: bool, island_extra: list[str], console) -> ChosenFleet:
    """The fleet `yeto shape` ranks first (cost per token) within the budget, for the islands' --seq-len and
    --base-quantization; printed with why."""
    from yeto.cli.shape_command import make_plan
    from yeto.island.train_config import TrainConfig

    given = flag_value(island_extra, "--seq-len")
    if given is not None and not given.isdigit():
        raise YetoError(f"--seq-len {given!r}: give the tokens per block, a whole number (an island flag)")
    seq_len = int(given) if given is not None else TrainConfig().seq_len
    quantization = flag_value(island_extra, "--base-quantization") or "none"
    plan = make_plan(model, budget, spot=spot, seq_len=seq_len, base_quantization=quantization)
    best = plan.best
    if best is None or best.cost is None:
        why = plan.unproposed or (plan.prices if best is not None else "no island shape fits within it")
        raise YetoError(f"--budget {budget:g}: {why}; `yeto shape --model {model} --budget {budget:g}` shows the "
                        "shapes, then name --gpu yourself")
    shape, gpu = best.option.shape, best.gpu
    sized = list(best.island_args)  # flag, value pairs; the user's own flags stay
    island_args = [a for i in range(0, len(sized), 2) if flag_value(island_extra, sized[i]) is None
                    for a in sized[i:i + 2]]
    console.print(f"--budget ${budget:g}/h: --gpu {gpu} ({best.islands} x {shape.count}x{shape.gpu} {shape.strategy} "
                  f"on {best.cloud} at ${best.option.hourly:.2f}/h each, ${best.option.usd_per_mtok:.3g} per million "
                  f"tokens: the cheapest per token of {len(plan.fleets)} shapes that fit; `yeto shape --model "
                  f"{model} --budget {budget:g}` lists them)", highlight=False, markup=False, soft_wrap=True)
    for why in best.why:
        console.print(f"  {why}", highlight=False, markup=False, soft_wrap=True)
    return ChosenFleet(gpu, best.inner_steps, best.quorum, island_args)


def epochs_or_outer_steps(ctx: typer.Context, island_extra: list[str]) -> list[str]:
    """--epochs (an island flag launch turns into the fleet's --outer-steps) and --outer-steps are one choice: where
    both are set, the one on the command line wins over a --config file's (the file's --epochs is dropped); both on
    the command line, or both in the file, is one line. --epochs with --max-steps is one line too."""
    epochs = flag_value(island_extra, "--epochs")
    if epochs is None:
        return island_extra
    max_steps = flag_value(island_extra, "--max-steps")
    if max_steps is not None:
        raise YetoError(f"--epochs {epochs} and --max-steps {max_steps} both set the run's length: give one of them "
                        "(a fleet runs --outer-steps x --inner-steps steps; --epochs N computes --outer-steps from "
                        "the islands' data before launch)")
    source = ctx.get_parameter_source("outer_steps").name
    if source == "DEFAULT":
        return island_extra
    epochs_on_line = "--epochs" in {a.split("=", 1)[0] for a in ctx.args}
    if (source == "COMMANDLINE") == epochs_on_line:
        raise YetoError(f"--epochs {epochs} and --outer-steps {ctx.params['outer_steps']} both set the fleet's "
                        "length: give one of them (--epochs N: --outer-steps computed from the islands' data shards "
                        "before launch)")
    return island_extra if epochs_on_line else without_flag(island_extra, "--epochs")


def length_from_epochs(plan: FleetPlan, passed: PassedFlags, inner_steps: int, console: Any) -> PassedFlags:
    """The fleet's --outer-steps from --epochs, counted on the data here (`yeto.launch.epochs`) and printed; the
    islands get no --epochs (their run's length is the syncer's). Refused with --round-seconds, whose rounds have no
    fixed steps."""
    from yeto.launch.epochs import epoch_length

    epochs = passed.island.epochs
    if passed.syncer.round_seconds > 0:
        raise YetoError(f"--epochs {epochs:g} needs a fixed number of steps a round, and --round-seconds "
                        f"{passed.syncer.round_seconds:g} has none (its rounds are time windows): give --outer-steps "
                        "with --round-seconds, or leave --round-seconds out")
    length = epoch_length(plan, passed.island, inner_steps)
    plan.syncer_args[plan.syncer_args.index("--outer-steps") + 1] = str(length.outer_steps)
    plan.island_args = without_flag(plan.island_args, "--epochs")
    console.print(length.line(), highlight=False, markup=False, soft_wrap=True)
    return PassedFlags(replace(passed.syncer, outer_steps=length.outer_steps), passed.island)


def _default_name(out: str) -> str:
    name = re.sub(r"[^a-z0-9-]+", "-", Path(out).resolve().name.lower()).strip("-")
    return (name if name[:1].isalpha() else f"run-{name}")[:35].rstrip("-") or "run"


# renamed flags, still accepted (hidden)
LAUNCH_OLD_SPELLINGS = (OldSpelling("--external-learners", "external_islands"),  # old spelling
                        OldSpelling("--mlx-learners", "mlx_islands"))  # old spelling


def launch_command(
    ctx: typer.Context,
    gpu: Annotated[Optional[str], typer.Option(help=f"One island per entry: {GRAMMAR} (default: {DEFAULT_GPU}; "
                                                   "with --budget, the fleet `yeto shape` ranks first).")] = None,
    budget: Annotated[Optional[float], typer.Option(help="USD per hour for the cloud islands: without --gpu, launch "
                                                         "the cheapest fleet per token within it; with --gpu, refuse "
                                                         "a fleet that costs more.")] = None,
    external_islands: Annotated[int, typer.Option(help="Reserved slots for machines you own (a Mac, a box): each "
                                                        "gets a join script in OUT/join/.")] = 0,
    mlx_islands: Annotated[int, typer.Option(help="With local:N, how many of the N islands run on MLX (yeto train "
                                                   "--backend mlx; the others --backend torch).")] = 0,
    model: Annotated[str, typer.Option(help="Model alias, local directory or hub id.")] = "smollm2-135m",
    model_revision: Annotated[Optional[str], typer.Option(help="Hub revision; pinned to a commit before launch.")
                              ] = None,
    data: Annotated[str, typer.Option(help="Training data: a file or directory (shipped to cloud islands), a hub "
                                           "dataset id, or an object-store URI (mounted); default: the packaged "
                                           "demo data.")] = DEMO_DATA,
    data_revision: Annotated[Optional[str], typer.Option(help="Hub revision of the dataset; pinned before launch.")
                             ] = None,
    out: Annotated[str, typer.Option(help="Run directory on this machine: credentials, plan, join scripts, logs "
                                          "(local runs: syncer/ and island-I/ too).")] = "runs/fleet",
    name: Annotated[Optional[str], typer.Option(help="Run name (default: from --out); names the clusters.")] = None,
    port: Annotated[int, typer.Option(help="Syncer port (0 with local:N: pick a free one).")] = 0,
    public_host: Annotated[str, typer.Option(help="Local runs with --external-islands: the address other machines "
                                                  "reach this one at.")] = "127.0.0.1",
    outer_steps: Annotated[int, typer.Option(help="Merges to run.")] = 3,
    inner_steps: Annotated[Optional[int], typer.Option(help=f"Inner steps per island per round (default: "
                                                            f"{DEFAULT_INNER_STEPS}; with --budget and no --gpu, "
                                                            "sized to a round of minutes).")] = None,
    quorum: Annotated[int, typer.Option(help="Responders needed to merge a round (default: all islands).")] = 0,
    overlap: Annotated[bool, typer.Option(help="Islands keep training while a merge is in flight.")] = False,
    spot: Annotated[bool, typer.Option("--spot/--on-demand", help="Cloud islands on spot capacity (the head is "
                                                                  "always on-demand).")] = True,
    retry_until_up: Annotated[bool, typer.Option(help="Keep trying until the cloud has capacity.")] = False,
    recover_timeout: Annotated[float, typer.Option(help="Relaunch a preempted or failed island for this many "
                                                        "seconds, then go on without it.")] = 1800.0,
    output: Annotated[Optional[str], typer.Option(help="Where the merged adapter goes at the end: a path, s3://..., "
                                                       "gs://..., or hf://org/repo.")] = None,
    head: Annotated[Optional[str], typer.Option(help="Infra of the head VM (default: the first island's cloud).")
                    ] = None,
    dry_run: Annotated[bool, typer.Option(help="Print what would run (cloud: the SkyPilot tasks) and stop.")] = False,
    fresh: Annotated[bool, typer.Option(help="Start the run in --out over: the syncer's and every local island's "
                                             "saved state replaced (its keys kept). Without it, a launch on a run's "
                                             "--out continues that run to --outer-steps.")] = False,
    report_to: Annotated[str, typer.Option(help=report_to_help(
        "the syncer and every island", " Cloud tasks get their credentials (WANDB_API_KEY, ...) as SkyPilot "
                                        "secrets."))] = "none",
) -> None:
    """Run a DiLoCo fleet. Any syncer flag (--sync-bits 8, --outer-lr 0.5, --round-seconds 60, see `yeto syncer
    --help`) goes to the syncer; any other flag (--seq-len 128 --lr 1e-3) to every island (`yeto train --help`)."""
    from rich.console import Console

    syncer_extra, island_extra = split_extra_args(passed_on_args(ctx) + list(ctx.args))
    console = Console()
    if budget is not None and not budget > 0:
        raise YetoError(f"--budget {budget:g}: give the fleet's price limit in USD per hour, above 0")
    if budget is not None and gpu is None:
        fleet = choose_fleet(model, budget, spot, island_extra, console)
        gpu = fleet.launch_gpu
        inner_steps = fleet.inner_steps if inner_steps is None else inner_steps
        quorum = quorum or fleet.quorum
        island_extra += fleet.island_args
    island_extra = epochs_or_outer_steps(ctx, island_extra)
    gpu = DEFAULT_GPU if gpu is None else gpu
    inner_steps = DEFAULT_INNER_STEPS if inner_steps is None else inner_steps
    islands = parse_gpu(gpu)
    local = all(i.local for i in islands)
    plan = FleetPlan(name or _default_name(out), out, islands, external_islands, mlx_islands, model, model_revision,
                     data, data_revision, port=port if local else (port or SYNCER_PORT), spot=spot,
                     retry_until_up=retry_until_up, recover_timeout=recover_timeout, output=output, head_infra=head,
                     report_to=report_to)
    plan.check()
    n = plan.num_islands
    plan.syncer_args = ["--outer-steps", str(outer_steps), "--inner-steps", str(inner_steps),
                       "--quorum", str(quorum or n), *syncer_extra]
    plan.island_args = [*(["--overlap"] if overlap else []), *island_extra]
    # before anything is provisioned or started, one line each: a flag the syncer or an island would refuse, a model or
    # data it would not find, a busy port
    passed = check_passed_flags(plan, command_flags(ctx.command))
    plan.check_sources(flag_value(island_extra, "--data-config"))
    if passed.island.epochs is not None:
        passed = length_from_epochs(plan, passed, inner_steps, console)
    if local:
        from yeto.launch.local import check_port_free

        check_port_free(port, public_host)
    run_dir = check_run_dir(out, passed.syncer, passed.island, list(range(len(islands))), fresh) if local else ""
    if not local:
        plan.syncer_args += quorum_timeout_args(syncer_extra, recover_timeout)
    if budget is not None:
        if local:
            raise YetoError("--budget prices cloud islands and local:N costs nothing: leave --budget out, or name "
                            "cloud islands in --gpu (or leave --gpu out)")
        from yeto.launch.costs import check_budget
        from yeto.launch.prices import load_prices

        check_budget(plan, load_prices(sorted({i.cloud for i in islands})), budget)
    if not dry_run and live_run(plan.name) is not None:
        raise YetoError(f"a run named {plan.name!r} is recorded as running ({runs_dir()}/{plan.name}.json): "
                        f"`yeto down {plan.name}` first, or pick another --name")
    plan.model_revision = pin_revision(model, model_revision, "model")
    plan.data_revision = pin_revision(data, data_revision, "dataset")
    if local:
        from yeto.launch.local import launch_local

        if dry_run:
            console.print(plan.to_json(), markup=False, highlight=False, soft_wrap=True)  # (JSON: no wrapping)
            raise typer.Exit(0)
        if run_dir:
            console.print(run_dir, markup=False, highlight=False, soft_wrap=True)
        raise typer.Exit(launch_local(plan, public_host, fresh=fresh))
    plan.ship_local_paths()
    Path(out).mkdir(parents=True, exist_ok=True)
    from yeto.launch.submit import launch_cloud

    raise typer.Exit(launch_cloud(plan, dry_run, console))


with_help_panels(launch_command, advanced=("model_revision", "data_revision", "name", "port", "public_host", "overlap",
                                           "retry_until_up", "recover_timeout", "head"))


def launch_passes_on() -> list[tuple[str, Any]]:
    """The commands `yeto launch` passes the flags it does not take itself to, as click commands (a --config file may
    hold their flags): the syncer's first (it takes its own), then the islands' (the rest)."""
    from yeto.cli.syncer_command import syncer_command as syncer_cli
    from yeto.cli.train_command import train_command

    return [("yeto syncer", click_command(syncer_cli)), ("yeto train", click_command(train_command()))]


RUN_HELP = "The run's name or its --out (or the syncer/ or an island-I/ in it)"
RunArg = Annotated[Optional[str], typer.Argument(help=f"{RUN_HELP} (default: the latest launched).")]


def status_command(run: RunArg = None) -> None:
    """A run's clusters or processes, islands (alive, merges answered, last delta), rounds, last merge, cost."""
    from rich.console import Console

    from yeto.launch.manage import status
    from yeto.launch.registry import launched_run

    status(launched_run(run), Console())


def logs_command(run: RunArg = None,
                 island: Annotated[Optional[int], typer.Option(help="Island I's log (default: the syncer's).")
                                    ] = None,
                 follow: Annotated[bool, typer.Option(help="Keep following while the run lives.")] = True) -> None:
    """Follow a run's logs."""
    from yeto.launch.manage import logs
    from yeto.launch.registry import launched_run

    logs(launched_run(run), island, follow)


def down_command(run: Annotated[str, typer.Argument(help=f"{RUN_HELP}.")]) -> None:
    """Stop a run and tear down every cluster it launched."""
    from rich.console import Console

    from yeto.launch.manage import down
    from yeto.launch.registry import launched_run

    raise typer.Exit(down(launched_run(run), Console()))
