"""The syncer's disk: the checkpoint, the accepted deltas of the open round, and the tape, with fsync discipline.

Everything the syncer core asks to make durable goes through here, and in one
order: the tape is fsynced first (so the tape is never behind the disk), then
the file is written to a temporary name, fsynced, renamed into place, and its
directory fsynced. A SIGKILL at any instant leaves either the old file or the
new one, never half of one. On start, `load` hands the core what survived: a
checkpoint whose content digest checks out (else the previous one, said on the
tape), the saved deltas, and the tape with a torn last line cut off.

    OUT/state.safetensors        global adapter, outer momentum, broadcast residual + run metadata
    OUT/state.prev.safetensors   the checkpoint before it (a fallback if the newest is damaged)
    OUT/pending/r<round>-l<island>.safetensors   a delta accepted for the open round (its wire payload)
    OUT/tape.jsonl               the event tape
    OUT/adapter/                 the global adapter as a peft directory (derived; rewritten after each merge)
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import numpy as np

from yeto import YetoError, in_current_words
from yeto.models.adapter import ADAPTER_CONFIG, read_adapter, recorded_base_revision, resolve_adapter_dir, write_adapter
from yeto.sync.core.actions import AcceptedDelta, Checkpoint, Durable, Record
from yeto.sync.core.contract import InitAdapter
from yeto.sync.wire.layout import layout_from_json, unflatten
from yeto.sync.wire.protocol import array_digest, digest_bytes
from yeto.sync.shell.tape import Tape

STATE_FILE = "state.safetensors"
PREV_STATE_FILE = "state.prev.safetensors"
PENDING_DIR = "pending"
STATE_FORMAT = "yeto-syncer-state/2"  # raised whenever the layout changes: another format is refused, never misread


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_durably(path: Path, write) -> None:
    """write(tmp_path), fsync it, rename it over `path`, fsync the directory."""
    tmp = path.with_name(f".{path.name}.tmp")
    write(tmp)
    fd = os.open(tmp, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)
    fsync_dir(path.parent)


def _state_check(global_: np.ndarray, momentum: np.ndarray, residual: np.ndarray) -> str:
    return digest_bytes([np.ascontiguousarray(a, dtype=np.float32).tobytes() for a in (global_, momentum, residual)])


class DiskStore:
    def __init__(self, out: str | Path):
        self.out = Path(out)
        self.out.mkdir(parents=True, exist_ok=True)
        (self.out / PENDING_DIR).mkdir(exist_ok=True)
        self.tape = Tape(self.out)

    # ------------------------------------------------------------------ reading back

    def load(self) -> Durable:
        notes: list[Record] = []
        if self.tape.repaired_bytes:
            notes.append(Record("tape_repair", {"dropped_bytes": self.tape.repaired_bytes,
                                                "reason": "a torn last line (the syncer died while writing it)"}))
        checkpoint = None
        for name in (STATE_FILE, PREV_STATE_FILE):
            path = self.out / name
            if not path.exists():
                continue
            try:
                checkpoint = read_checkpoint(path)
                break
            except Exception as e:  # damage can surface as any parser's error (safetensors has its own)
                notes.append(Record("checkpoint_damaged", {"path": str(path), "reason": str(e)[:300]}))
        if checkpoint is None and any(n.event == "checkpoint_damaged" for n in notes):
            raise YetoError(f"every checkpoint in {self.out} is damaged ({notes[-1].fields['reason']}): move "
                            f"{self.out} aside and start a new run, or restore {STATE_FILE} from a backup")
        deltas = []
        for path in sorted((self.out / PENDING_DIR).glob("r*-l*.safetensors")):
            try:
                deltas.append(read_delta(path))
            except Exception as e:  # a damaged file: its island sends the delta again
                notes.append(Record("delta_damaged", {"path": str(path), "reason": str(e)[:300]}))
                path.unlink(missing_ok=True)
        return Durable(checkpoint, deltas, self.tape.read_all(), notes)

    # ------------------------------------------------------------------ writing

    def append(self, event: str, fields: dict[str, Any]) -> None:
        self.tape.append(event, **fields)

    def save_checkpoint(self, ck: Checkpoint) -> None:
        from safetensors.numpy import save_file

        self.tape.sync()
        meta = {"format": STATE_FORMAT, "version": str(ck.version), "layout": json.dumps(ck.layout.to_json()),
                "adapter_config": json.dumps(ck.adapter_config), "provenance": json.dumps(ck.provenance),
                "config": json.dumps(ck.config), "digest": ck.digest, "members": json.dumps(ck.members),
                "merged": json.dumps({str(k): v for k, v in ck.merged.items()}),
                "retired": json.dumps({str(k): v for k, v in ck.retired.items()}),
                "contract": json.dumps(ck.contract), "owners": json.dumps({str(k): v for k, v in ck.owners.items()}),
                "check": _state_check(ck.global_, ck.momentum, ck.residual)}
        state = self.out / STATE_FILE
        if state.exists():  # keep the one before as a fallback: link it aside first, so a state file always exists
            prev_tmp = self.out / f".{PREV_STATE_FILE}.tmp"
            prev_tmp.unlink(missing_ok=True)
            os.link(state, prev_tmp)
            os.replace(prev_tmp, self.out / PREV_STATE_FILE)
        _write_durably(state, lambda tmp: save_file({"global": ck.global_, "momentum": ck.momentum,
                                                     "residual": ck.residual}, str(tmp), metadata=meta))

    def write_adapter(self, ck: Checkpoint) -> Path:
        """The peft directory of the global adapter (derived from the checkpoint, so not part of durability)."""
        return write_adapter(self.out / "adapter", unflatten(ck.layout, ck.global_), ck.adapter_config,
                             {**ck.provenance, "syncer_version": ck.version, "merged_by": "syncer"})

    def save_delta(self, d: AcceptedDelta) -> None:
        from safetensors.numpy import save_file

        self.tape.sync()
        tensors = {f"frame{i}": np.frombuffer(f, dtype=np.uint8) for i, f in enumerate(d.frames)}
        _write_durably(self.delta_path(d.round, d.island),
                       lambda tmp: save_file(tensors, str(tmp), metadata={"delta": json.dumps(d.saved_fields())}))

    def drop_deltas(self, through_round: int = -1, rnd: int = -1, island: int = -1) -> None:
        self.tape.sync()
        for path in (self.out / PENDING_DIR).glob("r*-l*.safetensors"):
            r, lid = _delta_key(path)
            if r <= through_round or (r, lid) == (rnd, island):
                path.unlink(missing_ok=True)
        fsync_dir(self.out / PENDING_DIR)

    def close(self) -> None:
        self.tape.sync()
        self.tape.close()

    def delta_path(self, rnd: int, island: int) -> Path:
        return self.out / PENDING_DIR / f"r{rnd:08d}-l{island}.safetensors"


def _delta_key(path: Path) -> tuple[int, int]:
    r, _, lid = path.name.removesuffix(".safetensors").partition("-l")
    return int(r[1:]), int(lid)


def read_checkpoint(path: Path) -> Checkpoint:
    """A checkpoint whose arrays match the digests it was saved with (else ValueError)."""
    from safetensors import safe_open

    with safe_open(str(path), framework="numpy") as f:
        meta = f.metadata() or {}
        arrays = {k: f.get_tensor(k) for k in ("global", "momentum", "residual")}
    if meta.get("format") != STATE_FORMAT:
        raise ValueError(f"{path.name} is not a {STATE_FORMAT} checkpoint (format {meta.get('format')!r}): it was "
                         "written by another yeto version")
    check = _state_check(arrays["global"], arrays["momentum"], arrays["residual"])
    if array_digest(arrays["global"]) != meta["digest"] or check != meta["check"]:
        raise ValueError(f"{path.name}: content does not match its digest (damaged on disk)")
    config, contract = (in_current_words(json.loads(meta[k])) for k in ("config", "contract"))
    return Checkpoint(int(meta["version"]), layout_from_json(json.loads(meta["layout"])),
                      json.loads(meta["adapter_config"]), json.loads(meta["provenance"]), arrays["global"],
                      arrays["momentum"], arrays["residual"], meta["digest"], config,
                      json.loads(meta["members"]), {int(k): v for k, v in json.loads(meta["merged"]).items()},
                      {int(k): v for k, v in json.loads(meta["retired"]).items()}, contract,
                      {int(k): v for k, v in json.loads(meta["owners"]).items()})


def read_delta(path: Path) -> AcceptedDelta:
    from safetensors import safe_open

    with safe_open(str(path), framework="numpy") as f:
        fields = in_current_words(json.loads((f.metadata() or {})["delta"]))
        frames = tuple(f.get_tensor(f"frame{i}").tobytes() for i in range(len(fields["descs"])))
    d = AcceptedDelta(**fields, frames=frames)
    if digest_bytes(d.frames) != d.digest:
        raise ValueError(f"{path.name}: payload does not match its digest (damaged on disk)")
    return d


def load_init_adapter(name: str) -> InitAdapter:
    """`--init-adapter NAME`: the adapter's config, recorded base and tensors (numpy: the syncer needs no torch)."""
    adapter_dir = resolve_adapter_dir(name)
    return InitAdapter(name, json.loads((adapter_dir / ADAPTER_CONFIG).read_text()),
                       recorded_base_revision(adapter_dir), read_adapter(adapter_dir))
