"""Finding a run: the local registry of launched runs (what `yeto status`, `yeto logs` and `yeto down` find a run
by), and what a run's directory holds (`find_run`: what every command that takes a run reads it through).

One JSON file per run under $YETO_RUNS (default ~/.yeto/runs). It holds where the run lives (its directory, its
syncer address, its clusters or local processes), never a secret.

A run's directory is a launch's --out (the syncer's --out in `syncer/`, each island's in `island-<id>[-mlx]/`), a
syncer's --out (its tape, adapter and keys), or an island's or a standalone `yeto train`'s --out (run.json,
metrics.jsonl, adapter/); `find_run` takes any of them, or a launched run's name, and says where each part is.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Optional

from yeto import YetoError, in_current_words
from yeto.island.metrics import METRICS_FILE, RUN_FILE
from yeto.models.adapter import ADAPTER_DIR
from yeto.sync.shell.keys import has_keyring
from yeto.sync.shell.tape import TAPE_FILE

RUNS_ENV = "YETO_RUNS"
SYNCER_DIR = "syncer"  # a launch's syncer --out, inside its run directory
ISLAND_DIR = "island-"  # a launch's island --outs: island-<id>, island-<id>-mlx
ISLAND_FILES = (RUN_FILE, METRICS_FILE)  # what an island's (or a standalone `yeto train`'s) --out holds
PLAN_FILE = "plan.json"  # a cloud launch's plan, in its run directory (its syncer runs on the head VM)


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


@dataclass(frozen=True)
class RunDirs:
    """Where a run's parts are on this machine, whichever of its directories (or its launched name) was given."""

    given: Path  # the directory named
    what: str  # what it is: "launch" (a launch's --out), "syncer" (a syncer's --out) or "island"
    syncer: Optional[Path]  # the syncer's --out (None: a standalone run, or an island whose syncer is elsewhere)
    islands: dict[int, Path] = field(default_factory=dict)  # island id -> its --out
    record: Optional[RunRecord] = None  # the launched run, when it was named

    @property
    def cloud(self) -> bool:
        """A cloud launch: its syncer runs on the head VM (its tape and keys there are the live ones)."""
        launch = self.given if self.what == "launch" else self.syncer.parent if self.syncer is not None else None
        return (self.record is not None and self.record.kind == "cloud") or (
            launch is not None and (launch / PLAN_FILE).is_file())

    @property
    def standalone(self) -> bool:
        """A `yeto train` without --syncer: no tape, one island's files."""
        return self.syncer is None and self.what == "island" and not _island_config(self.given).get("syncer")

    @property
    def adapter(self) -> Path:
        """The run's adapter: the syncer's merged one, else (a standalone run or an island) the island's own."""
        return (self.syncer if self.syncer is not None and self.what != "island" else self.given) / ADAPTER_DIR


def _island_config(d: Path) -> dict:
    try:
        return in_current_words(json.loads((d / ISLAND_FILES[0]).read_text())).get("config") or {}
    except (OSError, ValueError, AttributeError):
        return {}


def is_syncer_dir(d: Path) -> bool:
    """A syncer's --out: its tape, or its keyring (written before its first event)."""
    return (d / TAPE_FILE).is_file() or has_keyring(d)


def is_island_dir(d: Path) -> bool:
    return any((d / f).is_file() for f in ISLAND_FILES)


def island_dirs(d: Path) -> dict[int, Path]:
    """island-<id> directories in a launch's --out."""
    found = {}
    for sub in sorted(d.glob(f"{ISLAND_DIR}*")):
        lid = sub.name.removeprefix(ISLAND_DIR).split("-")[0]
        if sub.is_dir() and lid.isdigit():
            found[int(lid)] = sub
    return found


def run_dirs(path: Path) -> Optional[RunDirs]:
    """What the directory `path` holds as a run, or None if it holds none."""
    if (path / SYNCER_DIR).is_dir() or (not is_syncer_dir(path) and not is_island_dir(path) and island_dirs(path)):
        syncer = path / SYNCER_DIR
        return RunDirs(path, "launch", syncer if syncer.is_dir() else None, island_dirs(path))
    if is_syncer_dir(path):
        beside = island_dirs(path.parent) if path.name == SYNCER_DIR else {}  # (in a launch's --out)
        return RunDirs(path, "syncer", path, beside)
    if is_island_dir(path):
        launch = path.parent / SYNCER_DIR
        lid = _island_config(path).get("island_id")
        if path.parent != path and launch.is_dir() and path.name.startswith(ISLAND_DIR):
            return RunDirs(path, "island", launch, island_dirs(path.parent))
        return RunDirs(path, "island", None, {int(lid) if isinstance(lid, int) else 0: path})
    return None


