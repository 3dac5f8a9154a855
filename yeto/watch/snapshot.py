"""What `yeto dashboard` shows, as one JSON-ready snapshot folded from a run's files: no I/O here.

`snapshot(events, islands, now)` reads the syncer's tape (its events, in order) and what each island wrote
(`IslandFiles`: its run.json, metrics.jsonl events and summary.json, where this machine has them) into:

- `fleet`: one row per island: backend, tier (trusted, bounded, extra), device, state (alive, late, gone, done,
  given up), the version it was last sent, its last delta (round, seconds ago), that delta's lag, tokens/s over its
  inner steps, utilization (compute over wall time since it joined);
- `curves`: each island's mean inner loss per round (from its deltas), the merged loss per round (the merge
  weights over the responders' losses) and the islands' eval losses (their metrics, at round = step / inner steps);
  for a standalone run (`yeto train` without --syncer: no tape, `run["standalone"]`) its loss per step and its eval
  losses at their steps; `curves["task"]`: each island's accuracy on its --eval-task (its metrics' `task_eval`
  events) with its 95% interval, at the version it scored (the rounds merged into it; without one, at step / inner
  steps as eval losses are; a standalone run: at its step), empty for a run that evaluates no task;
- `timeline`: per round and island, where the time went: inner steps, push, waiting, merge, broadcast (seconds
  from the round's opening, from the tape's own timestamps);
- `bytes`: delta bytes in per round; `events`: staleness (lag > 0), clips and the tape's notable events.

The tape's per-round table (`yeto.sync.shell.tape.rounds`) gives responders, weights, losses and bytes, as for
`yeto tape --plot`; the fleet rows start from `yeto status`'s fold (`yeto.launch.manage.fleet_view`).
Nothing secret is copied: only the named fields below (never the join key, keys or session ids).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from statistics import median
from typing import Any, Optional

from yeto.launch.manage import ALIVE, IslandRow, fleet_view
from yeto.sync.shell.tape import NOTABLE, rounds

LATE = "late"  # the dashboard's one state beyond `yeto status`'s (yeto.launch.manage's words)
LATE_FACTOR = 2.0  # an island is late once the open round has run this many median rounds without its delta
MAX_EVENTS = 200  # the page lists the newest events only


@dataclass
class IslandFiles:
    """What one island's directory holds (all optional: a cloud island's files are not on this machine)."""

    island: int
    run: dict[str, Any] = field(default_factory=dict)  # run.json
    metrics: list[dict[str, Any]] = field(default_factory=list)  # metrics.jsonl events
    summary: dict[str, Any] = field(default_factory=dict)  # summary.json (a finished island)


def _fields(e: dict[str, Any], *names: str) -> dict[str, Any]:
    return {n: e[n] for n in names if n in e}


def _timeline(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per round and responder: inner steps, push, waiting, merge, broadcast, in seconds from the round's opening.

    The island's inner steps are its delta's `compute_s`; push is the rest until the syncer accepted the delta;
    waiting lasts until the round's last delta arrived; merge until the merge event; broadcast until the broadcast.
    """
    opened: dict[int, float] = {}
    deltas: dict[int, list[dict[str, Any]]] = {}
    merges: dict[int, dict[str, Any]] = {}
    out = []
    for e in events:
        kind, rnd = e.get("event"), e.get("round")
        if kind == "round_open":
            opened[rnd] = e["time"]
            deltas[rnd] = []
        elif kind == "delta":
            deltas.setdefault(rnd, []).append(e)
        elif kind == "merge":
            merges[rnd] = e
        elif kind == "broadcast" and rnd in merges and rnd in opened:
            m, t0 = merges[rnd], opened[rnd]
            used = [d for d in deltas.get(rnd, []) if d["island"] in m.get("responders", [])]
            if not used:
                continue
            last_in = max(d["time"] for d in used)
            for d in used:
                compute = min(float(d.get("compute_s") or 0.0), d["time"] - t0)
                out.append({"round": rnd, "island": d["island"], "inner_steps": compute,
                            "push": max(0.0, d["time"] - t0 - compute), "waiting": last_in - d["time"],
                            "merge": max(0.0, m["time"] - last_in), "broadcast": max(0.0, e["time"] - m["time"])})
    return out


def _task_points(files: IslandFiles, inner_steps: int, standalone: bool) -> list[dict[str, Any]]:
    """An island's `task_eval` events as chart points: x (see `snapshot`), accuracy, its interval, what it scored."""
    out = []
    for m in files.metrics:
        if m.get("event") != "task_eval" or m.get("accuracy") is None:
            continue
        x = m.get("step") if standalone else m["version"] if m.get("version") is not None else (
            m["step"] / inner_steps if m.get("step") is not None else None)
        if x is not None:
            out.append({"x": x, **_fields(m, "accuracy", "low", "high", "n", "task", "round", "version", "step")})
    return out


def _standalone_state(files: IslandFiles) -> str:
    """A standalone run has no tape: its own files say whether it finished (summary.json) or stopped early."""
    if files.summary:
        return "done"
    return "stopped" if any(m.get("event") == "aborted" for m in files.metrics) else "training"


def _state(lid: int, row: IslandRow, open_round: Optional[dict[str, Any]], sent: set[int], typical: Optional[float],
           now: float, finished: bool) -> str:
    """`yeto status`'s word for the island (`IslandRow.state`), or late: alive, its delta overdue."""
    state = row.state(finished)
    overdue = (open_round is not None and bool(typical) and lid not in sent and lid in open_round.get("members", [lid])
               and now - open_round["time"] > LATE_FACTOR * typical)
    return LATE if state == ALIVE and overdue else state


