"""The saved adapter: a peft directory, plus yeto's provenance in its metadata.

`adapter_config.json` + `adapter_model.safetensors` is exactly what
`PeftModel.from_pretrained(base, dir)` reads; the provenance rides along in the
safetensors header (`yeto.models.provenance`) and in `yeto_run.json`.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from yeto import YetoError, in_current_words
from yeto.models.provenance import Artifact

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
RUN_RECORD = "yeto_run.json"
METADATA_KEY = "yeto.models.provenance"
ADAPTER_DIR = "adapter"  # the saved adapter inside a run's --out (a syncer's, an island's, a standalone run's)


def find_adapter_dir(path: str | Path) -> Path:
    """Accept the adapter directory itself or a run directory holding `adapter/`."""
    p = Path(path).expanduser()
    for cand in (p, p / ADAPTER_DIR):
        if (cand / ADAPTER_CONFIG).is_file():
            return cand
    raise YetoError(f"no peft adapter at {p} (expected {ADAPTER_CONFIG} in it or in {p / ADAPTER_DIR})")


def peft_config_dict(cfg, record: dict[str, Any]) -> dict[str, Any]:
    """adapter_config.json's content for a peft LoraConfig (or a peft-free yeto.island.lora_targets.LoraSpec), with the
    base model named as provenance resolved it."""
    model = record.get("model", {})
    cfg.base_model_name_or_path = model.get("hub_id") or model.get("path") or cfg.base_model_name_or_path
    cfg.revision = model.get("revision") if model.get("source") == "hub" else None
    d = cfg.to_dict()
    return json.loads(json.dumps(d, default=lambda o: sorted(o) if isinstance(o, (set, frozenset)) else str(o)))


@contextmanager
def atomic_dir(out_dir: str | Path):
    """Yield a temp dir beside `out_dir`; on success it replaces `out_dir` by renames,
    so readers see the old adapter or the new one, never half of one."""
    out_dir = Path(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}-", dir=out_dir.parent))
    try:
        yield tmp
        os.chmod(tmp, 0o755)
        old = out_dir.with_name(f".{out_dir.name}.old")
        if out_dir.exists():
            shutil.rmtree(old, ignore_errors=True)
            os.replace(out_dir, old)
        os.replace(tmp, out_dir)
        shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _metadata(record: dict[str, Any]) -> dict[str, str]:
    return {"format": "pt", METADATA_KEY: json.dumps(record, sort_keys=True)}


def save_adapter(peft_model, out_dir: str | Path, record: dict[str, Any]) -> Path:
    """Save a live peft model's adapter (peft writes it), with provenance."""
    with atomic_dir(out_dir) as tmp:
        peft_config_dict(peft_model.peft_config["default"], record)  # names the base model as resolved
        peft_model.save_pretrained(str(tmp), save_embedding_layers=False)
        from safetensors.torch import load_file, save_file  # re-save to stamp the provenance into the header

        save_file(load_file(tmp / ADAPTER_WEIGHTS), tmp / ADAPTER_WEIGHTS, metadata=_metadata(record))
        (tmp / RUN_RECORD).write_text(json.dumps(record, indent=2, sort_keys=True))
    return Path(out_dir)


def peft_file_name(canonical: str) -> str:
    """`...lora_A.default.weight` (parameter name) -> `...lora_A.weight` (peft's file key)."""
    return canonical.replace(".default.", ".")


def write_adapter(out_dir: str | Path, tensors: dict[str, Any], adapter_config: dict[str, Any],
                  record: dict[str, Any]) -> Path:
    """Write a peft directory from a canonical `{name: array}` view (the syncer has no model)."""
    import numpy as np
    from safetensors.numpy import save_file

    with atomic_dir(out_dir) as tmp:
        save_file({peft_file_name(k): np.ascontiguousarray(v) for k, v in tensors.items()}, str(tmp / ADAPTER_WEIGHTS),
                  metadata=_metadata(record))
        (tmp / ADAPTER_CONFIG).write_text(json.dumps(adapter_config, indent=2, sort_keys=True))
        (tmp / RUN_RECORD).write_text(json.dumps(record, indent=2, sort_keys=True))
    return Path(out_dir)


def read_provenance(adapter_dir: str | Path) -> dict[str, Any]:
    from safetensors import safe_open

    with safe_open(str(find_adapter_dir(adapter_dir) / ADAPTER_WEIGHTS), framework="numpy") as f:
        meta = f.metadata() or {}
    if METADATA_KEY not in meta:
        raise YetoError(f"{adapter_dir}: adapter has no yeto provenance metadata")
    return in_current_words(json.loads(meta[METADATA_KEY]))


