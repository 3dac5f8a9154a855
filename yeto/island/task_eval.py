"""Accuracy on a task during a run (`--eval-task`): the island scores the adapter it holds at the start, every
`--eval-task-every` rounds (standalone: steps) and at the end, through its backend's greedy, batched `generate`
(`yeto.eval.task.evaluate_task`). Each evaluation is a `task_eval` event in metrics.jsonl (and the trackers' "task/"
numbers) and a console line; summary.json gets the first and last accuracy and what the evaluations cost.

What it costs. Standalone, training stops for each evaluation: its seconds are its cost. In a fleet the island
evaluates a round's global (the merged adapter it just took) after pushing that round's delta, while it waits for the
merge, where it would otherwise sit idle (with --overlap: instead of some of the steps it trains on meanwhile, which
the next round would have had). An evaluation that outlasts the wait holds the island's next round back: `held_s` is
that part, counted from the last batch boundary at which the island was still waiting (so at most one batch more than
it held) to the evaluation's end, per event and in all (summary.json's task_eval_held_s). A fleet whose other islands
wait for this one loses up to that much round time; past the round's --grace its delta goes late instead (merged a
version later). The end's evaluation comes after the run's last merge and holds nothing.
(What that came to on a local fleet: docs/benchmarks.md, "Accuracy during a run".)
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Optional

import numpy as np

from yeto.eval.task import Task, evaluate_task, load_task

if TYPE_CHECKING:
    from yeto.island.interface import Island
    from yeto.island.train_config import TrainConfig

EVENT = "task_eval"  # the metrics.jsonl event (and the trackers' "task/" numbers: yeto.island.metrics.TRACKED)


def load_eval_task(cfg: TrainConfig) -> Optional[Task]:
    """--eval-task's task (None without it), loaded before any model: a bad file or name is one line."""
    if not cfg.eval_task:
        return None
    return load_task(cfg.eval_task, limit=cfg.eval_task_limit)


@dataclass
class PendingEval:
    """A round's global, kept to be scored while the island waits for that round's merge."""

    round: int
    version: int
    adapter: np.ndarray  # flat, in the run's layout
    step: int  # the island's step count when it took the global (the event's step: where the curve puts it)


@dataclass
class WaitWatch:
    """Whether an evaluation that runs in a merge wait is still inside it, seen between batches: the part after the
    wait ended (from the last time it was seen waiting, so at most one batch more than it held) holds the round."""

    waiting: Callable[[], bool]
    last_seen: Optional[float]  # when it was last seen waiting (None: not waiting when the evaluation began)
    over: bool  # the wait is over

    @classmethod
    def begin(cls, waiting: Callable[[], bool], now: float) -> WaitWatch:
        inside = waiting()
        return cls(waiting, now if inside else None, not inside)

    def check(self, done: int, total: int) -> None:
        """evaluate_task's progress callback, between batches."""
        if self.over:
            return
        if self.waiting():
            self.last_seen = time.perf_counter()
        else:
            self.over = True

    def held(self, start: float, end: float) -> float:
        """The seconds of the evaluation [start, end] that held the island's next round."""
        if not self.over:
            return 0.0
        return end - (self.last_seen if self.last_seen is not None else start)