def refuse_missing_dir(target: str) -> None:
    """A target written as a path (a separator, `.` or `~` in front: no run's name looks so) that is no directory is
    a typo or a run on another machine: said so, not looked up as a name."""
    path = Path(target).expanduser()
    if not path.is_dir() and (os.sep in target or target.startswith((".", "~"))):
        what = "is a file, not a directory" if path.exists() else "does not exist"
        raise YetoError(f"{target} {what}: give a run's directory (a `yeto launch`, syncer's or island's --out) or a "
                        "launched run's name (yeto status lists them)")


def find_run(target: str) -> RunDirs:
    """A run directory (a launch's, a syncer's or an island's --out), else a launched run's name."""
    refuse_missing_dir(target)
    path = Path(target).expanduser()
    if path.is_dir():
        found = run_dirs(path)
        if found is None:
            raise YetoError(f"{path} holds no run: give a `yeto launch --out` directory (with {SYNCER_DIR}/ inside), "
                            "a syncer's or a `yeto train`'s --out directory, or a launched run's name (yeto status "
                            "lists them)")
        return found
    try:
        record = load_run(target)
    except YetoError as e:
        raise YetoError(f"{target} is neither a run directory nor a launched run's name ({e})") from e
    out = Path(record.out)
    found = run_dirs(out) if out.is_dir() else None
    return RunDirs(out, "launch", out / SYNCER_DIR, island_dirs(out) if out.is_dir() else {}, record) if (
        found is None) else RunDirs(found.given, found.what, found.syncer, found.islands, record)


def recorded_runs() -> list[RunRecord]:
    """Every run the registry holds that yeto can read (a damaged record is left to `load_run` to name)."""
    folder = runs_dir()
    found = []
    for path in sorted(folder.glob("*.json")) if folder.is_dir() else []:
        try:
            found.append(RunRecord(**in_current_words(json.loads(path.read_text()))))
        except (OSError, ValueError, TypeError):
            continue
    return found


def launched_run(target: Optional[str]) -> RunRecord:
    """The launched run `yeto status`, `logs` and `down` act on: by name (none: the latest launched), or by any of its
    directories (`find_run`: a launch's --out, its syncer/ or an island-I/ in it), the latest run launched there."""
    if target is not None:
        refuse_missing_dir(target)
    path = Path(target).expanduser() if target is not None else None
    if path is None or not path.is_dir() or ((runs_dir() / f"{target}.json").is_file() and run_dirs(path) is None):
        return load_run(target)  # (a name; also one that names a folder here holding no run)
    found = find_run(str(path))
    if found.what == "launch":
        launch = found.given
    elif found.syncer is not None and found.syncer.name == SYNCER_DIR and found.syncer.parent != found.given:
        launch = found.syncer.parent  # (a launch's syncer/, or an island-I/ beside it)
    else:
        what = "a standalone `yeto train` run's" if found.standalone else f"a{'n' if found.what == 'island' else ''} "\
               f"{found.what}'s"
        raise YetoError(f"{path} is {what} --out, not a launched run's: `yeto status`, `logs` and `down` act on runs "
                        f"`yeto launch` started, by name or --out (`yeto dashboard {path}` shows this one)")
    here = [r for r in recorded_runs() if Path(r.out).resolve() == launch.resolve()]
    if not here:
        known = ", ".join(f"{r.name} ({r.out})" for r in recorded_runs()) or "none"
        raise YetoError(f"no run launched from {launch} is recorded in {runs_dir()} (known: {known}): give a "
                        f"launched run's name or --out (`yeto dashboard {launch}` reads its files)")
    return max(here, key=lambda r: r.created)


def run_adapter(target: str) -> str:
    """Where a command that reads an adapter (`generate`, `export`) finds it from `target`: a run's directory or
    name gives its adapter's (a launch's: the syncer's merged one); anything else is taken as it is."""
    try:
        return str(find_run(target).adapter.parent)
    except YetoError:
        return target  # (an adapter directory itself; the adapter's reader names what is missing)


def run_tape(target: str) -> str:
    """Where `yeto tape` reads from `target`: a tape file as it is, else the run's syncer --out (a launch's
    syncer/, the syncer beside a launch's island); a run with no syncer here is one line saying why."""
    if Path(target).expanduser().is_file():
        return target
    found = find_run(target)
    if found.syncer is not None and not found.cloud:
        return str(found.syncer)
    if found.cloud:
        raise YetoError(f"{found.given} is a cloud launch: its tape is on the head VM (`yeto status "
                        f"{found.record.name if found.record else found.given.name}` or `yeto dashboard` read it)")
    if found.standalone:
        raise YetoError(f"{found.given} is a standalone `yeto train` run: no syncer, no tape; its loss and eval are in "
                        f"its metrics.jsonl (`yeto dashboard {found.given}` draws them)")
    raise YetoError(f"{found.given} is an island's --out: its syncer's tape is on the syncer's machine, in the "
                    "syncer's --out")
