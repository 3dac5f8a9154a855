"""The head's flags (`python -m yeto.launch`, started by `yeto launch` on the head VM, not by hand)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated, Optional

import typer

from yeto import YetoError
from yeto.launch.cloud import SkyPilotClient
from yeto.launch.head import run_head, run_remote_controller
from yeto.launch.plan import FleetPlan
from yeto.launch.tasks import API_ENDPOINT_ENV, HEAD_RUN_DIR


def head_command(
    plan: Annotated[str, typer.Option(help="The fleet plan `yeto launch` wrote.")],
    out: Annotated[str, typer.Option(help="The head's run directory (syncer/ and fleet.jsonl).")] = HEAD_RUN_DIR,
    no_syncer: Annotated[bool, typer.Option(help="Run the fleet controller only (the syncer is on the head VM).")
                         ] = False,
    syncer_address: Annotated[Optional[str], typer.Option(help="HOST:PORT islands connect to (default: asked of "
                                                               "SkyPilot for the head cluster).")] = None,
) -> None:
    """The head of a cloud run (started by `yeto launch`, not by hand)."""
    fleet = FleetPlan.from_json(Path(plan).expanduser().read_text())
    if no_syncer:
        if syncer_address is None:
            raise YetoError("--no-syncer needs --syncer-address HOST:PORT (the head's)")
        raise typer.Exit(run_remote_controller(fleet, Path(out).expanduser(), SkyPilotClient(), syncer_address))
    controller = API_ENDPOINT_ENV in os.environ  # (else the launching machine runs it)
    raise typer.Exit(run_head(fleet, Path(out).expanduser(), SkyPilotClient() if controller else None,
                              syncer_address=syncer_address))
