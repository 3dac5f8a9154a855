"""The event tape: an append-only JSONL record of everything the syncer did.

One line per event (`seq`, `time`, `event`, fields). The syncer writes it; `yeto
tape DIR` reads it back as a table per round, and `--plot` draws the loss and
each island's contribution over rounds.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

from yeto import in_current_words

log = logging.getLogger(__name__)

TAPE_FILE = "tape.jsonl"
# events the summary prints one by one: what went wrong, and how the run recovered
NOTABLE = ("refuse", "reject", "quorum_wait", "leave", "supersede", "refuse_delta", "resume", "rollback", "discard",
           "send_dropped", "internal_error", "tape_repair", "checkpoint_damaged", "adapter_write_failed", "keys")


class Tape:
    """The syncer's writer: one JSON line per event, `seq` counting from 0 across restarts.

    Opening an existing tape cuts off a torn last line (the syncer died while writing
    it; nothing after it was ever fsynced), so the next event continues the sequence.
    """

    def __init__(self, out_dir: str | Path):
        self.path = Path(out_dir) / TAPE_FILE
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.repaired_bytes = 0
        self.seq = self._repair() if self.path.exists() else 0
        self._f = open(self.path, "a", buffering=1)

    def _repair(self) -> int:
        data = self.path.read_bytes()
        keep = data.rfind(b"\n") + 1
        if keep and keep == len(data):
            last = data[data.rfind(b"\n", 0, keep - 1) + 1 : keep]
            try:
                json.loads(last)
            except (json.JSONDecodeError, UnicodeDecodeError):
                keep = data.rfind(b"\n", 0, keep - 1) + 1  # a complete but garbled last line: torn too
        if keep < len(data):
            with open(self.path, "r+b") as f:
                f.truncate(keep)
                f.flush()
                os.fsync(f.fileno())
            self.repaired_bytes = len(data) - keep
        return data[:keep].count(b"\n")

    def read_all(self) -> list[dict[str, Any]]:
        return read_tape(self.path)

    def append(self, event: str, **fields: Any) -> dict[str, Any]:
        rec = {"seq": self.seq, "time": round(time.time(), 4), "event": event, **fields}
        self._f.write(json.dumps(rec, separators=(",", ":")) + "\n")
        self.seq += 1
        return rec

    def sync(self) -> None:
        """Flush to disk (before anything durable, so the tape is never behind the state)."""
        self._f.flush()
        os.fsync(self._f.fileno())

    def close(self) -> None:
        self._f.close()


def read_tape(path: str | Path) -> list[dict[str, Any]]:
    """Every event of a tape. Only its last line may be torn (a syncer that died, or is still writing, mid-line):
    that line is left out and said on stderr; a garbled line before it is damage, an error naming the line."""
    from yeto import YetoError

    p = Path(path)
    if p.is_dir():
        p = p / TAPE_FILE
    if not p.is_file():
        raise YetoError(f"no event tape at {p}")
    lines = p.read_bytes().split(b"\n")
    events = []
    for lineno, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            events.append(in_current_words(json.loads(line)))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            if any(rest.strip() for rest in lines[lineno:]):
                raise YetoError(f"{p}:{lineno}: the tape is damaged ({type(e).__name__}) before its last line; "
                                "restore it from a copy (the syncer never rewrites a line)") from e
            log.warning("%s:%d: a torn last line (the syncer died or is writing it), left out", p, lineno)
    return events


def rounds(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per merged round: responders, weights, tokens, bytes, mean loss, and the task scores its deltas reported
    (`task_eval`: each responder's latest score of a global, --eval-task)."""
    deltas: dict[int, list[dict]] = defaultdict(list)
    out = []
    for e in events:
        if e["event"] == "delta":
            deltas[e["round"]].append(e)
        elif e["event"] == "rollback":  # that merge never happened (its checkpoint was not durable)
            out = [r for r in out if r["version"] != e["version"]]
        elif e["event"] == "merge":
            ds = {d["island"]: d for d in deltas.get(e["round"], [])}
            out.append({
                "round": e["round"],
                "version": e.get("version"),
                "responders": e["responders"],
                "weights": e["weights"],
                "tokens": [ds[r]["loss_tokens"] for r in e["responders"] if r in ds],
                "bytes": sum(ds[r]["bytes"] for r in e["responders"] if r in ds),
                "loss": {r: ds[r]["loss"] for r in e["responders"] if r in ds},
                "task_eval": {r: ds[r]["task_eval"] for r in e["responders"] if r in ds and ds[r].get("task_eval")},
                "update_norm": e.get("update_norm"),
                "seconds": e.get("seconds"),
            })
    return out


