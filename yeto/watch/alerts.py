"""The dashboard's alerts: what needs a person's eye, each naming the island and the likely cause from the tape.

A pure function of the tape's events and the snapshot folded from them (`yeto.watch.snapshot`):

- late: an island left out of the last LATE_ROUNDS merges in a row (a straggler each time), the cause read from
  its last delta: slow inner steps against the fleet's median, a slow push, or no delta at all;
- crash loop: an island that started CRASH_SESSIONS sessions within CRASH_WINDOW_S, with its last leave's reason;
- low utilization: an island computing under `min_utilization` of its wall time, with where its rounds' time goes;
- loss rising: the merged loss rose over the last RISING_MERGES merges, naming the island whose loss rose most.
"""

from __future__ import annotations

from statistics import median
from typing import Any, Optional

LATE_ROUNDS = 3
CRASH_SESSIONS = 3
CRASH_WINDOW_S = 600.0
MIN_UTILIZATION = 0.5
RISING_MERGES = 2
SLOW_FACTOR = 1.5  # inner steps this many times the fleet's median: slow compute


def _late(events: list[dict[str, Any]], timeline: list[dict[str, Any]]) -> list[dict[str, Any]]:
    merges = [e for e in events if e.get("event") == "merge"]
    if len(merges) < LATE_ROUNDS:
        return []
    recent = merges[-LATE_ROUNDS:]
    out = []
    for lid in sorted(set.intersection(*(set(m.get("stragglers") or []) for m in recent))):
        mine = [t for t in timeline if t["island"] == lid]
        others = [t["inner_steps"] for t in timeline if t["island"] != lid]
        deltas = [e for e in events if e.get("event") == "delta" and e.get("island") == lid]
        if not deltas:
            cause = "no delta from it on the tape since it joined: check its log (yeto logs --island)"
        elif mine and others and mine[-1]["inner_steps"] > SLOW_FACTOR * median(others):
            cause = (f"slow inner steps: {mine[-1]['inner_steps']:.1f}s against the fleet's median "
                     f"{median(others):.1f}s (a slower device, or fewer --inner-steps for it)")
        elif mine and mine[-1]["push"] > mine[-1]["inner_steps"]:
            cause = f"slow push: {mine[-1]['push']:.1f}s to send its delta (its link to the syncer)"
        else:
            cause = (f"its deltas arrive after the merges (last for round {deltas[-1]['round']}, lag "
                     f"{deltas[-1].get('lag', 0)}): slow inner steps or link")
        out.append({"island": lid, "kind": "late", "what": f"late for the last {LATE_ROUNDS} rounds", "cause": cause})
    return out


def _crash_loops(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    sessions: dict[int, dict[str, float]] = {}
    last_leave: dict[int, str] = {}
    for e in events:
        lid = e.get("island")
        if e.get("event") == "join" and isinstance(lid, int):
            sessions.setdefault(lid, {}).setdefault(e.get("session") or str(e.get("seq")), e["time"])
        elif e.get("event") == "leave" and isinstance(lid, int):
            last_leave[lid] = str(e.get("reason") or "no reason recorded")
    out = []
    for lid, starts in sorted(sessions.items()):
        times = sorted(starts.values())
        if len(times) >= CRASH_SESSIONS and times[-1] - times[-CRASH_SESSIONS] <= CRASH_WINDOW_S:
            out.append({"island": lid, "kind": "crash_loop",
                        "what": f"crash-looping: {CRASH_SESSIONS} sessions within "
                                f"{times[-1] - times[-CRASH_SESSIONS]:.0f}s",
                        "cause": f"its last leave: {last_leave.get(lid, 'none recorded')}"})
    return out


def _low_utilization(fleet: list[dict[str, Any]], timeline: list[dict[str, Any]],
                     min_utilization: float) -> list[dict[str, Any]]:
    out = []
    for row in fleet:
        u = row.get("utilization")
        if u is None or u >= min_utilization or row.get("state") in ("gone", "done", "given up", "not joined"):
            continue
        mine = [t for t in timeline if t["island"] == row["island"]]
        spent = {k: sum(t[k] for t in mine) for k in ("inner_steps", "push", "waiting", "merge", "broadcast")}
        worst = max((k for k in spent if k != "inner_steps"), key=spent.get) if mine else None
        cause = (f"most of its idle time is {worst.replace('_', ' ')} ({spent[worst]:.1f}s over {len(mine)} rounds)"
                 if worst else "no merged round of it on the tape yet")
        out.append({"island": row["island"], "kind": "low_utilization",
                    "what": f"utilization {100 * u:.0f}% (under {100 * min_utilization:.0f}%)", "cause": cause})
    return out


def _loss_rising(curves: dict[str, Any]) -> list[dict[str, Any]]:
    merged = curves.get("merged") or []
    if len(merged) < RISING_MERGES + 1:
        return []
    tail = [y for _, y in merged[-(RISING_MERGES + 1):]]
    if not all(b > a for a, b in zip(tail, tail[1:])):
        return []
    first_round = merged[-(RISING_MERGES + 1)][0]
    rises: dict[int, float] = {}
    for lid, pts in (curves.get("islands") or {}).items():
        mine = {r: y for r, y in pts}
        if first_round in mine and pts:
            rises[int(lid)] = pts[-1][1] - mine[first_round]
    worst: Optional[int] = max(rises, key=rises.get) if rises else None
    return [{"island": worst, "kind": "loss_rising",
             "what": f"merged loss rose for {RISING_MERGES} merges ({tail[0]:.4f} -> {tail[-1]:.4f})",
             "cause": (f"island {worst}'s loss rose most ({rises[worst]:+.4f}): its data or --lr"
                       if worst is not None else "no island's loss recorded")}]


def alerts(snap: dict[str, Any], events: list[dict[str, Any]],
           min_utilization: float = MIN_UTILIZATION) -> list[dict[str, Any]]:
    """Every alert the run raises now, in a stable order: late, crash loops, low utilization, rising loss."""
    return (_late(events, snap["timeline"]) + _crash_loops(events)
            + _low_utilization(snap["fleet"], snap["timeline"], min_utilization) + _loss_rising(snap["curves"]))
