"""The fleet controller: keeps every cloud island running until the run ends, or gives it up.

A pure state machine, like the syncer's core: the shell (`yeto.launch.head`) reports what it observed of the
island clusters (`observe`), how a launch it was asked for ended (`launched`) and when the run finished
(`run_finished`); the controller answers with actions (`Launch`, `Down`, `GiveUp`, `Note`). Time comes in as an
argument, so `tests/test_launch.py` drives it through seeded schedules of preemptions and failed launches.

Per island:

    LAUNCHING --ok--> RUNNING --cluster gone / stopped / job failed--> RECOVERING --backoff--> LAUNCHING
        |                |                                              |
        +--failed--> RECOVERING      +--job succeeded--> DONE            +--recovering > --recover-timeout--> GIVEN_UP
                         |
                         +--job exited 2 (a usage error or refusal: the same command meets it again)--> GIVEN_UP

A relaunched island keeps its island id, so it rejoins the run through the syncer's rejoin path. An outage lasts
until the relaunched island has stayed healthy for `stable_s`: an island that crashes again and again is relaunched
with growing backoff and given up at --recover-timeout like one that never comes back. An island whose job exited
with `USAGE_EXIT` (a flag or input it refuses: relaunching the same command cannot help) is given up at once, with its
error line as the reason. An island given up is handed to the syncer (`yeto.sync.shell.given_up`), which lowers its
quorum (and records the reason on its tape, where `yeto status` shows it), and torn down.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any, Optional, Union

RELAUNCH_BACKOFF_S = (15.0, 30.0, 60.0, 120.0, 300.0)  # after the 1st, 2nd, ... failed relaunch (then the last)
SUSPECT_INIT_S = 300.0  # a cluster seen INIT this long after it was UP (nodes lost, SkyPilot repairing) is down
STABLE_S = 300.0  # an outage ends once the relaunched island has stayed healthy this long (a crash loop does not)
HEALTHY_JOBS = frozenset({"INIT", "PENDING", "SETTING_UP", "RUNNING"})
FAILED_JOBS = frozenset({"FAILED", "FAILED_SETUP", "FAILED_DRIVER", "CANCELLED"})
USAGE_EXIT = 2  # an island's exit code for a usage error or a refusal (YetoError): the same command fails the same way


@dataclass(frozen=True)
class ClusterView:
    """What SkyPilot says of one island cluster now: status UP / INIT / STOPPED / GONE (no such cluster), the
    status of its island job (None when unknown), and for an ended job its exit code and last error line, where
    its log tells them (`yeto.launch.tasks.island_exit`)."""

    status: str
    job: Optional[str] = None
    exit_code: Optional[int] = None
    error: str = ""


@dataclass(frozen=True)
class Launch:
    island: int
    cluster: str
    attempt: int


@dataclass(frozen=True)
class Down:
    cluster: str


@dataclass(frozen=True)
class GiveUp:
    island: int
    reason: str


@dataclass(frozen=True)
class Note:
    """An event for the fleet tape (`<out>/fleet.jsonl`) and the log."""

    event: str
    fields: dict[str, Any]


Action = Union[Launch, Down, GiveUp, Note]


class CloudPhase(str, enum.Enum):
    LAUNCHING = "launching"
    RUNNING = "running"
    RECOVERING = "recovering"
    DONE = "done"
    GIVEN_UP = "given_up"


@dataclass
class CloudIsland:
    island: int
    cluster: str
    phase: CloudPhase = CloudPhase.LAUNCHING
    down_since: Optional[float] = None  # when this outage began (None: healthy for at least stable_s)
    healthy_since: Optional[float] = None
    retry_at: float = 0.0
    init_since: Optional[float] = None
    failures: int = 0  # outages and failed launches since it was last seen healthy
    launches: int = 0
    recoveries: int = 0


@dataclass
class FleetController:
    clusters: dict[int, str]  # island id -> its cluster's name
    recover_timeout_s: float
    stable_s: float = STABLE_S
    islands: dict[int, CloudIsland] = field(default_factory=dict)
    finished: bool = False

    def start(self, now: float) -> list[Action]:
        self.islands = {lid: CloudIsland(lid, name) for lid, name in sorted(self.clusters.items())}
        return [self._launch(i, now) for i in self.islands.values()]

    def launched(self, island: int, ok: bool, now: float, error: str = "") -> list[Action]:
        """The shell's launch of `island` returned (SkyPilot provisioned and started it, or gave up)."""
        i = self.islands[island]
        if i.phase is not CloudPhase.LAUNCHING:
            return []
        if self.finished:
            i.phase = CloudPhase.DONE
            return [Down(i.cluster)]
        if ok:
            i.phase, i.healthy_since = CloudPhase.RUNNING, None
            return [Note("up", {"island": island, "cluster": i.cluster, "launches": i.launches})]
        return self._outage(i, now, f"launch failed: {error}", already_down=False)

    def observe(self, views: dict[str, ClusterView], now: float) -> list[Action]:
        """What SkyPilot reports of the island clusters (a cluster missing from `views` is GONE)."""
        out: list[Action] = []
        for i in self.islands.values():
            if i.phase is CloudPhase.RUNNING:
                out += self._check(i, views.get(i.cluster, ClusterView("GONE")), now)
            if i.phase is CloudPhase.RECOVERING and not self.finished:
                out += self._recover(i, now)
        return out

    def run_finished(self, now: float) -> list[Action]:
        """The syncer finished the run: every island cluster goes down (a launch in flight is downed on return)."""
        self.finished = True
        out: list[Action] = [Note("run_finished", {})]
        for i in self.islands.values():
            if i.phase in (CloudPhase.RUNNING, CloudPhase.RECOVERING):
                out.append(Down(i.cluster))
                i.phase = CloudPhase.DONE
        return out

    @property
    def settled(self) -> bool:
        """Nothing left to watch or tear down."""
        return all(i.phase in (CloudPhase.DONE, CloudPhase.GIVEN_UP) for i in self.islands.values())

    # ------------------------------------------------------------------ transitions

    def _launch(self, i: CloudIsland, now: float) -> Launch:
        i.phase, i.init_since = CloudPhase.LAUNCHING, None
        i.launches += 1
        return Launch(i.island, i.cluster, i.launches)

    def _check(self, i: CloudIsland, view: ClusterView, now: float) -> list[Action]:
        if view.job == "SUCCEEDED":  # the island exited 0: the run told it to finish
            i.phase = CloudPhase.DONE
            return [Note("island_done", {"island": i.island, "cluster": i.cluster}), Down(i.cluster)]
        if view.job in FAILED_JOBS and view.exit_code == USAGE_EXIT:
            return self._give_up(i, f"island exited {USAGE_EXIT}, not relaunched (the same command would fail the "
                                    f"same way): {view.error or 'no error line in its log'}")
        if view.status == "INIT":
            i.init_since = now if i.init_since is None else i.init_since
            if now - i.init_since < SUSPECT_INIT_S:
                return []
        else:
            i.init_since = None
        if view.status == "UP" and (view.job is None or view.job in HEALTHY_JOBS):
            i.healthy_since = now if i.healthy_since is None else i.healthy_since
            if i.down_since is not None and now - i.healthy_since >= self.stable_s:  # the outage is over
                i.recoveries += 1
                fields = {"island": i.island, "cluster": i.cluster,
                          "down_s": round(i.healthy_since - i.down_since, 1)}
                i.down_since, i.failures = None, 0  # the next outage starts its budget and backoff afresh
                return [Note("recovered", fields)]
            return []
        i.healthy_since = None
        why = f"cluster {view.status.lower()}" if view.status != "UP" else f"island job {view.job.lower()}"
        return self._outage(i, now, why, already_down=view.status == "GONE")

    def _outage(self, i: CloudIsland, now: float, why: str, already_down: bool) -> list[Action]:
        """The island is down: the outage's clock starts at its first loss and keeps running through relaunches that
        fail or crash again before the island has stayed healthy for `stable_s`."""
        first = i.down_since is None
        i.down_since = now if first else i.down_since
        i.phase = CloudPhase.RECOVERING
        i.failures += 1  # the first relaunch is at once; each failed one waits longer before the next
        i.retry_at = now + (RELAUNCH_BACKOFF_S[min(i.failures - 2, len(RELAUNCH_BACKOFF_S) - 1)] if i.failures > 1
                            else 0.0)
        out: list[Action] = [Note("lost", {"island": i.island, "cluster": i.cluster, "why": why,
                                           "launches": i.launches, "outage_s": round(now - i.down_since, 1)})]
        if not already_down:
            out.append(Down(i.cluster))  # a stopped or failed cluster is torn down before its relaunch
        return out + self._recover(i, now)

    def _recover(self, i: CloudIsland, now: float) -> list[Action]:
        assert i.down_since is not None
        if now - i.down_since >= self.recover_timeout_s:
            return self._give_up(i, f"not back within --recover-timeout {self.recover_timeout_s:g}s "
                                    f"({i.launches - 1} relaunch attempt(s))")
        if now >= i.retry_at:
            launch = self._launch(i, now)
            return [Note("relaunch", {"island": i.island, "cluster": i.cluster, "attempt": launch.attempt}), launch]
        return []

    def _give_up(self, i: CloudIsland, reason: str) -> list[Action]:
        i.phase = CloudPhase.GIVEN_UP
        return [Note("given_up", {"island": i.island, "cluster": i.cluster, "reason": reason}),
                GiveUp(i.island, reason), Down(i.cluster)]
