"""Running a typer command so that a person's mistake costs one line, never a traceback.

A usage error (unknown flag, bad value, missing option) is click's usual few lines and exit 2; a `YetoError`
(bad input found by yeto's own checks) is one `error: ...` line and exit 2. typer 0.26+ bundles its own copy of
click and raises that copy's exceptions, so both copies' classes are caught here.

How a command's help reads is here too: its panels, its old spellings, and the help texts more than one command
shows, written once.
"""

from __future__ import annotations

import functools
import inspect
import sys
import typing
from types import ModuleType
from dataclasses import dataclass
from typing import Annotated, Any, Callable, Iterable, Optional

import typer

from yeto import YetoError

ADVANCED_PANEL = "Advanced (defaults need no touching)"
# help texts more than one command shows, written once (`--report-to`'s: yeto.report.trackers.report_to_help)
ADAPTER_HELP = ("The adapter directory, or a run's: a launch's --out (the syncer's merged adapter), a syncer's or "
                "a yeto train's --out, or a launched run's name.")
BASE_MODEL_HELP = ("Base model alias, local directory or hub id (default: the base the adapter records; given, it "
                   "must be that base).")
BASE_REVISION_HELP = "Hub revision of the base model."
JSON_HELP = "Print JSON instead of a table."
RUNTIME_HELP = ("auto (torch where it is installed, MLX on Apple silicon or where only the mlx extra is), torch or "
                "mlx.")  # --backend of the commands that run a model without training it (generate, export, eval)
USAGE_EXIT = 2  # click's and yeto's exit code for a usage or input error
INTERRUPTED_EXIT = 130  # 128 + SIGINT


def trust_remote_code_help(when: str = "") -> str:
    """`--trust-remote-code`'s help; `when` says where it applies (" (with --model)")."""
    return f"Allow the model repo's own code to run{when}."


def runtime(backend: str, what: str) -> str:
    """The backend `what` runs on (yeto.backends.choose_runtime); MLX on Linux gets OpenBLAS preloaded first."""
    from yeto.backends import MLX, choose_runtime

    name = choose_runtime(backend, what)
    if name == MLX:
        from yeto.backends.mlx.compat import reexec_with_fast_blas

        reexec_with_fast_blas()  # (on Linux, once, before MLX loads)
    return name


def run_name_help(default: str) -> str:
    """`--run-name`'s help, for the syncer and the islands alike: `default` says where the name comes from."""
    return f"The run's name, grouping the syncer's and the islands' tracker runs (default: {default})."


def _typers_click() -> Optional[ModuleType]:
    """The copy of click that typer bundles (it runs the commands), or None for a typer that uses click itself."""
    try:
        import typer._click.exceptions
        import typer._click.globals
    except ImportError:
        return None
    return typer._click


def usage_errors() -> tuple[type[Exception], ...]:
    """click's exception classes: click's own and those of the click that typer bundles."""
    import click

    bundled = _typers_click()
    return (click.ClickException, *([bundled.exceptions.ClickException] if bundled else []))


def running_click() -> ModuleType:
    """The click that runs typer's commands: the copy typer bundles, else click itself."""
    import click.exceptions
    import click.globals

    return _typers_click() or click


def _missing_option(flag: str) -> Exception:
    """The usage error click gives a missing required option (its usage line, exit 2), from the click that runs
    the command."""
    running = running_click()
    return running.exceptions.MissingParameter(ctx=running.globals.get_current_context(), param_type="option",
                                               param_hint=f"'{flag}'")


def _aborts() -> tuple[type[BaseException], ...]:
    import click

    bundled = _typers_click()
    bundled_abort = getattr(bundled.exceptions, "Abort", None) if bundled else None  # (not in every typer)
    return tuple(a for a in (click.exceptions.Abort, typer.Abort, bundled_abort) if a is not None)


def run_guarded(typer_app: typer.Typer) -> None:
    """Run `typer_app` on sys.argv; exit 2 with one line on bad input, click's usage text on a usage error."""
    try:
        rc = typer_app(standalone_mode=False)  # click returns an Exit's code instead of raising it here
        if isinstance(rc, int) and rc:
            sys.exit(rc)
    except YetoError as e:
        typer.secho(f"error: {e}", fg="red", err=True)
        sys.exit(USAGE_EXIT)
    except _aborts():
        typer.secho("aborted", err=True)
        sys.exit(INTERRUPTED_EXIT)
    except usage_errors() as e:
        e.show()
        sys.exit(e.exit_code)
    except (typer.Exit, SystemExit) as e:
        sys.exit(getattr(e, "exit_code", getattr(e, "code", 0)))


