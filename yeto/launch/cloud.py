"""The thin shell between the fleet controller and SkyPilot's client SDK.

`SkyClient` is the handful of SkyPilot calls the fleet needs; `SkyPilotClient` makes them with SkyPilot's SDK
(requests awaited with `sky.get` / `sky.stream_and_get`, as SDK 0.10+ requires), and tests hand `watch_fleet` a
fake that preempts and fails clusters on a script. `watch_fleet` runs the controller: launches happen on worker
threads (a launch blocks for minutes), everything else in one loop.
"""

from __future__ import annotations

import io
import queue
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional, Protocol

from yeto import one_line
from yeto.launch.skypilot import import_sky
from yeto.launch.controller import FAILED_JOBS, ClusterView, Down, FleetController, GiveUp, Launch, Note
from yeto.launch.tasks import IslandExit, island_exit

POLL_S = 30.0  # how often the controller asks SkyPilot for the island clusters' state
LOOP_S = 0.5  # how often it looks for finished launches and the run's end
AUTODOWN_IDLE_MINUTES = 10  # an island cluster idle this long (its job ended, nobody relaunched it) tears itself down
FINISH_WAIT_S = 900.0  # after the run ends, wait at most this long for launches in flight (autodown covers the rest)
EXIT_LOG_LINES = 40  # of a failed island job's log: enough for its error line and the exit code after it


class SkyClient(Protocol):
    def launch(self, task: Any, cluster: str, retry_until_up: bool) -> None: ...
    def clusters(self, names: list[str]) -> dict[str, ClusterView]: ...
    def down(self, cluster: str) -> None: ...
    def head_address(self, cluster: str, port: int) -> str: ...


class SkyPilotClient:
    """SkyClient over SkyPilot's SDK (talks to the SkyPilot API server the environment points at)."""

    def __init__(self) -> None:
        self.sky = import_sky()

    def launch(self, task: Any, cluster: str, retry_until_up: bool) -> None:
        """Provision and start an island; it downs itself once idle, so a cluster nobody watches anymore (the
        controller gone, a relaunch that raced `yeto down`) does not bill for long."""
        self.sky.stream_and_get(self.sky.launch(task, cluster_name=cluster, retry_until_up=retry_until_up,
                                                idle_minutes_to_autostop=AUTODOWN_IDLE_MINUTES, down=True))

    def launch_head(self, task: Any, cluster: str, retry_until_up: bool) -> None:
        """The head stays up when idle: it holds the run's result until delivered (then it downs itself)."""
        self.sky.stream_and_get(self.sky.launch(task, cluster_name=cluster, retry_until_up=retry_until_up))

    def clusters(self, names: Optional[list[str]]) -> dict[str, ClusterView]:
        """Clusters by name (None: every cluster this user has); a cluster SkyPilot does not list is gone."""
        records = self.sky.get(self.sky.status(cluster_names=names, refresh=self.sky.StatusRefreshMode.AUTO))
        views = {}
        for r in records:
            job, ended = None, IslandExit(None, "")
            if str(r["status"].value) == "UP":
                try:
                    statuses = self.sky.get(self.sky.job_status(r["name"], job_ids=None))
                    known = [k for k in statuses if k is not None]
                    latest = statuses.get(max(known)) if known else None
                    job = latest.value if latest is not None else None
                except Exception:  # preempted between the two calls (ClusterNotUpError...): its status says enough
                    job = None
                if job in FAILED_JOBS:
                    ended = self.job_exit(r["name"], max(known))
            views[r["name"]] = ClusterView(str(r["status"].value), job, ended.code, ended.error)
        return views

    def job_exit(self, cluster: str, job_id: int) -> IslandExit:
        """How a failed island job ended, from its log's tail (SkyPilot keeps no exit code of its own)."""
        tail = io.StringIO()
        try:
            self.sky.tail_logs(cluster, job_id, follow=False, tail=EXIT_LOG_LINES, output_stream=tail)
        except Exception:  # gone meanwhile, or logs unreachable: an ordinary failure (relaunched)
            return IslandExit(None, "")
        return island_exit(tail.getvalue())

    def down(self, cluster: str) -> None:
        try:
            self.sky.get(self.sky.down(cluster))
        except self.sky.exceptions.ClusterDoesNotExist:
            pass  # already gone (preempted and cleaned up): nothing to tear down

    def head_address(self, cluster: str, port: int) -> str:
        return self.sky.get(self.sky.endpoints(cluster, port))[port]


@dataclass(frozen=True)
class LaunchResult:
    island: int
    ok: bool
    error: str = ""


def _spawn_thread(fn: Callable[[], None]) -> None:
    threading.Thread(target=fn, daemon=True).start()


