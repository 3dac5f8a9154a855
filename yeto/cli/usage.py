"""Running a typer command so that a person's mistake costs one line, never a traceback.

A usage error (unknown flag, bad value, missing option) is click's usual few lines and exit 2; a `YetoError`
(bad input found by yeto's own checks) is one `error: ...` line and exit 2. typer 0.26+ bundles its own copy of
click and raises that copy's exceptions, so both copies' classes are caught here.
"""

from __future__ import annotations

import inspect
import sys
from typing import Callable, Iterable

import typer

from yeto import YetoError

ADVANCED_PANEL = "Advanced (defaults need no touching)"
USAGE_EXIT = 2  # click's and yeto's exit code for a usage or input error
INTERRUPTED_EXIT = 130  # 128 + SIGINT


def usage_errors() -> tuple[type[Exception], ...]:
    """click's exception classes: click's own and those of the click that typer bundles."""
    import click

    errors: list[type[Exception]] = [click.ClickException]
    try:
        from typer._click.exceptions import ClickException
    except ImportError:  # a typer that uses click itself
        return tuple(errors)
    return (*errors, ClickException)


def _aborts() -> tuple[type[BaseException], ...]:
    import click

    aborts: list[type[BaseException]] = [click.exceptions.Abort, typer.Abort]
    try:
        from typer._click.exceptions import Abort
        aborts.append(Abort)
    except ImportError:
        pass
    return tuple(aborts)


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


def run_typer(fn: Callable) -> None:
    """Run a single-command typer app (`python -m yeto.backends.torch` and its peers) under `run_guarded`."""
    single = typer.Typer(add_completion=False)
    single.command()(fn)
    run_guarded(single)


def with_help_panels(command: Callable[..., None], advanced: Iterable[str], hidden: Iterable[str] = ()) -> None:
    """Show `command`'s everyday flags first: the `advanced` ones (research and tuning knobs) go in a panel of their
    own after them, and the `hidden` ones (test hooks) are left out of --help but keep working."""
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
    command.__signature__ = signature  # type: ignore[attr-defined]
