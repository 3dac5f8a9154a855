"""An island's training state on disk, so that a preempted island resumes where it was.

`OUT/train_state.safetensors` is one safetensors file: the tensors under canonical names, the scalars as JSON in
its header. It is written to a temp file beside it, flushed to disk and renamed over the old one (os.replace), so
a kill during a save leaves the previous state whole; one file, so its tensors and scalars always agree.

    adapter/<peft name>      the adapter (standalone: restored; in a fleet the rejoin brings the global instead)
    exp_avg/<peft name>      AdamW first moment of each trained parameter
    exp_avg_sq/<peft name>   AdamW second moment
    residual                 the 4-bit delta quantizer's error-feedback residual (fleet; flat, the sync layout)
    rng/torch, rng/cuda      torch's generator states (dropout); rng/mlx: MLX's key
    meta (JSON)              step, tokens, the LR schedule's horizon, the batch sampler's position, each parameter's
                             AdamW step, whether the run finished, and `run`: the flags and resolved inputs it was
                             saved under, compared field by field on resume

Numpy's global generator is not saved: nothing in training draws from it (the batch order is its own seeded
generator, saved as its position). `save_state`'s `before_commit` is where the entry point's fault hook enters
(yeto.cli.test_hooks: YETO_CRASH_AT="train_state:N" kills the process in the save of step N, after the temp file is
written and before it replaces the state; unset in real runs).
"""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

import numpy as np

from yeto import YetoError, in_current_words

STATE_FILE = "train_state.safetensors"
FORMAT = 1  # raised whenever the file's layout changes: a state of another format is refused, never misread
META_KEY = "yeto_train_state"
# the flags that shape an island's trajectory: a state saved under other values is another run's
RUN_FIELDS = ("seq_len", "batch_size", "grad_accum", "lr", "warmup_steps", "min_lr_ratio", "weight_decay",
              "max_grad_norm", "lora_r", "lora_alpha", "lora_dropout", "lora_targets", "lora_freeze_a",
              "loss_function", "eval_fraction", "seed", "island_id", "num_islands",
              "columns")


@dataclass
class TrainState:
    """What an island needs to take its next step as if it had never stopped."""

    meta: dict[str, Any]
    tensors: dict[str, np.ndarray] = field(default_factory=dict)

    def group(self, prefix: str) -> dict[str, np.ndarray]:
        """The tensors saved under `prefix/`, by the rest of their name."""
        p = prefix + "/"
        return {k[len(p):]: v for k, v in self.tensors.items() if k.startswith(p)}


def run_identity(island: Any) -> dict[str, Any]:
    """The flags and resolved inputs (model commit, data digest) a state belongs to; the --out, the device, the
    syncer's address and --max-steps may change between a run and its resumption."""
    cfg = island.cfg
    return {"model": island.model_artifact.revision, "data": island.source.artifact.revision,
            "fleet": bool(cfg.syncer), "ranks": getattr(island, "ranks", 1),
            **{f: getattr(cfg, f) for f in RUN_FIELDS}}


def differences(saved: dict[str, Any], now: dict[str, Any]) -> list[str]:
    """'--flag A there, B here' for every field where a saved run's identity differs from this one's."""
    names = {"model": "the model (resolved commit)", "data": "the data (digest)",
             "fleet": "the mode (--syncer given)", "ranks": "the island's processes (torchrun)"}
    return [f"{names.get(k, '--' + k.replace('_', '-'))}: {saved.get(k)!r} there, {now.get(k)!r} here"
            for k in sorted(set(saved) | set(now)) if saved.get(k) != now.get(k)]


def save_state(out: str | Path, state: TrainState,
               before_commit: Optional[Callable[[int], None]] = None) -> Path:
    """Write `out/train_state.safetensors` atomically (temp file, fsync, os.replace); `before_commit(step)` runs
    between the fsync and the replace (where a fault test kills the process)."""
    from safetensors.numpy import save

    path = Path(out) / STATE_FILE
    data = save({k: np.ascontiguousarray(v) for k, v in state.tensors.items()},
                metadata={META_KEY: json.dumps({"format": FORMAT, **state.meta})})
    fd, tmp = tempfile.mkstemp(prefix=f".{STATE_FILE}-", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        if before_commit is not None:
            before_commit(int(state.meta.get("step", -1)))
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    for stale in path.parent.glob(f".{STATE_FILE}-*"):  # a temp file a process killed mid-save left (one writer)
        stale.unlink(missing_ok=True)
    return path


def load_state(out: str | Path) -> Optional[TrainState]:
    """The state saved in `out`, or None where there is none."""
    from safetensors import SafetensorError, safe_open

    path = Path(out) / STATE_FILE
    if not path.exists():
        return None
    try:
        with safe_open(str(path), framework="numpy") as f:
            meta = in_current_words(json.loads((f.metadata() or {})[META_KEY]))
            tensors = {k: f.get_tensor(k) for k in f.keys()}
    except (SafetensorError, OSError, ValueError, KeyError) as e:
        raise YetoError(f"{path} is not a training state yeto can read ({e}): pass --fresh to start over (it is "
                        "then replaced), or use another --out") from None
    if meta.get("format") != FORMAT:
        raise YetoError(f"{path} has format {meta.get('format')!r}, this yeto reads {FORMAT}: pass --fresh to start "
                        "over, or use another --out")
    return TrainState(meta, tensors)