def watch_fleet(ctl: FleetController, client: SkyClient, task_for: Callable[[int], Any], retry_until_up: bool,
                run_over: Callable[[], bool], give_up: Callable[[int, str], None], note: Callable[[str, dict], None],
                clock: Callable[[], float] = time.monotonic, sleep: Callable[[float], None] = time.sleep,
                spawn: Callable[[Callable[[], None]], None] = _spawn_thread, poll_s: float = POLL_S) -> None:
    """Run the controller until the run is over and every island cluster is down (or given up). Launches run
    through `spawn` (a thread each: one blocks for minutes); tests pass a synchronous spawn and a fake clock. A
    teardown that fails is retried every poll, and a cluster whose teardown failed is not relaunched over."""
    FleetWatch(ctl, client, task_for, retry_until_up, give_up, note, clock, spawn).run(run_over, sleep, poll_s)


class FleetWatch:
    """The controller's shell: it executes the controller's actions against SkyPilot and feeds it what happened."""

    def __init__(self, ctl: FleetController, client: SkyClient, task_for: Callable[[int], Any], retry_until_up: bool,
                 give_up: Callable[[int, str], None], note: Callable[[str, dict], None], clock: Callable[[], float],
                 spawn: Callable[[Callable[[], None]], None]):
        self.ctl, self.client, self.task_for, self.retry_until_up = ctl, client, task_for, retry_until_up
        self.give_up, self.note, self.clock, self.spawn = give_up, note, clock, spawn
        self.results: queue.Queue[LaunchResult] = queue.Queue()
        self.in_flight: set[int] = set()
        self.to_down: set[str] = set()  # teardowns that failed: retried every poll

    def run(self, run_over: Callable[[], bool], sleep: Callable[[float], None], poll_s: float) -> None:
        self.execute(self.ctl.start(self.clock()))
        next_poll = self.clock() + poll_s
        finished_at: Optional[float] = None
        while True:
            self.take_results()
            if finished_at is None and self.guarded("run_over", run_over, False):
                finished_at = self.clock()
                self.execute(self.ctl.run_finished(self.clock()))
            if finished_at is not None and self.settled(finished_at):
                return
            if self.clock() >= next_poll:
                next_poll = self.clock() + poll_s
                self.poll()
            sleep(LOOP_S)

    def take_results(self) -> None:
        while not self.results.empty():
            r = self.results.get()
            self.in_flight.discard(r.island)
            self.execute(self.ctl.launched(r.island, r.ok, self.clock(), r.error))

    def settled(self, finished_at: float) -> bool:
        """After the run: every cluster down, or FINISH_WAIT_S gone (the clusters' own autodown ends them once idle)."""
        done = self.ctl.settled and not self.to_down
        if not done and self.clock() - finished_at <= FINISH_WAIT_S:
            return False
        if not done:
            self.note("left_behind", {"launching": sorted(self.in_flight), "not_torn_down": sorted(self.to_down),
                                      "autodown_idle_minutes": AUTODOWN_IDLE_MINUTES})
        return True

    def poll(self) -> None:
        for cluster in sorted(self.to_down):
            self.down(cluster)
        views = self.guarded("status", lambda: self.client.clusters([i.cluster for i in self.ctl.islands.values()]))
        if views is not None:
            self.execute(self.ctl.observe(views, self.clock()))

    def execute(self, actions: list) -> None:
        for a in actions:
            if isinstance(a, Launch):
                self.in_flight.add(a.island)
                if a.cluster in self.to_down:  # SkyPilot would reuse the old cluster: two islands with one id
                    self.results.put(LaunchResult(a.island, False, "the old cluster could not be torn down yet"))
                else:
                    self.spawn(lambda a=a: self.launch(a))
            elif isinstance(a, Down):
                self.down(a.cluster)
            elif isinstance(a, GiveUp):
                self.guarded("give_up", lambda a=a: self.give_up(a.island, a.reason))
            elif isinstance(a, Note):
                self.guarded("note", lambda a=a: self.note(a.event, a.fields))

    def launch(self, a: Launch) -> None:
        try:
            self.client.launch(self.task_for(a.island), a.cluster, self.retry_until_up)
            self.results.put(LaunchResult(a.island, True))
        except Exception as e:  # SkyPilot's many failure types all mean the same here: not up, try again later
            self.results.put(LaunchResult(a.island, False, one_line(e)))

    def down(self, cluster: str) -> bool:
        try:
            self.client.down(cluster)
            self.to_down.discard(cluster)
            return True
        except Exception as e:
            self.to_down.add(cluster)
            self.note("down_failed", {"cluster": cluster, "error": one_line(e)})
            return False

    def guarded(self, what: str, fn: Callable[[], Any], default: Any = None) -> Any:
        try:
            return fn()
        except Exception as e:  # the controller outlives a failing callback: the next poll tries again
            self.note(f"{what}_failed", {"error": one_line(e)})
            return default
