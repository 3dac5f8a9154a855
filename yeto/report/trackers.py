"""Experiment trackers (`--report-to tensorboard,wandb,trackio,mlflow`): what an island or the syncer already
records (metrics.jsonl, the tape) also goes to each tracker, through that tracker's own library.

Each process is one tracker run, named `<run>-island-<id>` or `<run>-syncer` and grouped by the run's name (wandb's
group, mlflow's experiment, trackio's project, one TensorBoard directory per process under `OUT/tb/`), with its
config. `Trackers` fans each record out on a thread of its own, so a slow or failing tracker never holds up
training or a merge: a tracker that raises is named in one log line and left out from then on; records beyond
QUEUE_LIMIT waiting are dropped (and counted). Nothing leaves the machine unless the tracker is set up to send it:
without WANDB_API_KEY wandb runs offline, mlflow writes `OUT/mlflow.db` unless MLFLOW_TRACKING_URI says otherwise,
trackio writes `OUT/trackio` unless TRACKIO_DIR does.
"""

from __future__ import annotations

import json
import math
import os
import queue
import threading
from pathlib import Path
from typing import Any, Callable, Optional, Protocol

from yeto import YetoError

TRACKERS = ("tensorboard", "wandb", "trackio", "mlflow")
NONE = "none"
EXTRA = "track"  # the pip extra that installs every tracker's library
# what a cloud task needs from the launching machine to reach each tracker (SkyPilot secrets, never a task's YAML)
CREDENTIALS = {"wandb": ("WANDB_API_KEY", "WANDB_BASE_URL", "WANDB_ENTITY", "WANDB_PROJECT"),
               "mlflow": ("MLFLOW_TRACKING_URI", "MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD",
                          "MLFLOW_TRACKING_TOKEN"),
               "trackio": ("HF_TOKEN", "TRACKIO_SPACE_ID")}
MLFLOW_DB = "mlflow.db"  # mlflow's local store under a process's --out
PROJECT = "yeto"  # wandb's project unless WANDB_PROJECT says another
QUEUE_LIMIT = 10_000  # records waiting for the trackers' thread; past this they are dropped, not waited for
FINISH_TIMEOUT_S = 60.0  # at the end, how long the trackers get to flush before the process goes on without them


class Tracker(Protocol):
    """One tracker run: its config once, then numeric metrics at a step, then finish."""

    def log_config(self, config: dict[str, Any]) -> None: ...
    def log(self, step: int, metrics: dict[str, float]) -> None: ...
    def finish(self) -> None: ...


def report_to_help(what: str, more: str = "") -> str:
    """`--report-to`'s help, written once for every command that takes it: `what` the tracker runs are of."""
    return (f"Experiment trackers for {what}, comma-separated: {', '.join(TRACKERS)}, or {NONE} (tensorboard writes "
            f"OUT/tb; wandb runs offline without WANDB_API_KEY).{more}")


def parse_report_to(spec: str) -> list[str]:
    """`--report-to`'s trackers, in order, without repeats ([] for `none`); an unknown name is one line naming the
    known ones."""
    names = [n.strip().lower() for n in (spec or NONE).split(",") if n.strip()]
    unknown = [n for n in names if n not in TRACKERS and n != NONE]
    if unknown:
        raise YetoError(f"--report-to {spec!r}: unknown tracker {', '.join(map(repr, unknown))}; use a comma-separated "
                        f"list of {', '.join(TRACKERS)}, or {NONE}")
    if NONE in names and len(names) > 1:
        raise YetoError(f"--report-to {spec!r}: {NONE} with other trackers; give either {NONE} or the trackers")
    return list(dict.fromkeys(n for n in names if n != NONE))


def check_installed(names: list[str]) -> None:
    """One line naming the pip extra for each tracker whose library is missing (before anything starts)."""
    import importlib.util

    missing = [n for n in names if importlib.util.find_spec(n) is None]  # (each tracker's module is its name)
    if missing:
        raise YetoError(f"--report-to {','.join(missing)}: {', '.join(missing)} not installed; "
                        f"pip install 'yeto[{EXTRA}]' (or the package itself), or drop it from --report-to")


def flat_metrics(prefix: str, fields: dict[str, Any]) -> dict[str, float]:
    """The finite numbers of a record as `prefix/name`, a dict's as `prefix/name/key` (lists and text left out)."""
    out: dict[str, float] = {}
    for name, value in fields.items():
        if isinstance(value, bool) or value is None:
            continue
        if isinstance(value, (int, float)):
            if math.isfinite(value):
                out[f"{prefix}/{name}"] = float(value)
        elif isinstance(value, dict):
            out.update(flat_metrics(f"{prefix}/{name}", value))
    return out