@dataclass
class TaskEvals:
    """One run's evaluations on its task: when they are due, the events they write, what they cost."""

    task: Task
    every: int  # rounds (a fleet) or steps (standalone) between evaluations; 0: the start and the end only
    max_new_tokens: int
    report: Callable[[dict[str, Any]], None]  # each event: to metrics.jsonl, the trackers and the console
    events: list[dict[str, Any]] = field(default_factory=list)
    seconds: float = 0.0
    held_s: float = 0.0
    pending: Optional[PendingEval] = None
    last_round: Optional[int] = None  # the last round whose global was taken to score

    @classmethod
    def of(cls, cfg: TrainConfig, task: Task, report: Callable[[dict[str, Any]], None]) -> TaskEvals:
        return cls(task, cfg.eval_task_every, cfg.eval_task_max_new_tokens, report)

    def due_round(self, round_: int) -> bool:
        """A fleet's round whose global is scored: the island's first, then every `every` rounds."""
        return self.last_round is None or (self.every > 0 and round_ - self.last_round >= self.every)

    def due_step(self, step: int, max_steps: int) -> bool:
        """A standalone step after which the adapter is scored (the end's evaluation is the run's own)."""
        return self.every > 0 and step % self.every == 0 and step < max_steps

    def keep(self, round_: int, version: int, adapter: np.ndarray, step: int) -> None:
        """Round `round_` starts on global `version` at the island's step `step`: keep it to score in the wait for
        this round's merge."""
        self.pending = PendingEval(round_, version, adapter.copy(), step)
        self.last_round = round_

    def evaluate(self, island: Island, round_: Optional[int] = None, version: Optional[int] = None,
                 waiting: Optional[Callable[[], bool]] = None, holds: bool = True,
                 step: Optional[int] = None) -> dict[str, Any]:
        """Score the adapter `island` holds (taken at `step`, default its step count now); the event is reported and
        returned. `waiting()`: whether the island is still waiting for a merge (the part of the evaluation after the
        wait ends is `held_s`); without it, the whole evaluation holds the run (`holds`; False: it holds nothing, as
        after the run's last merge)."""
        t0 = time.perf_counter()
        watch = WaitWatch.begin(waiting, t0) if waiting is not None else None
        result = evaluate_task(island.generate, self.task, self.max_new_tokens,
                               progress=watch.check if watch is not None else None)
        end = time.perf_counter()
        seconds = end - t0
        held = watch.held(t0, end) if watch is not None else seconds if holds else 0.0
        self.seconds += seconds
        self.held_s += held
        s = result.summary()
        event = {"event": EVENT, "step": island.step_count if step is None else step, "round": round_,
                 "version": version, "task": self.task.name, "accuracy": s["accuracy"], "low": s["low"],
                 "high": s["high"], "n": s["n"], "seconds": round(seconds, 3), "held_s": round(held, 3)}
        self.events.append(event)
        self.report(event)
        return event

    def evaluate_pending(self, island: Island, load: Callable[[np.ndarray], None], local: np.ndarray,
                         waiting: Callable[[], bool]) -> Optional[dict[str, Any]]:
        """Score the kept global (`load` puts a flat adapter in the island), then give the island back `local`."""
        pending, self.pending = self.pending, None
        if pending is None:
            return None
        load(pending.adapter)
        try:
            return self.evaluate(island, pending.round, pending.version, waiting, step=pending.step)
        finally:
            load(local)

    def header(self) -> Optional[dict[str, Any]]:
        """The latest evaluation of a fleet's global as a delta reports it (`task_eval`: version, accuracy, n)."""
        scored = [e for e in self.events if e["version"] is not None]
        if not scored:
            return None
        e = scored[-1]
        return {"version": e["version"], "accuracy": e["accuracy"], "n": e["n"]}

    def summary(self) -> dict[str, Any]:
        """summary.json's part: the first and last accuracy, and the evaluations' seconds and held seconds."""
        first, last = (self.events[0], self.events[-1]) if self.events else ({}, {})
        return {"task": self.task.name, "task_accuracy_before": first.get("accuracy"),
                "task_accuracy_after": last.get("accuracy"), "task_evals": len(self.events),
                "task_eval_seconds": round(self.seconds, 3), "task_eval_held_s": round(self.held_s, 3)}


def console_line(event: dict[str, Any]) -> str:
    """One evaluation as the console shows it."""
    where = [f"v{event['version']}" if event["version"] is not None else None,
             f"round {event['round']}" if event["round"] is not None else None, f"step {event['step']}"]
    held = f", held the round {event['held_s']:.1f} s" if event["round"] is not None and event["held_s"] else ""
    return (f"task {event['task']}: {100 * event['accuracy']:.1f}% [{100 * event['low']:.1f}, "
            f"{100 * event['high']:.1f}] of {event['n']} ({', '.join(w for w in where if w)}; "
            f"{event['seconds']:.1f} s{held})")
