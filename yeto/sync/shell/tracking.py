"""What the syncer tells its trackers (`yeto syncer --report-to`): one record per merge, made from the events the
tape records (the core stays pure: this reads what the shell appends), at the merge's version.

Per merge: responders, stragglers, update norm, grace, merge time (the merge's batch of actions: checkpoint and
broadcast included), round time (from the round's opening), quorum waits and rejoins since the last merge, and per
island its weight, its delta's lag and its robust-merge clip factor.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Optional

from yeto.report.trackers import Trackers, flat_metrics, per_island


class MergeTracking:
    """Fed every tape event (`on_event`) and each merge's duration (`merged`); logs to `trackers`, never waiting on
    them (yeto.report.trackers.Trackers queues)."""

    def __init__(self, trackers: Trackers, clock: Callable[[], float] = time.monotonic):
        self.trackers, self.clock = trackers, clock
        self.opened: dict[int, float] = {}  # round -> when it opened
        self.merge: Optional[dict[str, Any]] = None  # the merge recorded in the batch being executed
        self.quorum_waits = 0
        self.rejoins = 0

    def on_event(self, event: str, fields: dict[str, Any]) -> None:
        if event == "round_open":
            self.opened[fields["round"]] = self.clock()
        elif event == "quorum_wait":
            self.quorum_waits += 1
        elif event == "join" and fields.get("rejoin"):
            self.rejoins += 1
        elif event == "contract":
            self.trackers.log_config({"contract": fields})
        elif event == "merge":
            self.merge = fields

    def merged(self, seconds: float) -> None:
        """The merge's batch ran (its checkpoint written, its broadcast sent) in `seconds`."""
        f, self.merge = self.merge, None
        if f is None:
            return
        ids = list(f.get("responders") or [])
        opened = self.opened.pop(f["round"], None)
        metrics = flat_metrics("merge", {
            "responders": len(ids), "stragglers": len(f.get("stragglers") or []), "update_norm": f.get("update_norm"),
            "grace_s": f.get("grace_s"), "merge_s": seconds, "round": f["round"],
            "round_s": self.clock() - opened if opened is not None else None,
            "quorum_waits": self.quorum_waits, "rejoins": self.rejoins, "clip": f.get("clip") or {}})
        metrics.update(per_island("merge", ids, weight=f.get("weights"), lag=f.get("lags")))
        self.trackers.log(int(f["version"]), metrics)
        self.quorum_waits = self.rejoins = 0

    def finish(self) -> None:
        self.trackers.finish()
