"""The flags `yeto launch` passes on, parsed on this machine by the parsers of the commands that will get them,
before anything is provisioned (dry runs included): a flag a learner or the syncer would refuse costs one line
here, not a fleet of VMs whose learners exit 2 and get relaunched.

The learners' flags go through their train command (`yeto.cli.train.make_train_command`, the one signature every
backend's command is made from) with the backend's own checks in place of its training, so that nothing loads a
model and no torch is imported for them; the syncer's through its command's parser, without running it (that
imports what `yeto.sync.shell.server` imports).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

from yeto import YetoError
from yeto.cli.train import make_train_command
from yeto.island.config import TrainConfig, check_config
from yeto.launch.plan import SYNCER_PORT, FleetPlan
from yeto.launch.tasks import SYNCER_ENTRY, learner_argv, syncer_argv
from yeto.cli.usage import usage_errors

TORCH_BACKEND, MLX_BACKEND = "yeto.backends.torch", "yeto.backends.mlx"
HELP = {TORCH_BACKEND: "`yeto train --help`", MLX_BACKEND: "`python -m yeto.backends.mlx --help`"}
WHO = {TORCH_BACKEND: "every learner", MLX_BACKEND: "the MLX learners"}
PLACEHOLDER_SYNCER = "127.0.0.1:1"  # the learner's --syncer is launch's own (known once the head is up)


def run_parser(fn: Callable[..., Any], args: list[str], prog: str, invoke: bool) -> None:
    """Parse `args` with the click command typer makes of `fn` (and, with `invoke`, run `fn` on them). A usage
    error (unknown flag, bad value, missing value) becomes a YetoError with click's one-line message."""
    import typer
    import typer.main

    app = typer.Typer(add_completion=False)
    app.command()(fn)
    command = typer.main.get_command(app)
    try:
        with command.make_context(prog, list(args)) as ctx:
            if invoke:
                command.invoke(ctx)
    except usage_errors() as e:
        raise YetoError(" ".join(e.format_message().split())) from e


def _backend_checks(backend: str) -> Callable[[TrainConfig], None]:
    """What the backend refuses before it loads a model (the MLX learner: the flags it cannot honour)."""
    if backend == MLX_BACKEND:
        from yeto.backends.mlx import learner as mlx_learner  # (imports neither MLX nor torch)

        return mlx_learner.check_flags
    return check_config


def check_learner_flags(plan: FleetPlan, backend: str) -> None:
    """The learner's command line as launch builds it, through the backend's train command."""
    checks = _backend_checks(backend)
    args = learner_argv(plan, 0, PLACEHOLDER_SYNCER, plan.data, plan.model, backend)[3:] + ["--no-progress"]
    try:
        run_parser(make_train_command(lambda cfg, progress, asked: checks(cfg), doc="", backend=backend), args,
                   backend, invoke=True)
    except YetoError as e:
        raise YetoError(f"{e} (a learner flag: yeto launch passes the flags it does not take itself to "
                        f"{WHO[backend]}; see {HELP[backend]})") from e


def check_syncer_flags(plan: FleetPlan) -> None:
    """The syncer's command line as launch builds it, through `yeto syncer`'s parser (not run)."""
    from yeto.cli.syncer import syncer_command as syncer_cli

    argv = syncer_argv(plan, "127.0.0.1", plan.port or SYNCER_PORT, Path(plan.out) / "syncer", "python3")
    args = argv[1 + len(SYNCER_ENTRY):]
    try:
        run_parser(syncer_cli, args, "yeto syncer", invoke=False)
    except YetoError as e:
        raise YetoError(f"{e} (a syncer flag: see `yeto syncer --help`)") from e


def check_passed_flags(plan: FleetPlan) -> None:
    """Every flag the fleet's processes will get, parsed by their own parsers: the syncer's, the torch learners'
    (cloud islands, local ones, and reserved slots), and the MLX learners' (--mlx-learners)."""
    check_syncer_flags(plan)
    if len(plan.islands) > plan.mlx or plan.external:
        check_learner_flags(plan, TORCH_BACKEND)
    if plan.mlx:
        check_learner_flags(plan, MLX_BACKEND)
