"""The flags `yeto launch` passes on, parsed on this machine by the parsers of the commands that will get them,
before anything is provisioned (dry runs included): a flag an island or the syncer would refuse costs one line
here, not a fleet of VMs whose islands exit 2 and get relaunched.

The islands' flags (`yeto train --backend torch|mlx`) go through their train command (`yeto.cli.train_command.
make_train_command`, the one signature every backend's command is made from) with the backend's own checks
(`yeto.island.interface.Backend.check_flags`) in place of its training, so that nothing loads a model and no torch is
imported for them; the syncer's through its command's parser, without running it (that
imports what `yeto.sync.shell.server` imports).
"""

from __future__ import annotations

import difflib
import inspect
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Optional

from yeto import YetoError
from yeto.backends import MLX, TORCH, load_backend
from yeto.cli.train_command import make_train_command
from yeto.island.task_eval import load_eval_task
from yeto.island.train_config import TrainConfig
from yeto.launch.plan import SYNCER_PORT, FleetPlan
from yeto.launch.rundir import SYNCER_DIR
from yeto.sync.core.config import SyncerConfig
from yeto.launch.tasks import SYNCER_ENTRY, island_flags, syncer_argv
from yeto.cli.usage import click_command, usage_errors, with_old_spellings

HELP = {TORCH: "`yeto train --help`", MLX: "`yeto train --help` and docs/MLX.md"}
WHO = {TORCH: "every island (yeto train --backend torch)", MLX: "the MLX islands (yeto train --backend mlx)"}
PLACEHOLDER_SYNCER = "127.0.0.1:1"  # the island's --syncer is launch's own (known once the head is up)


class UnknownFlag(YetoError):
    """A flag that no command `yeto launch` forwards to takes: blamed on none of them."""


def command_flags(command: Any) -> list[str]:
    """The flags a click command shows in its help (old spellings, hidden, are left out)."""
    return [o for p in command.params if not getattr(p, "hidden", False)
            for o in (*p.opts, *p.secondary_opts) if o.startswith("--")]


def run_parser(fn: Callable[..., Any], args: list[str], prog: str, invoke: bool,
               unknown: Optional[Callable[[str], str]] = None) -> None:
    """Parse `args` with the click command typer makes of `fn` (and, with `invoke`, run `fn` on them). A usage
    error (unknown flag, bad value, missing value) becomes a YetoError with click's one-line message; an unknown
    flag's, with `unknown`, is `unknown(flag)`."""
    command = click_command(fn)
    try:
        with command.make_context(prog, list(args)) as ctx:
            if invoke:
                command.invoke(ctx)
    except usage_errors() as e:
        flag = getattr(e, "option_name", None)  # (click's NoSuchOption)
        if unknown is not None and flag:
            raise UnknownFlag(unknown(flag)) from e
        raise YetoError(" ".join(e.format_message().split())) from e


def unknown_flag_message(flag: str, owners: dict[str, str]) -> str:
    """A flag no command of the fleet takes, with the nearest flags of every command launch forwards to (`owners`:
    flag -> whose), each with whose it is."""
    near = difflib.get_close_matches(flag, list(owners))
    hint = f" (possible options: {', '.join(f'{f} ({owners[f]})' for f in near)})" if near else ""
    return (f"No such option: {flag}{hint}; yeto launch takes its own flags (`yeto launch --help`), the syncer's "
            "(`yeto syncer --help`) and the islands' (`yeto train --help`)")


def fleet_flags(launch_flags: Iterable[str]) -> dict[str, str]:
    """Every flag `yeto launch` takes or forwards -> whose it is (launch's own first, then the syncer's it passes
    on, then the islands')."""
    from yeto.launch.plan import syncer_flags
    from yeto.sync.core.config import OLD_FLAGS

    island = command_flags(click_command(make_train_command(lambda cfg, progress, asked: None, doc="", backend=TORCH)))
    owners: dict[str, str] = {}
    for who, flags in (("yeto launch", launch_flags), ("the syncer", sorted(syncer_flags() - set(OLD_FLAGS))),
                       ("the islands", island)):
        for f in flags:
            owners.setdefault(f, who)
    return owners


def check_island_flags(plan: FleetPlan, backend: str, launch_flags: Iterable[str] = ()) -> TrainConfig:
    """The island's flags as launch builds them, through `yeto train --backend BACKEND`'s parser and the backend's
    checks (the MLX island's: the flags it cannot honour; neither imports a tensor library). A flag it does not take
    is no command's (launch gives the syncer its own): named with the nearest of them all (`launch_flags` too).
    Returns the config they make."""
    checks = load_backend(backend).check_flags
    args = island_flags(plan, 0, PLACEHOLDER_SYNCER, plan.data, plan.model) + ["--no-progress"]
    made: list[TrainConfig] = []

    def check(cfg: TrainConfig, progress: bool, asked: Any) -> None:
        checks(cfg)
        load_eval_task(cfg)  # (an --eval-task file is read here: a bad one is one line before anything launches)
        made.append(cfg)

    try:
        run_parser(make_train_command(check, doc="", backend=backend), args,
                   f"yeto train --backend {backend}", invoke=True,
                   unknown=lambda flag: unknown_flag_message(flag, fleet_flags(launch_flags)))
    except UnknownFlag:
        raise
    except YetoError as e:
        raise YetoError(f"{e} (an island flag: yeto launch passes the flags it does not take itself to "
                        f"{WHO[backend]}; see {HELP[backend]})") from e
    return made[0]


def check_syncer_flags(plan: FleetPlan) -> SyncerConfig:
    """The syncer's command line as launch builds it, through `yeto syncer`'s parser (its old spellings included),
    not run: the config it makes."""
    from yeto.cli.syncer_command import OLD_SPELLINGS, syncer_command as syncer_cli

    made: dict[str, Any] = {}

    def capture(**flags: Any) -> None:
        made.update(flags)

    capture.__signature__ = inspect.signature(syncer_cli.__wrapped__, eval_str=True)  # type: ignore[attr-defined]
    argv = syncer_argv(plan, "127.0.0.1", plan.port or SYNCER_PORT, Path(plan.out) / SYNCER_DIR, "python3")
    args = argv[1 + len(SYNCER_ENTRY):]
    try:
        run_parser(with_old_spellings(capture, OLD_SPELLINGS), args, "yeto syncer", invoke=True)
    except YetoError as e:
        raise YetoError(f"{e} (a syncer flag: see `yeto syncer --help`)") from e
    return SyncerConfig(**{k: v for k, v in made.items() if k in SyncerConfig.__dataclass_fields__})


@dataclass(frozen=True)
class PassedFlags:
    """What the flags launch passes on make: the syncer's config and an island's (the torch one's where any)."""

    syncer: SyncerConfig
    island: TrainConfig


def check_passed_flags(plan: FleetPlan, launch_flags: Iterable[str] = ()) -> PassedFlags:
    """Every flag the fleet's processes will get, parsed by their own parsers: the syncer's, the torch islands'
    (cloud islands, local ones, and reserved slots), and the MLX islands' (--mlx-islands). `launch_flags`: launch's
    own, among those an unknown flag is matched against."""
    syncer = check_syncer_flags(plan)
    made = []
    if len(plan.islands) > plan.mlx or plan.external:
        made.append(check_island_flags(plan, TORCH, launch_flags))
    if plan.mlx:
        made.append(check_island_flags(plan, MLX, launch_flags))
    return PassedFlags(syncer, made[0])
