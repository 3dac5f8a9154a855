"""What an island reports: its metrics.jsonl events and the record a saved adapter and run.json carry."""

from __future__ import annotations

import json
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from yeto import __version__


def island_record(learner) -> dict[str, Any]:
    """What a saved adapter and run.json say about the island that made it (any backend)."""
    from yeto.provenance import loss_identity

    return {
        "yeto_version": __version__,
        "backend": learner.backend,
        "model": learner.model_artifact.to_dict(),
        **learner.data_record(),
        "config": asdict(learner.cfg),
        "loss": loss_identity(learner.cfg.loss_function),
        "steps": learner.step_count,
        "tokens": learner.tokens_seen,
        "loss_tokens": learner.loss_tokens_seen,
        "ranks": getattr(learner, "ranks", 1),  # processes of a torchrun island (the island's batch is theirs)
    }


class MetricsLog:
    """Append-only JSONL: one object per event, each with wall time."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._f = open(self.path, "a", buffering=1)

    def write(self, **event: Any) -> None:
        self._f.write(json.dumps({"time": round(time.time(), 3), **event}) + "\n")

    def close(self) -> None:
        self._f.close()