def click_command(fn: Callable) -> Any:
    """The click command typer makes of the command function `fn` (to parse a command line without running it)."""
    import typer.main

    single = typer.Typer(add_completion=False)
    single.command()(fn)
    return typer.main.get_command(single)


def run_typer(fn: Callable) -> None:
    """Run a single-command typer app (`python -m yeto.backends.torch` and its peers) under `run_guarded`."""
    single = typer.Typer(add_completion=False)
    single.command()(fn)
    run_guarded(single)


def with_help_panels(command: Callable[..., None], advanced: Iterable[str], hidden: Iterable[str] = ()) -> None:
    """Show `command`'s everyday flags first: the `advanced` ones (research and tuning knobs) go in a panel of their
    own after them, and the `hidden` ones (test hooks) are left out of --help but keep working. A switch that is off
    by default is shown as `--name` alone."""
    advanced, hidden = set(advanced), set(hidden)
    signature = inspect.signature(command, eval_str=True)  # (evaluated once: the options edited are the ones used)
    unknown = (advanced | hidden) - set(signature.parameters)
    if unknown:
        raise ValueError(f"no such flags on {command.__name__}: {sorted(unknown)}")
    for p in signature.parameters.values():
        for option in getattr(p.annotation, "__metadata__", ()):
            if isinstance(option, typer.models.OptionInfo):
                option.rich_help_panel = ADVANCED_PANEL if p.name in advanced else option.rich_help_panel
                option.hidden = option.hidden or p.name in hidden
                if p.default is False and not option.param_decls and option.default in (False, ...):
                    # a switch that is off unless given is just `--name`: no `--no-name` twin, no default row
                    option.param_decls = ("--" + p.name.replace("_", "-"),)
                    option.show_default = False
    command.__signature__ = signature  # type: ignore[attr-defined]


@dataclass(frozen=True)
class OldSpelling:
    """A renamed flag's old spelling: it keeps working (hidden from --help) so existing commands and scripts do, and
    feeds the parameter `param` of the new flag through `convert` (e.g. milliseconds to seconds)."""
    flag: str  # "--grace-ms"
    param: str  # the command's parameter it feeds: "grace_s" (given as --grace)
    convert: Callable[[Any], Any] = lambda value: value


def flag_of(parameter: inspect.Parameter) -> str:
    """The flag a command's parameter is given as: its option's own name, else --the-parameter-name."""
    for option in getattr(parameter.annotation, "__metadata__", ()):
        if isinstance(option, typer.models.OptionInfo):
            # typer reads Annotated[..., typer.Option("--name")]'s first argument as the flag's name
            names = [*option.param_decls, *([option.default] if isinstance(option.default, str) else [])]
            for name in names:
                if name.startswith("--"):
                    return name
    return "--" + parameter.name.replace("_", "-")


def with_old_spellings(command: Callable[..., None], olds: Iterable[OldSpelling]) -> Callable[..., None]:
    """`command` with each old spelling as a hidden flag; giving both spellings of one flag is a one-line error. A
    required flag stays required: either spelling gives it."""
    olds = tuple(olds)
    signature = inspect.signature(command, eval_str=True)
    required = {old.param for old in olds if signature.parameters[old.param].default is inspect.Parameter.empty}
    params = [p.replace(default=None) if p.name in required else p for p in signature.parameters.values()]
    extra = []
    for i, old in enumerate(olds):
        target = signature.parameters[old.param]
        base = typing.get_args(target.annotation)[0]
        extra.append(inspect.Parameter(f"old_spelling_{i}", inspect.Parameter.KEYWORD_ONLY, default=None,
                                       annotation=Annotated[Optional[base], typer.Option(old.flag, hidden=True)]))

    @functools.wraps(command)
    def wrapper(**kwargs: Any) -> None:
        for i, old in enumerate(olds):
            value = kwargs.pop(f"old_spelling_{i}")
            if value is None:
                continue
            target = signature.parameters[old.param]
            if kwargs[old.param] != (None if old.param in required else target.default):
                raise YetoError(f"{old.flag} is the old spelling of {flag_of(target)}: give one of them")
            kwargs[old.param] = old.convert(value)
        for name in required:
            if kwargs[name] is None:
                raise _missing_option(flag_of(signature.parameters[name]))
        return command(**kwargs)

    wrapper.__signature__ = signature.replace(parameters=[*params, *extra])  # type: ignore
    return wrapper
