"""`yeto status`, `yeto logs`, `yeto down`: a launched run, found in the registry by its name or its directory
(`yeto.launch.registry.launched_run`).

A local run (this machine is the head) is read from its directory: processes, logs, the syncer's tape. A cloud
run is asked of SkyPilot (clusters, cost) and of its head (the tape, over SkyPilot's ssh alias for the cluster).
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

from yeto import YetoError, one_line
from yeto.launch.registry import SYNCER_DIR, RunRecord
from yeto.launch.registry import process_alive as _alive
from yeto.launch.tasks import HEAD_RUN_DIR
from yeto.sync.shell.tape import TAPE_FILE, read_tape

SSH_TIMEOUT_S = 20.0  # copying the head's tape over ssh: an unreachable head is reported, not waited on
DOWN_GRACE_S = 30.0  # a local fleet asked to stop has this long before its processes are killed
FOLLOW_POLL_S = 0.5  # how often `yeto logs` looks for new lines (a person reading, not a program)
CLOCK_SLACK_S = 60.0  # a cluster launched this long before the run's record was written is still the run's


# an island's state, in the one vocabulary `yeto status` and the dashboard share (the dashboard adds "late")
ALIVE, DONE, GONE, GIVEN_UP, NOT_JOINED = "alive", "done", "gone", "given up", "not joined"


@dataclass
class IslandRow:
    island: int
    backend: str = "?"
    tier: str = "?"  # how far the syncer believes its claims (trusted: its own key; bounded or extra: the join key)
    alive: bool = False
    answered: int = 0  # merges its delta went into
    last_delta_round: Optional[int] = None
    given_up: bool = False  # in the syncer's latest session, and not back since
    given_up_reason: str = ""  # the fleet controller's, as the syncer's tape records it

    def state(self, finished: bool) -> str:
        """Its state in words: an island that left a finished run is done; one that left a run going on is gone."""
        if self.given_up:
            return GIVEN_UP
        if self.alive:
            return ALIVE
        if self.backend == "?":
            return NOT_JOINED
        return DONE if finished else GONE


@dataclass
class FleetView:
    """The run as its tape tells it."""

    islands: dict[int, IslandRow] = field(default_factory=dict)
    version: int = 0
    outer_steps: Optional[int] = None
    last_merge: Optional[dict[str, Any]] = None
    finished: Optional[str] = None


def fleet_view(events: list[dict[str, Any]]) -> FleetView:
    """The run as its tape tells it, as of the syncer's latest session: a restart applies its give-ups again, and an
    island back after its give-up (`given_up_cleared`) is counted on again."""
    view = FleetView()

    def row(lid: int) -> IslandRow:
        return view.islands.setdefault(lid, IslandRow(lid))

    for e in events:
        kind, lid = e.get("event"), e.get("island")
        if kind == "start":
            view.outer_steps = (e.get("config") or {}).get("outer_steps", view.outer_steps)
            view.finished = None
            for r in view.islands.values():
                r.given_up, r.given_up_reason = False, ""
        elif kind == "join" and isinstance(lid, int):
            row(lid).alive, row(lid).backend, row(lid).tier = True, e.get("backend") or "?", e.get("tier") or "?"
        elif kind == "given_up_cleared" and isinstance(lid, int):
            row(lid).given_up, row(lid).given_up_reason = False, ""
        elif kind == "leave" and isinstance(lid, int):
            row(lid).alive = False
        elif kind == "given_up" and isinstance(lid, int):
            row(lid).given_up, row(lid).given_up_reason = True, str(e.get("reason") or "")
        elif kind == "delta" and isinstance(lid, int):
            row(lid).last_delta_round = e.get("round")
        elif kind == "merge":
            view.version, view.last_merge = e.get("version", view.version), e
            for r in e.get("responders", []):
                row(r).answered += 1
        elif kind == "finish":
            view.finished = e.get("reason") or "finished"
    return view


def _pids(run: RunRecord) -> list[tuple[int, Optional[float]]]:
    """The local run's processes, the launcher first, each with its recorded start time."""
    pids = [run.launcher_pid, *run.processes.values()]
    return [(p, run.started.get(str(p))) for p in pids if p]


