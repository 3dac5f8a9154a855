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
from yeto.launch.tasks import LearnerExit, learner_exit

POLL_S = 30.0  # how often the controller asks SkyPilot for the learner clusters' state
LOOP_S = 0.5  # how often it looks for finished launches and the run's end
AUTODOWN_IDLE_MINUTES = 10  # a learner cluster idle this long (its job ended, nobody relaunched it) tears itself down
FINISH_WAIT_S = 900.0  # after the run ends, wait at most this long for launches in flight (autodown covers the rest)
EXIT_LOG_LINES = 40  # of a failed learner job's log: enough for its error line and the exit code after it


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
        """Provision and start a learner; it downs itself once idle, so a cluster nobody watches anymore (the
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
            job, ended = None, LearnerExit(None, "")
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

    def job_exit(self, cluster: str, job_id: int) -> LearnerExit:
        """How a failed learner job ended, from its log's tail (SkyPilot keeps no exit code of its own)."""
        tail = io.StringIO()
        try:
            self.sky.tail_logs(cluster, job_id, follow=False, tail=EXIT_LOG_LINES, output_stream=tail)
        except Exception:  # gone meanwhile, or logs unreachable: an ordinary failure (relaunched)
            return LearnerExit(None, "")
        return learner_exit(tail.getvalue())

    def down(self, cluster: str) -> None:
        try:
            self.sky.get(self.sky.down(cluster))
        except self.sky.exceptions.ClusterDoesNotExist:
            pass  # already gone (preempted and cleaned up): nothing to tear down

    def head_address(self, cluster: str, port: int) -> str:
        return self.sky.get(self.sky.endpoints(cluster, port))[port]


@dataclass(frozen=True)
class LaunchResult:
    learner: int
    ok: bool
    error: str = ""


def _spawn_thread(fn: Callable[[], None]) -> None:
    threading.Thread(target=fn, daemon=True).start()


def watch_fleet(ctl: FleetController, client: SkyClient, task_for: Callable[[int], Any], retry_until_up: bool,
                run_over: Callable[[], bool], give_up: Callable[[int, str], None], note: Callable[[str, dict], None],
                clock: Callable[[], float] = time.monotonic, sleep: Callable[[float], None] = time.sleep,
                spawn: Callable[[Callable[[], None]], None] = _spawn_thread, poll_s: float = POLL_S) -> None:
    """Run the controller until the run is over and every learner cluster is down (or given up). Launches run
    through `spawn` (a thread each: one blocks for minutes); tests pass a synchronous spawn and a fake clock. A
    teardown that fails is retried every poll, and a cluster whose teardown failed is not relaunched over."""
    results: queue.Queue[LaunchResult] = queue.Queue()
    in_flight: set[int] = set()
    to_down: set[str] = set()  # teardowns that failed: retried every poll

    def launch(a: Launch) -> None:
        try:
            client.launch(task_for(a.learner), a.cluster, retry_until_up)
            results.put(LaunchResult(a.learner, True))
        except Exception as e:  # SkyPilot's many failure types all mean the same here: not up, try again later
            results.put(LaunchResult(a.learner, False, one_line(e)))

    def down(cluster: str) -> bool:
        try:
            client.down(cluster)
            to_down.discard(cluster)
            return True
        except Exception as e:
            to_down.add(cluster)
            note("down_failed", {"cluster": cluster, "error": one_line(e)})
            return False

    def guarded(what: str, fn: Callable[[], Any], default: Any = None) -> Any:
        try:
            return fn()
        except Exception as e:  # the controller outlives a failing callback: the next poll tries again
            note(f"{what}_failed", {"error": one_line(e)})
            return default

    def execute(actions: list) -> None:
        for a in actions:
            if isinstance(a, Launch):
                in_flight.add(a.learner)
                if a.cluster in to_down:  # SkyPilot would reuse the old cluster: two learners with one id
                    results.put(LaunchResult(a.learner, False, "the old cluster could not be torn down yet"))
                else:
                    spawn(lambda a=a: launch(a))
            elif isinstance(a, Down):
                down(a.cluster)
            elif isinstance(a, GiveUp):
                guarded("give_up", lambda a=a: give_up(a.learner, a.reason))
            elif isinstance(a, Note):
                guarded("note", lambda a=a: note(a.event, a.fields))

    execute(ctl.start(clock()))
    next_poll = clock() + poll_s
    finished_at: Optional[float] = None
    while True:
        while not results.empty():
            r = results.get()
            in_flight.discard(r.learner)
            execute(ctl.launched(r.learner, r.ok, clock(), r.error))
        if finished_at is None and guarded("run_over", run_over, False):
            finished_at = clock()
            execute(ctl.run_finished(clock()))
        if finished_at is not None:
            done = ctl.settled and not to_down
            if done or clock() - finished_at > FINISH_WAIT_S:
                if not done:  # the clusters' own autodown ends them once idle
                    note("left_behind", {"launching": sorted(in_flight), "not_torn_down": sorted(to_down),
                                         "autodown_idle_minutes": AUTODOWN_IDLE_MINUTES})
                return
        if clock() >= next_poll:
            next_poll = clock() + poll_s
            for cluster in sorted(to_down):
                down(cluster)
            views = guarded("status", lambda: client.clusters([i.cluster for i in ctl.islands.values()]))
            if views is not None:
                execute(ctl.observe(views, clock()))
        sleep(LOOP_S)