def per_island(prefix: str, islands: list[int], **series: list[Any]) -> dict[str, float]:
    """Per-island lists of a merge (weights, lags) as `prefix/name/island`."""
    return flat_metrics(prefix, {name: {str(lid): v for lid, v in zip(islands, values)}
                                 for name, values in series.items() if isinstance(values, list)})


# ---------------------------------------------------------------------------------------------- the adapters


class TensorBoardTracker:
    """Event files under `OUT/tb/<name>` through tensorboard's own writer (`tensorboard --logdir OUT`)."""

    def __init__(self, out: Path, name: str, group: str):
        from tensorboard.summary.writer.event_file_writer import EventFileWriter

        self.writer = EventFileWriter(str(out / "tb" / name), flush_secs=5)

    def log_config(self, config: dict[str, Any]) -> None:
        from tensorboard.compat.proto.event_pb2 import Event
        from tensorboard.compat.proto.summary_pb2 import Summary
        from tensorboard.compat.proto.tensor_pb2 import TensorProto
        from tensorboard.compat.proto.tensor_shape_pb2 import TensorShapeProto
        from tensorboard.plugins.text.metadata import create_summary_metadata

        text = "```\n" + json.dumps(config, indent=1, default=str) + "\n```"  # the text plugin renders markdown
        tensor = TensorProto(dtype="DT_STRING", string_val=[text.encode()],
                             tensor_shape=TensorShapeProto(dim=[TensorShapeProto.Dim(size=1)]))
        value = Summary.Value(tag="config", metadata=create_summary_metadata("config", ""), tensor=tensor)
        self.writer.add_event(Event(summary=Summary(value=[value]), step=0))

    def log(self, step: int, metrics: dict[str, float]) -> None:
        import time

        from tensorboard.compat.proto.event_pb2 import Event
        from tensorboard.compat.proto.summary_pb2 import Summary

        values = [Summary.Value(tag=k, simple_value=v) for k, v in metrics.items()]
        self.writer.add_event(Event(summary=Summary(value=values), step=step, wall_time=time.time()))

    def finish(self) -> None:
        self.writer.close()


class WandbTracker:
    """A wandb run in the run's group; offline (files under OUT/wandb, `wandb sync` uploads them) without a key."""

    def __init__(self, out: Path, name: str, group: str):
        import wandb

        mode = os.environ.get("WANDB_MODE") or ("online" if os.environ.get("WANDB_API_KEY") else "offline")
        self.run = wandb.init(project=os.environ.get("WANDB_PROJECT") or PROJECT, group=group, name=name,
                              dir=str(out), mode=mode, reinit="create_new",
                              settings=wandb.Settings(console="off", silent=True))

    def log_config(self, config: dict[str, Any]) -> None:
        self.run.config.update(config, allow_val_change=True)

    def log(self, step: int, metrics: dict[str, float]) -> None:
        self.run.log(metrics, step=step)

    def finish(self) -> None:
        self.run.finish()


class MlflowTracker:
    """An mlflow run in the experiment named after the run (the tracking server MLFLOW_TRACKING_URI names, else the
    SQLite store OUT/mlflow.db: mlflow's file store is frozen, its docs say a database instead)."""

    def __init__(self, out: Path, name: str, group: str):
        from mlflow import MlflowClient

        uri = os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{(out / MLFLOW_DB).resolve()}"
        self.client = MlflowClient(tracking_uri=uri)
        found = self.client.get_experiment_by_name(group)
        experiment = found.experiment_id if found is not None else self.client.create_experiment(group)
        self.run_id = self.client.create_run(experiment, run_name=name).info.run_id

    def log_config(self, config: dict[str, Any]) -> None:
        from mlflow.entities import Param

        flat = _flat_config(config)
        self.client.log_batch(self.run_id, params=[Param(k, str(v)[:6000]) for k, v in flat.items()])

    def log(self, step: int, metrics: dict[str, float]) -> None:
        import time

        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[Metric(k, v, now, step) for k, v in metrics.items()])

    def finish(self) -> None:
        self.client.set_terminated(self.run_id)


