"""What an island reports: its metrics.jsonl events and the record a saved adapter and run.json carry."""

from __future__ import annotations

import json
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any, Optional

from yeto import __version__
from yeto.report.trackers import Trackers, flat_metrics


def island_record(island) -> dict[str, Any]:
    """What a saved adapter and run.json say about the island that made it (any backend)."""
    from yeto.models.provenance import loss_identity

    return {
        "yeto_version": __version__,
        "backend": island.backend,
        "model": island.model_artifact.to_dict(),
        **island.data_record(),
        "config": asdict(island.cfg),
        "loss": loss_identity(island.cfg.loss_function),
        "steps": island.step_count,
        "tokens": island.tokens_seen,
        "loss_tokens": island.loss_tokens_seen,
        "ranks": getattr(island, "ranks", 1),  # processes of a torchrun island (the island's batch is theirs)
    }


# the events trackers get (`--report-to`), each under its prefix: train/loss, eval/eval_loss, round/delta_norm,
# task/accuracy (--eval-task: yeto.island.task_eval), ...
TRACKED = {"step": "train", "eval": "eval", "round": "round", "task_eval": "task"}
RUN_FILE = "run.json"  # in an island's --out: its config, data and provenance (the run record)
METRICS_FILE = "metrics.jsonl"  # in an island's --out: one event a line (steps, evals, rounds)


class MetricsLog:
    """Append-only JSONL: one object per event, each with wall time; `trackers` (yeto.report.trackers) get the numbers
    of its step, eval, round and task_eval events too, at the island's step."""

    def __init__(self, path: str | Path, trackers: Optional[Trackers] = None):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._f = open(self.path, "a", buffering=1)
        self.trackers = trackers

    def write(self, **event: Any) -> None:
        self._f.write(json.dumps({"time": round(time.time(), 3), **event}) + "\n")
        self.track(**event)

    def track(self, **event: Any) -> None:
        """To the trackers only (a fleet island's inner steps: metrics.jsonl keeps one line per round)."""
        prefix = TRACKED.get(event.get("event", ""))
        if self.trackers is None or prefix is None or event.get("step") is None:
            return
        fields = {k: v for k, v in event.items() if k not in ("event", "step")}
        self.trackers.log(int(event["step"]), flat_metrics(prefix, fields))

    def close(self) -> None:
        self._f.close()
        if self.trackers is not None:
            self.trackers.finish()
