"""Running a typer command so that a person's mistake costs one line, never a traceback.

A usage error (unknown flag, bad value, missing option) is click's usual few lines and exit 2; a `YetoError`
(bad input found by yeto's own checks) is one `error: ...` line and exit 2. typer 0.26+ bundles its own copy of
click and raises that copy's exceptions, so both copies' classes are caught here.
"""

from __future__ import annotations

import sys
from typing import Callable

import typer

from yeto import YetoError

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
    """Run a single-command typer app (`python -m yeto.learner` and its peers) under `run_guarded`."""
    single = typer.Typer(add_completion=False)
    single.command()(fn)
    run_guarded(single)
