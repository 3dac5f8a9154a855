"""The head of a cloud run: `python -m yeto.launch` on the head VM (syncer + fleet controller), or, with
--no-syncer, the fleet controller alone on the launching machine (when the SkyPilot API server it uses is local
to it, the head VM cannot reach it).

The syncer is a child process (`yeto.sync.shell.server`) bound to the public port; the controller keeps the island
clusters alive through SkyPilot (`yeto.launch.cloud.watch_fleet`) and hands an island it gives up to the syncer
(`yeto.sync.shell.given_up`). When the syncer ends, every island cluster goes down, the result is delivered to
--output, and on a clean, confirmed finish the head tears itself down.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, Optional


from yeto import YetoError, one_line
from yeto.launch.cloud import POLL_S, SkyClient, watch_fleet
from yeto.launch.controller import FleetController
from yeto.launch.output import deliver
from yeto.launch.plan import FleetPlan
from yeto.launch.registry import SYNCER_DIR
from yeto.launch.tasks import HEAD_KEYS_ENV, HEAD_RUN_DIR, island_task, syncer_argv
from yeto.sync.shell.keys import Keyring
from yeto.sync.shell.given_up import GIVEN_UP_DIR, give_up

FLEET_TAPE = "fleet.jsonl"  # the controller's own record: launches, losses, relaunches, give-ups
HEAD_JOB_OVER = frozenset({"SUCCEEDED", "FAILED", "FAILED_SETUP", "FAILED_DRIVER", "CANCELLED", "GONE"})


def fleet_note(out: Path):
    def note(event: str, fields: dict) -> None:
        line = json.dumps({"time": round(time.time(), 3), "event": event, **fields})
        with open(out / FLEET_TAPE, "a") as f:
            f.write(line + "\n")
        print(f"fleet: {event} {fields}", flush=True)
    return note


def start_syncer(plan: FleetPlan, syncer_out: Path) -> subprocess.Popen:
    return subprocess.Popen(syncer_argv(plan, "0.0.0.0", plan.port, syncer_out, sys.executable))


def keep_fleet(plan: FleetPlan, client: SkyClient, address: str, keys: Keyring, run_over: Callable[[], bool],
               give_up_fn: Callable[[int, str], None], note: Callable[[str, dict], None], poll_s: float) -> None:
    """The fleet controller over SkyPilot until the run is over and its island clusters are down; each island
    is launched with its own key (trusted)."""
    ctl = FleetController({lid: plan.cluster(lid) for lid in range(len(plan.islands))}, plan.recover_timeout)
    watch_fleet(ctl, client, lambda lid: island_task(plan, lid, address, keys.own_key(lid).text()),
                plan.retry_until_up, run_over, give_up_fn, note, poll_s=poll_s)


def run_head(plan: FleetPlan, out: Path, client: Optional[SkyClient] = None, poll_s: float = POLL_S,
             syncer_address: Optional[str] = None) -> int:
    """The head VM: the syncer, and with a `client` (SkyPilot, or a test's fake cloud) the fleet controller; at the
    end the output is delivered and, confirmed, the head tears itself down. Returns the syncer's exit code, or 1
    when the output could not be delivered (the head then stays up: the adapter is on its disk)."""
    out.mkdir(parents=True, exist_ok=True)
    syncer_out = out / SYNCER_DIR
    note = fleet_note(out)
    keys = Keyring.restore(syncer_out, os.environ.pop(HEAD_KEYS_ENV)) if HEAD_KEYS_ENV in os.environ \
        else Keyring.ensure(syncer_out)
    syncer = start_syncer(plan, syncer_out)
    if client is not None and plan.islands:
        try:
            address = syncer_address or client.head_address(plan.head_cluster, plan.port)
        except Exception as e:  # the syncer runs on, but nobody launches islands: say so, loudly
            note("controller_failed", {"error": f"cannot learn the head's address from SkyPilot: {one_line(e)}"})
        else:
            keep_fleet(plan, client, address, keys, lambda: syncer.poll() is not None,
                       lambda lid, why: give_up(syncer_out, lid, why), note, poll_s)
    code = syncer.wait()
    note("syncer_exit", {"code": code})
    if code == 0 and plan.output:
        try:
            note("delivered", {"output": deliver(syncer_out, plan.output)})
        except YetoError as e:
            note("delivery_failed", {"error": str(e)})
            return 1
        if client is not None:
            note("head_down", {"cluster": plan.head_cluster})
            client.down(plan.head_cluster)
    return code


def run_remote_controller(plan: FleetPlan, out: Path, client: SkyClient, syncer_address: str,
                          poll_s: float = POLL_S) -> int:
    """The fleet controller on the launching machine, for a head that cannot reach the SkyPilot API server: the
    head's job ending is the run ending; a give-up is written into the head's given-up/ folder through SkyPilot."""
    import sky

    note = fleet_note(out)
    head_job: list[Optional[str]] = [None]

    def head_over() -> bool:
        view = client.clusters([plan.head_cluster]).get(plan.head_cluster)
        head_job[0] = view.job if view is not None else "GONE"
        return head_job[0] in HEAD_JOB_OVER

    def relay_give_up(island: int, reason: str) -> None:  # atomically, as give_up does
        folder = f"{HEAD_RUN_DIR}/syncer/{GIVEN_UP_DIR}"
        run = (f"mkdir -p {folder} && printf %s {shlex.quote(reason)} > {folder}/{island}.tmp && "
               f"mv {folder}/{island}.tmp {folder}/{island}")
        sky.get(sky.exec(sky.Task(run=run), cluster_name=plan.head_cluster))

    keep_fleet(plan, client, syncer_address, Keyring.ensure(out / SYNCER_DIR), head_over, relay_give_up, note,
               poll_s)
    if head_job[0] == "SUCCEEDED" and plan.output:  # the head exits 0 only with its output delivered and confirmed
        note("head_down", {"cluster": plan.head_cluster})
        client.down(plan.head_cluster)
    return 0