class TrackioTracker:
    """A trackio run in the project named after the run (local: OUT/trackio unless TRACKIO_DIR says another)."""

    def __init__(self, out: Path, name: str, group: str):
        os.environ.setdefault("TRACKIO_DIR", str((out / "trackio").resolve()))  # read when trackio is imported
        import trackio

        self.run = trackio.init(project=group, name=name, group=group, embed=False, auto_log_gpu=False,
                                auto_log_cpu=False)

    def log_config(self, config: dict[str, Any]) -> None:
        self.run.config.update(_flat_config(config))

    def log(self, step: int, metrics: dict[str, float]) -> None:
        self.run.log(metrics, step=step)

    def finish(self) -> None:
        self.run.finish()


ADAPTERS: dict[str, Callable[[Path, str, str], Tracker]] = {
    "tensorboard": TensorBoardTracker, "wandb": WandbTracker, "mlflow": MlflowTracker, "trackio": TrackioTracker}


def _flat_config(config: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in config.items():
        if isinstance(v, dict):
            out.update(_flat_config(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


# ---------------------------------------------------------------------------------------------- the fan-out


class Trackers:
    """Every tracker of a process behind one queue and one thread: `log` returns at once whatever the trackers do.

    A tracker that fails (to start, to log or to finish) is named in one `warn` line and left out from then on."""

    def __init__(self, names: list[str], out: Path, name: str, group: str, config: dict[str, Any],
                 warn: Callable[[str], None], adapters: Optional[dict[str, Callable[..., Tracker]]] = None):
        self.names, self.out, self.name, self.group = names, Path(out), name, group
        self.warn, self.adapters = warn, adapters or ADAPTERS
        self.live: dict[str, Tracker] = {}
        self.failed: dict[str, str] = {}  # tracker -> why it was left out
        self.dropped = 0
        self._queue: queue.Queue = queue.Queue(maxsize=QUEUE_LIMIT)
        if config:
            self._queue.put(("config", config))
        self._thread = threading.Thread(target=self._work, name="yeto-trackers", daemon=True)
        self._thread.start()

    def log(self, step: int, metrics: dict[str, float]) -> None:
        if metrics:
            self._put(("log", (int(step), metrics)))

    def log_config(self, config: dict[str, Any]) -> None:
        self._put(("config", config))

    def _put(self, item: tuple[str, Any]) -> None:
        try:
            self._queue.put_nowait(item)
        except queue.Full:
            self.dropped += 1

    def finish(self) -> None:
        """Flush and close every tracker (waiting at most FINISH_TIMEOUT_S)."""
        self._queue.put(("finish", None))
        self._thread.join(FINISH_TIMEOUT_S)
        if self._thread.is_alive():
            self.warn(f"trackers still busy after {FINISH_TIMEOUT_S:g}s at the end; going on without them")
        if self.dropped:
            self.warn(f"trackers: {self.dropped} records dropped (more than {QUEUE_LIMIT} waiting)")

    def _work(self) -> None:
        for n in self.names:
            self._call(n, lambda n=n: self.live.__setitem__(n, self.adapters[n](self.out, self.name, self.group)))
        while True:
            kind, payload = self._queue.get()
            for n, tracker in list(self.live.items()):
                if kind == "log":
                    self._call(n, lambda t=tracker: t.log(*payload))
                elif kind == "config":
                    self._call(n, lambda t=tracker: t.log_config(payload))
                else:
                    self._call(n, tracker.finish)
            if kind == "finish":
                return

    def _call(self, name: str, fn: Callable[[], Any]) -> None:
        try:
            fn()
        except Exception as e:  # a tracker's library may raise anything (network, disk, its own checks)
            self.live.pop(name, None)
            self.failed[name] = f"{type(e).__name__}: {' '.join(str(e).split())[:200]}"
            self.warn(f"tracker {name} failed ({self.failed[name]}); going on without it")


def open_trackers(spec: str, out: str | Path, name: str, group: str, config: dict[str, Any],
                  warn: Callable[[str], None]) -> Optional[Trackers]:
    """The trackers `--report-to` names for one process (None for `none`): checked here (an unknown name or a
    missing library is one line), started on their own thread."""
    names = parse_report_to(spec)
    if not names:
        return None
    check_installed(names)
    return Trackers(names, Path(out), name, group, config, warn)


def run_group(run_name: str, out: str | Path) -> str:
    """The run's name that groups its processes' tracker runs: --run-name, else the --out directory's name."""
    return run_name or Path(out).resolve().name or "yeto"
