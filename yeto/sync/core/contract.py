"""The run's contract: what every island of one run must agree on, fixed once and checked at every join.

An island whose base model, LoRA hyper-parameters or adapter layout differ would
produce deltas that merge without error and mean nothing (the layout alone only
covers names and shapes: another `lora_alpha` or another base revision has the
same shapes). So a hello carries the island's contract; the first one (or the
syncer's `--model`/`--model-revision`) fixes the run's, and any later island
that differs is refused with the field and both values.

`tokens_per_step` is not part of the contract (islands may use other batch
sizes): it is the island's declared ceiling, against which its claims are checked.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import PurePath
from typing import Any, Optional

import numpy as np

from yeto.sync.wire.layout import Layout

# fields that must be equal on every island of a run, in the order mismatches are reported
CONTRACT_KEYS = ("base_model", "base_revision", "lora_r", "lora_alpha", "lora_dropout", "lora_targets", "layout",
                 "lora_freeze_a", "data", "loss", "num_islands")
# fields checked only where an island declares them (a peer that says nothing of its shard count is not refused
# for it; a real island always says)
DECLARED_ONLY = ("num_islands",)
# the island flag that sets a field, named in a refusal
FLAGS = {"base_model": "--model", "base_revision": "--model-revision", "lora_r": "--lora-r",
         "lora_alpha": "--lora-alpha", "lora_dropout": "--lora-dropout", "lora_targets": "--lora-targets",
         "lora_freeze_a": "--lora-freeze-a", "data": "--data (and --data-split, --data-config, --columns)",
         "loss": "--loss-function", "num_islands": "--islands"}
MAX_TOKENS_PER_STEP = 1 << 32


def island_contract(adapter_config: dict[str, Any], provenance: dict[str, Any], layout: Layout,
                     tokens_per_step: int) -> dict[str, Any]:
    """What an island declares at join (from its peft config and the provenance of its base model)."""
    model = provenance.get("model") or {}
    targets = adapter_config.get("target_modules")
    name = model.get("hub_id") or model.get("name")
    if model.get("source") == "local" and isinstance(name, str):
        name = PurePath(name).name  # a local copy lives at another path on each machine; its content hash pins it
    return {
        "base_model": name,
        "base_revision": model.get("revision"),
        "lora_r": adapter_config.get("r"),
        "lora_alpha": adapter_config.get("lora_alpha"),
        "lora_dropout": adapter_config.get("lora_dropout"),
        "lora_targets": sorted(targets) if isinstance(targets, (list, tuple, set)) else targets,
        "layout": layout.fingerprint,
        "lora_freeze_a": bool((provenance.get("config") or {}).get("lora_freeze_a", False)),
        "data": data_identity(provenance),
        "loss": provenance.get("loss"),
        "num_islands": (provenance.get("config") or {}).get("num_islands") or None,  # 0: the run's
        "tokens_per_step": int(tokens_per_step),
    }


def data_identity(provenance: dict[str, Any]) -> Optional[str]:
    """The data an island trains on: its content (hub commit or local sha256) and the split and config it reads.
    Every island of a run reads the same dataset and takes its own shard of it."""
    data, stats = provenance.get("data") or {}, provenance.get("data_stats") or {}
    if not data.get("revision"):
        return None
    split = "/".join(str(stats[k]) for k in ("config", "split") if stats.get(k))
    columns = ",".join(f"{k}={v}" for k, v in (stats.get("columns") or {}).items())
    return f"{data['revision']}{' ' + split if split else ''}{' columns ' + columns if columns else ''}"


MAX_ISLAND_RANKS = 4096  # more processes in one island than any cluster runs: a larger claim is cut to this


def tokens_per_step(provenance: dict[str, Any]) -> int:
    """Tokens one inner step can consume at most (micro-batch x accumulation x sequence length x the island's ranks),
    from the island's recorded config; 0 when it is not recorded (then claims are bounded by the syncer's ceiling)."""
    cfg = provenance.get("config") or {}
    try:
        ranks = min(max(int(provenance.get("ranks", 1)), 1), MAX_ISLAND_RANKS)  # a torchrun island's processes
        return int(cfg["batch_size"]) * int(cfg.get("grad_accum", 1)) * int(cfg["seq_len"]) * ranks
    except (KeyError, TypeError, ValueError):
        return 0


def contract_problem(contract: Any) -> Optional[str]:
    """Why a declared contract is unusable, or None."""
    if not isinstance(contract, dict):
        return "contract must be a JSON object"
    for k in (*CONTRACT_KEYS, "tokens_per_step"):
        if k not in contract and k not in DECLARED_ONLY:
            return f"contract is missing {k!r}"
    tps = contract["tokens_per_step"]
    if not isinstance(tps, int) or isinstance(tps, bool) or not 0 <= tps <= MAX_TOKENS_PER_STEP:
        return f"contract.tokens_per_step must be an integer in [0, {MAX_TOKENS_PER_STEP}]"
    for k in ("lora_alpha", "lora_dropout"):
        v = contract[k]
        if v is not None and (not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v)):
            return f"contract.{k} must be a number"
    return None


def run_contract(declared: dict[str, Any], pinned: dict[str, Any]) -> dict[str, Any]:
    """The run's contract from the founding island's declaration, with what the syncer pinned taking precedence."""
    run = {k: declared.get(k) for k in CONTRACT_KEYS}
    run.update({k: v for k, v in pinned.items() if v is not None})
    return run


def contract_mismatch(run: dict[str, Any], declared: dict[str, Any]) -> Optional[str]:
    """The first field in which an island's contract differs from the run's, with both values; None if none."""
    for k in CONTRACT_KEYS:
        if k in DECLARED_ONLY and declared.get(k) is None:
            continue
        if k in run and _norm(declared.get(k)) != _norm(run[k]):
            flag = f" ({FLAGS[k]})" if k in FLAGS else ""
            return f"{k}{flag} is {_show(declared.get(k))} on this island, {_show(run[k])} in the run"
    return None


def _norm(v: Any) -> Any:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return v
    return float(v)  # 32 and 32.0 are the same alpha


def _show(v: Any) -> str:
    s = repr(v)
    return s if len(s) <= 80 else s[:77] + "..."


LORA_SHAPE = ("r", "lora_alpha", "target_modules")  # what an adapter must share with the run it starts


@dataclass(frozen=True)
class InitAdapter:
    """An existing peft adapter a run starts from (`--init-adapter`), as read from its directory."""

    source: str  # the directory or hub id given
    config: dict[str, Any]  # its adapter_config.json
    base_revision: Optional[str]  # the base it was trained on, where yeto recorded it
    tensors: dict[str, np.ndarray]  # by canonical peft name, fp32


def lora_shape_mismatch(config: dict[str, Any], run_config: dict[str, Any]) -> Optional[str]:
    """How an adapter's LoRA shape (rank, alpha, targets) differs from a run's peft config, or None."""
    for key in LORA_SHAPE:
        mine, theirs = config.get(key), run_config.get(key)
        if key == "target_modules":
            mine, theirs = sorted(mine or []), sorted(theirs or [])
        if mine != theirs and not (isinstance(mine, (int, float)) and float(mine) == float(theirs or 0)):
            return f"its {key} is {mine!r}, this run's is {theirs!r}"
    return None


def init_adapter_problem(init: InitAdapter, layout: Layout, adapter_config: dict[str, Any],
                         contract: dict[str, Any]) -> Optional[str]:
    """Why `init` cannot start a run with this layout, peft config and contract (its `base_revision`): version 0 of a
    fleet (the syncer's --init-adapter) or a standalone island's start (yeto train --init-adapter)."""
    problem = lora_shape_mismatch(init.config, adapter_config)
    if problem:
        return problem
    base = contract.get("base_revision")
    if init.base_revision and base and init.base_revision != base:
        return f"it was trained on base {init.base_revision[:19]}, this run's base is {str(base)[:19]}"
    shapes = {s.name: tuple(s.shape) for s in layout.specs}
    missing = sorted(set(shapes) - set(init.tensors))
    extra = sorted(set(init.tensors) - set(shapes))
    if missing:
        return f"its tensors are not this run's ({len(missing)} missing, e.g. {missing[0]!r})"
    if extra:
        return f"it has tensors this run lacks (e.g. {extra[0]!r})"
    for name, shape in shapes.items():
        if tuple(init.tensors[name].shape) != shape:
            return f"{name} is {list(init.tensors[name].shape)} in it, {list(shape)} in this run"
    return None
