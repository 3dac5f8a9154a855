"""`yeto launch` onto a run directory that holds a run: continue it, refuse before anything starts, or start over.

A local fleet keeps everything in its --out: the syncer's tape and checkpoint in `syncer/`, each island's training
state in `island-I/`. Launched again on it, the run goes on to the new --outer-steps (the syncer resumes its tape,
every island its state, and the give-ups of the islands started again are taken back); a launch that could not go
on (nothing left to merge, flags the saved run contradicts) is refused in one line saying which flag does what;
`--fresh` removes what the run saved (the run's credentials and join files stay) and starts it over everywhere.
"""

from __future__ import annotations

import copy
import shutil
from pathlib import Path
from typing import Optional

from yeto import YetoError
from yeto.island.checkpoint import RUN_FIELDS, differences, load_state
from yeto.island.train_config import TrainConfig
from yeto.launch.registry import ISLAND_DIR, SYNCER_DIR
from yeto.sync.core.actions import Checkpoint
from yeto.sync.core.config import SyncerConfig
from yeto.sync.shell.given_up import clear_given_up
from yeto.sync.shell.keys import JOIN_KEY_FILE, KEYS_DIR
from yeto.sync.shell.store import PREV_STATE_FILE, STATE_FILE, read_checkpoint

LOGS_DIR = "logs"  # <out>/logs/<process>.log: what `yeto logs` follows
CREDENTIALS = (JOIN_KEY_FILE, KEYS_DIR)  # what --fresh keeps of the syncer's directory: join scripts still work
# the island flags a saved state must agree with to go on (its id and shard count are each island's own)
ISLAND_FLAGS = tuple(f for f in RUN_FIELDS if f not in ("island_id", "num_islands"))


def island_dir(out: str | Path, island: int) -> Path:
    """A local island's --out inside the run directory."""
    return Path(out) / f"{ISLAND_DIR}{island}"


def saved_checkpoint(syncer_out: Path) -> Optional[Checkpoint]:
    """The syncer's checkpoint in `syncer_out` (the previous one if the last is damaged), or None."""
    for name in (STATE_FILE, PREV_STATE_FILE):
        if (syncer_out / name).is_file():
            try:
                return read_checkpoint(syncer_out / name)
            except Exception:  # (damage can surface as any parser's error: the syncer reports it, as it starts)
                continue
    return None


def check_run_dir(out: str | Path, syncer: SyncerConfig, island: TrainConfig, islands: list[int],
                  fresh: bool) -> str:
    """What a local launch on `out` does with the run it holds, as one line ('' : a new run), or a YetoError saying
    why it cannot go on and which flag does what. `islands`: the ids of the islands started here."""
    out = Path(out)
    ck = saved_checkpoint(out / SYNCER_DIR)
    states = {i: state for i in islands if (state := load_state(island_dir(out, i))) is not None}
    if fresh:
        return f"--fresh: starting the run in {out} over (its saved state removed, its keys kept)" if (
            ck is not None or states or (out / SYNCER_DIR).is_dir()) else ""
    if ck is None:
        if states:
            raise YetoError(f"{island_dir(out, min(states))} holds an island's state but {out / SYNCER_DIR} no "
                            "syncer checkpoint to continue: pass --fresh to start the run over, or use another --out")
        return ""
    if syncer.outer_steps <= ck.version:
        raise YetoError(f"{out} holds a run at version {ck.version} (of --outer-steps {ck.config.get('outer_steps')}"
                        f"): pass --outer-steps above {ck.version} to extend it, --fresh to start it over, or use "
                        "another --out")
    try:
        copy.deepcopy(syncer).check_resume(ck.config, ck.version)
    except YetoError as e:
        raise YetoError(f"{e} (--fresh starts the run in {out} over)") from None
    for i, state in states.items():
        saved = {k: v for k, v in state.meta.get("run", {}).items() if k in ISLAND_FLAGS}
        diff = differences(saved, {k: getattr(island, k) for k in saved})
        if diff:
            raise YetoError(f"{island_dir(out, i)} holds island {i}'s state under other flags ({'; '.join(diff)}): "
                            "launch with its flags to continue the run, --fresh to start it over, or use another --out")
    return (f"continuing the run in {out}: the syncer from version {ck.version} to --outer-steps "
            f"{syncer.outer_steps}, {len(states)} island(s) from their saved state")


def prepare_run_dir(out: str | Path, islands: list[int], fresh: bool) -> None:
    """Just before the syncer starts: --fresh removes what the run saved (keeping its credentials); either way the
    islands started here are no longer given up."""
    out = Path(out)
    syncer_out = out / SYNCER_DIR
    if fresh:
        for path in (syncer_out.iterdir() if syncer_out.is_dir() else ()):
            if path.name in CREDENTIALS:
                continue
            if path.is_dir():
                shutil.rmtree(path)
            else:
                path.unlink()
        for path in [*(island_dir(out, i) for i in islands), out / LOGS_DIR]:
            shutil.rmtree(path, ignore_errors=True)
    for i in islands:
        clear_given_up(syncer_out, i)
