"""The launch commands: `yeto launch`, `yeto status`, `yeto logs`, `yeto down`."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Annotated, Optional

import typer

from yeto.cli.usage import with_help_panels

from yeto import YetoError
from yeto.cli.launch_flags import check_passed_flags
from yeto.launch.plan import SYNCER_PORT, FleetPlan, pin_revision, split_extra_args
from yeto.launch.registry import live_run, runs_dir
from yeto.launch.spec import GRAMMAR, parse_gpu

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
        raise YetoError(f"--quorum-timeout {value} would end the run before a lost learner is given up "
                        f"(--recover-timeout {recover_timeout:g}s): use at least {needed:g}, or lower "
                        "--recover-timeout")
    return []


def _default_name(out: str) -> str:
    name = re.sub(r"[^a-z0-9-]+", "-", Path(out).resolve().name.lower()).strip("-")
    return (name if name[:1].isalpha() else f"run-{name}")[:35].rstrip("-") or "run"


def launch_command(
    ctx: typer.Context,
    gpu: Annotated[str, typer.Option(help=f"One learner island per entry: {GRAMMAR}.")] = "local:2",
    external_learners: Annotated[int, typer.Option(help="Reserved slots for machines you own (a Mac, a box): each "
                                                        "gets a join script in OUT/join/.")] = 0,
    mlx_learners: Annotated[int, typer.Option(help="With local:N, how many of the N islands run the MLX backend.")
                            ] = 0,
    model: Annotated[str, typer.Option(help="Model alias, local directory or hub id.")] = "smollm2-135m",
    model_revision: Annotated[Optional[str], typer.Option(help="Hub revision; pinned to a commit before launch.")
                              ] = None,
    data: Annotated[str, typer.Option(help="Training data: a file or directory (shipped to cloud learners), a hub "
                                           "dataset id, or an object-store URI (mounted).")] = "data/demo",
    data_revision: Annotated[Optional[str], typer.Option(help="Hub revision of the dataset; pinned before launch.")
                             ] = None,
    out: Annotated[str, typer.Option(help="Run directory on this machine: credentials, plan, join scripts, logs "
                                          "(local runs: syncer/ and island-I/ too).")] = "runs/fleet",
    name: Annotated[Optional[str], typer.Option(help="Run name (default: from --out); names the clusters.")] = None,
    port: Annotated[int, typer.Option(help="Syncer port (0 with local:N: pick a free one).")] = 0,
    public_host: Annotated[str, typer.Option(help="Local runs with --external-learners: the address other machines "
                                                  "reach this one at.")] = "127.0.0.1",
    outer_steps: Annotated[int, typer.Option(help="Merges to run.")] = 3,
    inner_steps: Annotated[int, typer.Option(help="Inner steps per learner per round.")] = 10,
    quorum: Annotated[int, typer.Option(help="Responders needed to merge a round (default: all learners).")] = 0,
    overlap: Annotated[bool, typer.Option(help="Learners keep training while a merge is in flight.")] = False,
    spot: Annotated[bool, typer.Option("--spot/--on-demand", help="Cloud learners on spot capacity (the head is "
                                                                  "always on-demand).")] = True,
    retry_until_up: Annotated[bool, typer.Option(help="Keep trying until the cloud has capacity.")] = False,
    recover_timeout: Annotated[float, typer.Option(help="Relaunch a preempted or failed learner for this many "
                                                        "seconds, then go on without it.")] = 1800.0,
    output: Annotated[Optional[str], typer.Option(help="Where the merged adapter goes at the end: a path, s3://..., "
                                                       "gs://..., or hf://org/repo.")] = None,
    head: Annotated[Optional[str], typer.Option(help="Infra of the head VM (default: the first island's cloud).")
                    ] = None,
    dry_run: Annotated[bool, typer.Option(help="Print what would run (cloud: the SkyPilot tasks) and stop.")] = False,
    report_to: Annotated[str, typer.Option(help="Experiment trackers for the syncer and every learner, "
                                                "comma-separated: tensorboard, wandb, trackio, mlflow, or none; cloud "
                                                "tasks get their credentials (WANDB_API_KEY, ...) as SkyPilot secrets.")
                         ] = "none",
) -> None:
    """Run a DiLoCo fleet. Any syncer flag (--sync-bits 8, --outer-lr 0.5, --round-seconds 60, see `yeto syncer
    --help`) goes to the syncer; any other flag (--seq-len 128 --lr 1e-3) to every learner (`yeto train --help`)."""
    from rich.console import Console

    islands = parse_gpu(gpu)
    syncer_extra, learner_extra = split_extra_args(list(ctx.args))
    local = all(i.local for i in islands)
    plan = FleetPlan(name or _default_name(out), out, islands, external_learners, mlx_learners, model, model_revision,
                     data, data_revision, port=port if local else (port or SYNCER_PORT), spot=spot,
                     retry_until_up=retry_until_up, recover_timeout=recover_timeout, output=output, head_infra=head,
                     report_to=report_to)
    plan.check()
    n = plan.num_learners
    plan.syncer_args = ["--outer-steps", str(outer_steps), "--inner-steps", str(inner_steps),
                       "--quorum", str(quorum or n), *syncer_extra]
    plan.learner_args = [*(["--overlap"] if overlap else []), *learner_extra]
    check_passed_flags(plan)  # before anything is provisioned: a flag a learner would refuse is one line here
    if not local:
        plan.syncer_args += quorum_timeout_args(syncer_extra, recover_timeout)
    if not dry_run and live_run(plan.name) is not None:
        raise YetoError(f"a run named {plan.name!r} is recorded as running ({runs_dir()}/{plan.name}.json): "
                        f"`yeto down {plan.name}` first, or pick another --name")
    console = Console()
    plan.model_revision = pin_revision(model, model_revision, "model")
    plan.data_revision = pin_revision(data, data_revision, "dataset")
    if local:
        from yeto.launch.local import launch_local

        if dry_run:
            console.print(plan.to_json(), markup=False, highlight=False)
            raise typer.Exit(0)
        raise typer.Exit(launch_local(plan, public_host))
    plan.ship_local_paths()
    Path(out).mkdir(parents=True, exist_ok=True)
    from yeto.launch.submit import launch_cloud

    raise typer.Exit(launch_cloud(plan, dry_run, console))


with_help_panels(launch_command, advanced=("model_revision", "data_revision", "name", "port", "public_host", "overlap",
                                           "retry_until_up", "recover_timeout", "head"))


RunArg = Annotated[Optional[str], typer.Argument(help="The run's name (default: the latest launched).")]


def status_command(run: RunArg = None) -> None:
    """A run's clusters or processes, learners (alive, merges answered, last delta), rounds, last merge, cost."""
    from rich.console import Console

    from yeto.launch.manage import status
    from yeto.launch.registry import load_run

    status(load_run(run), Console())


def logs_command(run: RunArg = None,
                 learner: Annotated[Optional[int], typer.Option(help="Learner I's log (default: the syncer's).")
                                    ] = None,
                 follow: Annotated[bool, typer.Option(help="Keep following while the run lives.")] = True) -> None:
    """Follow a run's logs."""
    from yeto.launch.manage import logs
    from yeto.launch.registry import load_run

    logs(load_run(run), learner, follow)


def down_command(run: Annotated[str, typer.Argument(help="The run's name.")]) -> None:
    """Stop a run and tear down every cluster it launched."""
    from rich.console import Console

    from yeto.launch.manage import down
    from yeto.launch.registry import load_run

    raise typer.Exit(down(load_run(run), Console()))