def _head_tape(run: RunRecord) -> tuple[list[dict[str, Any]], str]:
    """The cloud head's tape, copied over ssh (SkyPilot writes an ssh alias per cluster)."""
    local = Path(run.out) / f"head-{TAPE_FILE}"
    try:
        got = subprocess.run(["ssh", "-o", "BatchMode=yes", run.head_cluster or "", "cat",
                              f"{HEAD_RUN_DIR}/syncer/{TAPE_FILE}"], capture_output=True, timeout=SSH_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired) as e:
        return [], f"the head's tape is unreachable ({type(e).__name__})"
    if got.returncode != 0:
        return [], f"the head's tape is unreachable (ssh {run.head_cluster}: {got.stderr.decode()[:200].strip()})"
    local.write_bytes(got.stdout)
    return read_tape(local), ""


def status(run: RunRecord, console) -> None:
    from rich.table import Table

    console.print(f"[bold]run {run.name}[/bold] ({run.kind}) syncer {run.syncer}, dir {run.out}, started "
                  f"{time.strftime('%Y-%m-%d %H:%M', time.localtime(run.created))}")
    if run.kind == "local":
        procs = Table(title="processes")
        for col in ("process", "pid", "state"):
            procs.add_column(col)
        for name, pid in run.processes.items():
            procs.add_row(name, str(pid), "running" if _alive(pid, run.started.get(str(pid))) else "exited")
        console.print(procs)
        tape = Path(run.out) / SYNCER_DIR / TAPE_FILE
        events, why = (read_tape(tape), "") if tape.exists() else ([], "no tape yet")
    else:
        _cloud_status(run, console)
        events, why = _head_tape(run)
    if why:
        console.print(f"[yellow]{why}[/yellow]")
        return
    view = fleet_view(events)
    table = Table(title=f"islands (version {view.version}/{view.outer_steps or '?'})")
    for col in ("island", "slot", "backend", "tier", "state", "merges answered", "last delta (round)"):
        table.add_column(col)
    for lid in sorted(set(view.islands) | set(run.external)):
        r = view.islands.get(lid, IslandRow(lid))
        table.add_row(str(lid), "external" if lid in run.external else run.kind, r.backend, r.tier,
                      r.state(view.finished is not None),
                      str(r.answered),
                      "-" if r.last_delta_round is None else str(r.last_delta_round))
    console.print(table)
    for r in sorted(view.islands.values(), key=lambda r: r.island):
        if r.given_up:
            console.print(f"island {r.island} given up: {r.given_up_reason or 'no reason recorded'}",
                          markup=False, highlight=False)
    m = view.last_merge
    if m is not None:
        age = time.time() - m["time"] if isinstance(m.get("time"), (int, float)) else None
        console.print(f"last merge: round {m.get('round')} -> version {m.get('version')}, responders "
                      f"{m.get('responders')}" + (f", {age:.0f}s ago" if age is not None else ""))
    if view.finished:
        console.print(f"finished: {view.finished}")


def _cloud_status(run: RunRecord, console) -> None:
    from rich.table import Table

    from yeto.launch.cloud import SkyPilotClient

    names = cluster_names(run)
    try:
        client = SkyPilotClient()
        views = client.clusters(names)
        costs = cloud_costs(run, client)
    except YetoError:
        raise
    except Exception as e:  # the API server's errors are many; any means the same here
        console.print(f"[yellow]SkyPilot unreachable ({one_line(e)}); showing the run's tape only[/yellow]")
        return
    table = Table(title="clusters")
    for col in ("cluster", "status", "island job", "cost so far ($)"):
        table.add_column(col)
    for name in names:
        v = views.get(name)
        table.add_row(name, v.status if v else "GONE", (v.job or "-") if v else "-",
                      f"{costs[name]:.2f}" if name in costs else "-")
    console.print(table)
    console.print(f"cost so far: ${sum(costs.values()):.2f}")


def cluster_names(run: RunRecord) -> list[str]:
    return [run.head_cluster or "", *run.island_clusters.values()]


