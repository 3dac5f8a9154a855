"""The local registry of launched runs: what `yeto status`, `yeto logs` and `yeto down` find a run by.

One JSON file per run under $YETO_RUNS (default ~/.yeto/runs). It holds where the run lives (its directory, its
syncer address, its clusters or local processes), never a secret.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Optional

from yeto import YetoError, in_current_words

RUNS_ENV = "YETO_RUNS"


def runs_dir() -> Path:
    return Path(os.environ.get(RUNS_ENV, Path.home() / ".yeto" / "runs"))


@dataclass
class RunRecord:
    name: str
    kind: str  # "local" (the head is this machine) or "cloud"
    out: str  # the run directory on this machine
    syncer: str = ""  # HOST:PORT islands connect to
    created: float = field(default_factory=time.time)
    head_cluster: Optional[str] = None
    island_clusters: dict[str, str] = field(default_factory=dict)  # island id (str: JSON keys) -> cluster
    external: list[int] = field(default_factory=list)
    launcher_pid: Optional[int] = None  # local runs: the `yeto launch` process that owns the fleet
    processes: dict[str, int] = field(default_factory=dict)  # local runs: name -> pid
    logs: dict[str, str] = field(default_factory=dict)  # local runs: name ("syncer", "island-0") -> log file
    controller: str = "head"  # cloud runs: where the fleet controller runs ("head" or "here")
    state: str = "running"  # "running", "ended" (a local fleet's launcher exited) or "down" (`yeto down`)
    started: dict[str, float] = field(default_factory=dict)  # local runs: pid (str) -> its start time (from /proc)

    @property
    def path(self) -> Path:
        return runs_dir() / f"{self.name}.json"

    def save(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(asdict(self), indent=1))
        os.replace(tmp, self.path)


def load_run(name: Optional[str]) -> RunRecord:
    """A run by name; without a name, the latest launched."""
    folder = runs_dir()
    if name is None:
        runs = sorted(folder.glob("*.json"), key=lambda p: p.stat().st_mtime) if folder.is_dir() else []
        if not runs:
            raise YetoError(f"no runs recorded in {folder}: start one with `yeto launch`")
        path = runs[-1]
    else:
        path = folder / f"{name}.json"
        if not path.is_file():
            known = sorted(p.stem for p in folder.glob("*.json")) if folder.is_dir() else []
            raise YetoError(f"no run named {name!r} in {folder} (known: {', '.join(known) or 'none'})")
    try:
        return RunRecord(**in_current_words(json.loads(path.read_text())))
    except (ValueError, TypeError) as e:
        raise YetoError(f"{path} is not a run record yeto wrote ({e}): delete it") from e


def live_run(name: str) -> Optional[RunRecord]:
    """The run of that name if one is recorded and not ended or downed (a new launch must not take its name); a
    local run whose launcher is gone (killed) is not."""
    try:
        run = load_run(name)
    except YetoError:
        return None
    if run.state != "running":
        return None
    if run.kind == "local" and not process_alive(run.launcher_pid, run.started.get(str(run.launcher_pid))):
        return None
    return run


def process_alive(pid: Optional[int], started: Optional[float] = None) -> bool:
    """The process runs: not exited, not a zombie, and (given its recorded start) not another process that took
    its pid since."""
    if not pid:
        return False
    try:
        os.kill(pid, 0)
    except (ProcessLookupError, PermissionError):
        return False
    if started is not None and process_start(pid) not in (None, started):
        return False
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:  # no /proc (macOS): signal 0 is the answer
        return True


def process_start(pid: int) -> Optional[float]:
    """A process's start time in clock ticks since boot (Linux), to tell it from a later process with its pid."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return float(f.read().rsplit(")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return None