def task_scores(scores: dict[int, dict[str, Any]]) -> str:
    """A round's task scores as `yeto tape` shows them: each responder's accuracy of the global it scored
    ("0: 42.5% of v3, 1: 41.0% of v3"), "-" when none reported one."""
    return ", ".join(f"{island}: {100 * t['accuracy']:.1f}% of v{t['version']}" for island, t in scores.items()) or "-"


def summarize(path: str | Path) -> None:
    from rich.console import Console
    from rich.table import Table

    events = read_tape(path)
    counts: dict[str, int] = defaultdict(int)
    for e in events:
        counts[e["event"]] += 1
    table = Table(title=f"event tape {path}: {len(events)} events")
    merged = rounds(events)
    scored = any(r["task_eval"] for r in merged)
    columns = ("round", "responders", "weights", "loss-bearing tokens", "bytes in", "mean loss", "|update|") + (
        ("task acc",) if scored else ())
    for col in columns:
        table.add_column(col, justify="left" if col in ("responders", "task acc") else "right")
    for r in merged:
        losses = list(r["loss"].values())
        row = [str(r["round"]), ", ".join(map(str, r["responders"])),
               ", ".join(f"{w:.3f}" for w in r["weights"]), ", ".join(map(str, r["tokens"])), f"{r['bytes']:,}",
               f"{sum(losses) / len(losses):.4f}" if losses else "-",
               f"{r['update_norm']:.4g}" if r["update_norm"] is not None else "-"]
        if scored:
            row.append(task_scores(r["task_eval"]))
        table.add_row(*row)
    console = Console()
    console.print(table)
    console.print("events: " + ", ".join(f"{k} {v}" for k, v in sorted(counts.items())))
    for e in events:
        if e["event"] in NOTABLE:
            fields = {k: v for k, v in e.items() if k not in ("seq", "time", "event")}
            console.print(f"[yellow]{e['event']}[/yellow] " + json.dumps(fields))


def plot(path: str | Path, png: str | Path | None = None) -> Path:
    """Loss per island and each island's merge weight, over rounds."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rs = rounds(read_tape(path))
    if not rs:
        from yeto import YetoError

        raise YetoError(f"{path}: the tape has no merges to plot")
    islands = sorted({r for x in rs for r in x["responders"]})
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(8, 7), sharex=True)
    for lid in islands:
        pts = [(x["round"], x["loss"][lid]) for x in rs if lid in x["loss"]]
        ax1.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=f"island {lid}")
    ax1.set_ylabel("mean inner loss in round")
    ax1.legend()
    ax1.grid(alpha=0.3)
    bottom = [0.0] * len(rs)
    for lid in islands:
        w = [x["weights"][x["responders"].index(lid)] if lid in x["responders"] else 0.0 for x in rs]
        ax2.bar([x["round"] for x in rs], w, bottom=bottom, label=f"island {lid}")
        bottom = [b + v for b, v in zip(bottom, w)]
    ax2.set_ylabel("merge weight (token share)")
    ax2.set_xlabel("outer round")
    from matplotlib.ticker import MaxNLocator

    ax2.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax2.legend()
    fig.suptitle("yeto: loss and per-island contribution")
    fig.tight_layout()
    base = Path(path)
    out = Path(png) if png else (base if base.is_dir() else base.parent) / "tape.png"
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