def cloud_costs(run: RunRecord, client) -> dict[str, float]:
    """Each of the run's clusters' cost so far ($), from SkyPilot's cost report: one entry per launch of a cluster
    (relaunches too), this run's only. `client`: a `yeto.launch.cloud.SkyPilotClient`."""
    names = cluster_names(run)
    costs: dict[str, float] = {}
    for c in client.sky.get(client.sky.cost_report()):
        if c.get("name") in names and (c.get("launched_at") or 0) >= run.created - CLOCK_SLACK_S:
            costs[c["name"]] = costs.get(c["name"], 0.0) + float(c.get("total_cost") or 0.0)
    return costs


def logs(run: RunRecord, island: Optional[int], follow: bool, out=None) -> None:
    """Print (and follow) the syncer's log, or island I's."""
    if run.kind == "cloud":
        import sky

        cluster = run.head_cluster if island is None else run.island_clusters.get(str(island))
        if cluster is None:
            raise YetoError(f"run {run.name} has no cloud island {island} (external slots log on their machine)")
        sky.tail_logs(cluster, job_id=None, follow=follow)
        return
    name = "syncer" if island is None else next((n for n in run.logs if n.split("-")[:2] == ["island", str(island)]),
                                                 None)
    if name is None or name not in run.logs:
        raise YetoError(f"run {run.name} has no local island {island} (its logs: {', '.join(run.logs)})")
    launcher = run.launcher_pid, run.started.get(str(run.launcher_pid))
    _follow(Path(run.logs[name]), lambda: follow and _alive(*launcher), out)


def _follow(path: Path, more_to_come: Callable[[], bool], out=None) -> None:
    """Print the file, then what is appended to it while `more_to_come()`."""
    import sys

    out = out or sys.stdout
    with open(path) as f:
        while True:
            line = f.readline()
            if line:
                out.write(line)
                continue
            if not more_to_come():
                return
            out.flush()
            time.sleep(FOLLOW_POLL_S)


def down(run: RunRecord, console) -> int:
    """Stop the run: a local fleet through its launcher (as Ctrl-C would), a cloud run's every cluster."""
    if run.kind == "local":
        return _down_local(run, console)
    from yeto.launch.cloud import SkyPilotClient

    client = SkyPilotClient()
    # the head first: its controller would relaunch islands torn down under it
    controller = run.processes.get("controller")
    if _alive(controller, run.started.get(str(controller))):
        os.kill(controller, signal.SIGTERM)
    failed = []
    for name in [run.head_cluster or "", *_island_clusters(run, client)]:
        if name:
            console.print(f"tearing down {name} ...")
            try:
                client.down(name)
            except Exception as e:  # one failure must not leave the rest up
                failed.append(f"{name} ({one_line(e)})")
    run.state = "down"
    run.save()
    if failed:
        console.print(f"[red]could not tear down: {'; '.join(failed)}; run `yeto down {run.name}` again, or "
                      "`sky down` them[/red]")
        return 1
    console.print(f"run {run.name}: every cluster is down (island clusters also down themselves when idle)")
    return 0


def _island_clusters(run: RunRecord, client) -> list[str]:
    """The recorded island clusters and any other of the run's (a relaunch that raced this teardown)."""
    names = set(run.island_clusters.values())
    try:
        names |= {n for n in client.clusters(None) if n.startswith(f"{run.name}-island-")}
    except Exception:  # the recorded ones are torn down anyway; autodown ends a straggler
        pass
    return sorted(names)


def _down_local(run: RunRecord, console) -> int:
    if run.state != "running" or not any(_alive(*p) for p in _pids(run)):
        console.print(f"run {run.name} is not running ({run.state})")
        return 0
    launcher = run.launcher_pid, run.started.get(str(run.launcher_pid))
    for pid, started in [launcher] if _alive(*launcher) else _pids(run):
        if _alive(pid, started):
            os.kill(pid, signal.SIGINT)
    deadline = time.monotonic() + DOWN_GRACE_S
    while time.monotonic() < deadline and any(_alive(*p) for p in _pids(run)):
        time.sleep(FOLLOW_POLL_S)
    left = [pid for pid, started in _pids(run) if _alive(pid, started)]
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    run.state = "down"
    run.save()
    console.print(f"run {run.name} stopped" + (f" ({len(left)} process(es) killed)" if left else ""))
    return 0