def adapter_base(adapter_dir: Path, model: str | None, revision: str | None) -> Artifact:
    """The base model to load under an adapter: the one it records (yeto's provenance, else peft's
    `base_model_name_or_path`), or `model` when given, which must then be that same base (same content)."""
    from yeto.models.materialize import resolve_model

    try:
        recorded = read_provenance(adapter_dir).get("model") or {}
    except YetoError:  # an adapter yeto did not write: peft's own record of its base
        config = json.loads((adapter_dir / ADAPTER_CONFIG).read_text())
        recorded = {"name": config.get("base_model_name_or_path"), "revision": config.get("revision")}
    if model is None:
        if not recorded.get("name"):
            raise YetoError(f"{adapter_dir} does not record its base model: pass --model")
        local = recorded.get("path") if recorded.get("source") == "local" else None
        return resolve_model(local or recorded["name"], revision or recorded.get("requested_revision"))
    artifact = resolve_model(model, revision)
    if recorded.get("revision") and recorded.get("source") and artifact.revision != recorded["revision"]:
        raise YetoError(f"--model {model} ({artifact.revision[:19]}) is not the base this adapter was trained on: "
                        f"{recorded.get('name')} ({str(recorded['revision'])[:19]}); drop --model to use that one")
    return artifact




def canonical_name(peft_key: str) -> str:
    """`...lora_A.weight` (peft's file key) -> `...lora_A.default.weight` (the parameter name): peft_file_name's
    inverse."""
    head, sep, tail = peft_key.rpartition(".")
    return f"{head}.default.{tail}" if sep and ".lora_" in f".{head}" else peft_key


def resolve_adapter_dir(name: str) -> Path:
    """A local adapter directory (or run directory holding adapter/), else a hub id resolved to one commit."""
    local = Path(name).expanduser()
    if local.exists():
        return find_adapter_dir(local)
    from yeto.models.provenance import resolve_hub_snapshot

    path, _ = resolve_hub_snapshot(name, None, "model")
    return find_adapter_dir(path)


def read_adapter(adapter_dir: Path) -> dict[str, Any]:
    """A peft adapter directory's tensors, by canonical name, as fp32 numpy arrays."""
    import numpy as np
    from safetensors.numpy import load_file

    return {canonical_name(k): np.asarray(v, dtype=np.float32)
            for k, v in load_file(str(adapter_dir / ADAPTER_WEIGHTS)).items()}


def recorded_base_revision(adapter_dir: Path) -> str | None:
    """The base revision yeto recorded in an adapter; None for an adapter yeto did not write."""
    try:
        return (read_provenance(adapter_dir).get("model") or {}).get("revision")
    except YetoError:
        return None


EXPORT_RECORD = "yeto_export.json"  # beside an exported checkpoint: its base, adapter, dtype and the adapter's run
AUTO_DTYPE = "auto"  # an export's weights in the base's own dtype
EXPORT_DTYPES = (AUTO_DTYPE, "float32", "bfloat16", "float16")


def check_export(out: Path, dtype: str, force: bool) -> None:
    """Refuse, before any model loads, a dtype no backend writes, a file where the checkpoint goes, or a non-empty
    directory (unless --force): an export never overwrites what the user did not ask it to."""
    if dtype not in EXPORT_DTYPES:
        raise YetoError(f"unknown --dtype {dtype!r}: use {', '.join(EXPORT_DTYPES)}")
    if out.exists() and not out.is_dir():
        raise YetoError(f"--merged {out} is a file: pass a directory")
    if out.is_dir() and any(out.iterdir()) and not force:
        raise YetoError(f"--merged {out} exists and is not empty: pick a new directory, or pass --force to replace it")


def export_dir_for(out: Path) -> Path:
    """An empty directory beside `out` to write the checkpoint into, so a failed export leaves no half checkpoint."""
    tmp = out.with_name(f".{out.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    return tmp


def finish_export(tmp: Path, out: Path, record: dict[str, Any], adapter_dir: Path) -> None:
    """Write the export's record (with the adapter's own run record, in current words) into `tmp`, then move the
    whole checkpoint to `out` in one rename."""
    if (adapter_dir / RUN_RECORD).is_file():
        record["adapter_run"] = in_current_words(json.loads((adapter_dir / RUN_RECORD).read_text()))
    (tmp / EXPORT_RECORD).write_text(json.dumps(record, indent=2, sort_keys=True))
    if out.exists():
        shutil.rmtree(out)
    tmp.rename(out)
