"""Islands the fleet controller stopped bringing back, handed to the syncer through its --out directory.

The controller (`yeto.launch.controller`) runs beside the syncer on the head; one file per island,
`<out>/given-up/<id>`, holding the reason, is the whole channel: it survives a syncer restart, needs no
port and no key, and `ls` shows it. The syncer rescans it as it rescans its keys and lowers its quorum.
"""

from __future__ import annotations

import os
from pathlib import Path

GIVEN_UP_DIR = "given-up"


def give_up(out: str | Path, island: int, reason: str) -> Path:
    """Tell the syncer whose --out this is that `island` is not coming back (atomic, idempotent)."""
    folder = Path(out) / GIVEN_UP_DIR
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / str(island)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(reason)
    os.replace(tmp, path)
    return path


def read_given_up(out: str | Path) -> dict[int, str]:
    """Island id -> reason, for every well-formed entry (anything else in the folder is ignored)."""
    folder = Path(out) / GIVEN_UP_DIR
    if not folder.is_dir():
        return {}
    found = {}
    for path in folder.iterdir():
        if path.name.isdigit() and path.is_file():
            found[int(path.name)] = path.read_text(errors="replace").strip() or "given up"
    return found


def clear_given_up(out: str | Path, island: int) -> bool:
    """Take back the give-up of `island` (it is started again, or it rejoined): a syncer (re)started on this --out
    counts on it again. True when there was one."""
    path = Path(out) / GIVEN_UP_DIR / str(island)
    try:
        path.unlink()
    except FileNotFoundError:
        return False
    return True