def snapshot(events: list[dict[str, Any]], islands: dict[int, IslandFiles], now: float,
             run: Optional[dict[str, Any]] = None) -> dict[str, Any]:
    """The dashboard's whole state for one moment. `run`: name, directory, kind and costs, as the shell knows them."""
    view = fleet_view(events)
    standalone = bool((run or {}).get("standalone")) and not events
    per_round = rounds(events)
    start = next((e for e in events if e.get("event") == "start"), {})
    inner_steps = (start.get("config") or {}).get("inner_steps") or 1
    open_round, sent, joined_at = None, set(), {}
    last_delta: dict[int, dict[str, Any]] = {}
    compute: dict[int, float] = {}
    version_sent: dict[int, int] = {}
    for e in events:
        kind, lid = e.get("event"), e.get("island")
        if kind == "round_open":
            open_round, sent = e, set()
        elif kind == "delta":
            sent.add(lid)
            last_delta[lid] = e
            compute[lid] = compute.get(lid, 0.0) + float(e.get("compute_s") or 0.0)
        elif kind == "merge" and open_round is not None and e.get("round") == open_round.get("round"):
            open_round = None
        elif kind == "join" and isinstance(lid, int):
            joined_at.setdefault(lid, e["time"])
        elif kind == "broadcast":
            for t in e.get("to", []):
                version_sent[t] = e.get("version")
        elif kind == "init" and isinstance(lid, int):
            version_sent[lid] = 0
    if view.finished:
        open_round = None
    round_times = [b["time"] - a["time"] for a, b in zip(
        [e for e in events if e.get("event") == "round_open"], [e for e in events if e.get("event") == "merge"])]
    typical = median(round_times) if round_times else None
    end = events[-1]["time"] if view.finished and events else now
    fleet = []
    for lid in sorted(set(view.islands) | set(islands)):
        row = view.islands.get(lid) or IslandRow(lid)
        files = islands.get(lid, IslandFiles(lid))
        d = last_delta.get(lid, {})
        cfg = files.run.get("config") or {}
        wall = (end - joined_at[lid]) if lid in joined_at else None
        utilization = files.summary.get("utilization")
        if utilization is None and wall and lid in compute:
            utilization = min(1.0, compute[lid] / wall)
        steps = [m for m in files.metrics if m.get("event") == "step"]
        tokens_per_s = (round(d["tokens"] / d["compute_s"], 1) if d.get("compute_s") else
                        round(steps[-1]["tok_s"], 1) if standalone and steps and "tok_s" in steps[-1] else None)
        fleet.append({
            "island": lid, "backend": row.backend if row.backend != "?" else files.run.get("backend", "?"),
            "tier": row.tier, "device": cfg.get("device", "?"),
            "state": _standalone_state(files) if standalone else _state(lid, row, open_round, sent, typical, now,
                                                                        view.finished is not None),
            "version": version_sent.get(lid), "merges": row.answered,
            "last_delta_round": d.get("round"), "last_delta_ago": round(now - d["time"], 1) if d else None,
            "lag": d.get("lag"),
            "tokens_per_s": tokens_per_s,
            "utilization": round(utilization, 3) if utilization is not None else None,
            "given_up_reason": row.given_up_reason,
        })
    ids = sorted({r for x in per_round for r in x["responders"]} | set(islands))
    curves = {
        "rounds": [x["round"] for x in per_round],
        "islands": {str(lid): [[x["round"], x["loss"][lid]] for x in per_round if lid in x["loss"]]
                    for lid in ids},
        "merged": [[x["round"], sum(w * x["loss"][r] for r, w in zip(x["responders"], x["weights"]) if r in x["loss"])
                    / (sum(w for r, w in zip(x["responders"], x["weights"]) if r in x["loss"]) or 1.0)]
                   for x in per_round if x["loss"]],
        "eval": {str(lid): [[m["step"] / inner_steps, m["eval_loss"]] for m in f.metrics
                            if m.get("event") == "eval" and m.get("eval_loss") is not None]
                 for lid, f in sorted(islands.items())},
        "steps": {str(lid): [[m["step"], m["loss"]] for m in f.metrics if m.get("event") == "step" and "loss" in m]
                  for lid, f in sorted(islands.items())} if standalone else {},
        "task": {str(lid): points for lid, f in sorted(islands.items())
                 if (points := _task_points(f, inner_steps, standalone))},
    }
    notable = []
    for e in events:
        if e.get("event") == "merge":
            for lid, lag in zip(e.get("responders", []), e.get("lags", [])):
                if lag:
                    notable.append({"time": e["time"], "event": "stale", "round": e["round"], "island": lid,
                                    "lag": lag})
            for lid, factor in (e.get("clip") or {}).items():
                notable.append({"time": e["time"], "event": "clip", "round": e["round"], "island": int(lid),
                                "factor": factor})
        elif e.get("event") in NOTABLE or e.get("event") == "given_up":
            notable.append(_fields(e, "time", "event", "round", "island", "version", "reason", "code", "what"))
    return {
        "run": {**(run or {}), "standalone": standalone, "version": view.version, "outer_steps": view.outer_steps,
                "finished": (next((r["state"] for r in fleet if r["state"] != "training"), None) if standalone
                             else view.finished),
                "rounds_merged": len(per_round), "events": len(events), "now": now,
                "started": events[0]["time"] if events else None,
                "open_round": open_round.get("round") if open_round else None},
        "fleet": fleet,
        "curves": curves,
        "timeline": _timeline(events),
        "bytes": [[x["round"], x["bytes"]] for x in per_round],
        "events": notable[-MAX_EVENTS:],
    }
