"""The DiLoCo training loop: where every backend meets the syncer.

A backend (torch + peft, MLX, ...) offers an `Island` (yeto.island.interface); the
loop uses its adapter as a `{canonical peft name: fp32 numpy array}` view, a way
to load such a view back, and one inner optimizer step. `run_island` does the rest with a
`IslandCore` (what to train, when a round ends, what to push) behind a
`SyncerLink` (the I/O thread): load the round's global adapter, step until the
core says the round is done, push `local - that adapter`, and go again until the
syncer finishes the run. It never touches the inner optimizer, so AdamW moments
persist across rounds.

Overlap (`overlap=True`): after pushing round r's delta the island keeps
training instead of waiting; when the merged adapter arrives, the progress made
since the push is kept on top of it (θ ← g_r + (θ − θ_push)), as in one-step-
delayed / streaming DiLoCo. Those steps count toward round r+1.

Carry (time-window rounds, always on): an island whose previous delta came late
is merged a version late in the next round, where it holds this island's place
(one delta per island per round); the round it trains meanwhile could only go
late too, and every later one after it. So that round's work is not pushed: the
island trains on until the next global comes and keeps all of it on top of that
global (θ ← g + (θ − its base)), and its next push lands fresh.

Merge alpha (the syncer's `--merge-alpha a` < 1): a round starts from
a x the merged adapter + (1 - a) x the adapter this island last pushed, keeping
part of its own progress; its delta is still taken against the merged adapter.
"""

from __future__ import annotations

import random
import secrets
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

import numpy as np

from yeto import YetoError
from yeto.island.interface import Island
from yeto.island.task_eval import TaskEvals
from yeto.sync.shell.keys import JoinKey, write_secret
from yeto.sync.shell.client import SyncerLink
from yeto.sync.core.island import Done, IslandCore, LinkTimeouts, RoundCounts, Train, StepVerdict, Wait
from yeto.sync.core.island.work import Carry, RoundStart, RoundSteps
from yeto.sync.wire.layout import Layout, build_layout, flatten, fragment_pieces, synced_fragments, unflatten


IDENTITY_FILE = "identity"


@dataclass
class RoundStats(RoundSteps):
    """A round's steps (`RoundSteps`: how many, and which were taken before its training started) and what they took."""

    tokens: int = 0
    loss_tokens: int = 0
    loss_sum: float = 0.0
    compute_s: float = 0.0
    last_step: Optional[int] = None  # the island's step number after this round's last step, and that step's LR
    last_lr: Optional[float] = None  # (where its step() says them)

    def add(self, s: dict[str, Any], dt: float) -> None:
        self.steps += 1
        self.last_step, self.last_lr = s.get("step"), s.get("lr")
        self.tokens += s["tokens"]
        self.loss_tokens += s["loss_tokens"]
        self.loss_sum += s["loss"] * s["loss_tokens"]
        self.compute_s += dt

    @property
    def loss(self) -> float:
        return self.loss_sum / max(1, self.loss_tokens)

    def counts(self, task_eval: Optional[dict[str, Any]] = None) -> RoundCounts:
        return RoundCounts(self.tokens, self.loss_tokens, self.steps, self.loss, self.compute_s, self.carried,
                           task_eval)


@dataclass
class IslandStats:
    rounds: int = 0
    abandoned: int = 0
    carried: int = 0  # rounds whose work went on top of the next global instead of to the syncer (StepVerdict.CARRY)
    compute_s: float = 0.0
    delta_bytes: list[int] = field(default_factory=list)


def island_identity(out: str | Path) -> str:
    """This island's identity secret, kept in its run directory (0600): a restart with the same --out proves it
    is the same island and takes its id back at once; anyone else waits until the holder is gone."""
    path = Path(out) / IDENTITY_FILE
    try:
        return path.read_text().strip()
    except FileNotFoundError:
        secret = secrets.token_hex(16)
        write_secret(path, secret + "\n")
        return secret


def inner_step(island: Island, rnd: RoundStats, stats: IslandStats, step_delay: float = 0.0) -> dict[str, Any]:
    """One inner step; returns the island's step record with its tokens/s (the compute's, the delay included)."""
    t = time.perf_counter()
    s = island.step()
    if step_delay:
        time.sleep(step_delay)  # a simulated slow island: the delay counts as its compute
    dt = time.perf_counter() - t
    rnd.add(s, dt)
    stats.compute_s += dt
    return {**s, "tok_s": s["tokens"] / dt if dt > 0 else 0.0}


def _norm_on(x: np.ndarray, pieces: list[tuple[int, int]]) -> float:
    """The L2 norm of x's values in these (start, numel) pieces (what a streamed round sends)."""
    return float(np.sqrt(sum(float(np.dot(x[a : a + n], x[a : a + n])) for a, n in pieces)))


def run_island(island: Island, syncer: str, island_id: int, overlap: bool = False,
               progress: Callable[[dict[str, Any]], None] | None = None, log_fn: Callable[[str], None] = print,
               timeouts: LinkTimeouts = LinkTimeouts(), max_inner_steps: int = 0, step_delay: float = 0.0,
               fragment_numel: Optional[int] = None, join_key: Optional[JoinKey] = None,
               identity: str = "", residual: Optional[np.ndarray] = None,
               on_round_start: Optional[Callable[[np.ndarray], None]] = None,
               on_step: Optional[Callable[[dict[str, Any]], None]] = None,
               on_leave: Optional[Callable[[Optional[int]], None]] = None,
               task_evals: Optional[TaskEvals] = None) -> dict[str, Any]:
    """Train `island` as one DiLoCo island of the run at `syncer` until the syncer says finish.

    `join_key`: the run's credentials (None only for an --insecure loopback syncer). `identity`: this island's
    secret, the same across its restarts (see `island_identity`), so a restart may take its id back at once.
    `residual`: the error-feedback residual a resumed island saved; `on_round_start(residual)` is called once
    each round's adapter is loaded (the round boundary where an island saves its training state), with the residual
    of the deltas known to count (a delta still in flight may be lost with the process: its error is not carried).
    `on_step(record)`: every inner step's record (loss, lr, grad_norm, tokens, loss_tokens, tok_s), for trackers.

    On every way out (finish, refusal, giving up on the syncer, Ctrl-C) the island is left holding the
    last global adapter it received, so the caller saves that; a refusal or giving up then raises YetoError.
    `on_leave(version)` is then told that global's version (None: it received none and holds its own start),
    so what the caller saves can say what it is.
    `task_evals` (--eval-task): the global of the island's first round, then of every --eval-task-every-th, is
    scored while the island waits for that round's merge (`yeto.island.task_eval`), and each delta reports the
    latest score.
    """
    state = island.adapter_state()
    layout = build_layout(state, fragment_numel)
    core = IslandCore(island_id, island.backend, layout, flatten(layout, state), island.adapter_config(),
                       island.record(), random.Random(), timeouts, max_inner_steps, time.time_ns() // 1000,
                       identity=identity or secrets.token_hex(16))
    if residual is not None and residual.shape == core.ef.residual.shape:
        core.ef.residual = residual.astype(np.float32)
    loop = IslandLoop(island, layout, core, SyncerLink(syncer, core, log_fn, join_key).start(), log_fn, overlap,
                      max_inner_steps, step_delay, progress, on_round_start, on_step, on_leave, task_evals)
    return loop.run()


class IslandLoop:
    """One island's rounds: load the round's start, train until the core's verdict, then push, carry or drop."""

    def __init__(self, island: Island, layout: Layout, core: IslandCore, link: SyncerLink,
                 log_fn: Callable[[str], None], overlap: bool, max_inner_steps: int, step_delay: float,
                 progress: Callable[[dict[str, Any]], None] | None,
                 on_round_start: Optional[Callable[[np.ndarray], None]],
                 on_step: Optional[Callable[[dict[str, Any]], None]] = None,
                 on_leave: Optional[Callable[[Optional[int]], None]] = None,
                 task_evals: Optional[TaskEvals] = None):
        self.island, self.layout, self.core, self.link, self.log = island, layout, core, link, log_fn
        self.overlap, self.max_inner_steps, self.step_delay = overlap, max_inner_steps, step_delay
        self.progress, self.on_round_start, self.on_step, self.on_leave = progress, on_round_start, on_step, on_leave
        self.task_evals = task_evals
        self.stats = IslandStats()
        self.t_start: Optional[float] = None  # utilization is measured from the first round on (not the wait to join)
        self.stall_s = 0.0
        self.first_round = (0, 0)  # the round this island first trained in, and its step count then (its pace's start)
        self.horizon: Optional[int] = None  # the LR schedule's last step, as last set
        self.carry: Optional[Carry[RoundStats]] = None  # steps that go on top of the next global
        self.starts = RoundStart(layout)  # where each round starts, and what that keeps from earlier rounds

    def run(self) -> dict[str, Any]:
        done: Optional[Done] = None
        try:
            while True:
                task = self._next_task()
                if isinstance(task, Done):
                    done = task
                    break
                self._round(task)
        except KeyboardInterrupt:
            done = Done("interrupted", error=False)
            raise
        finally:
            final = self.link.global_flat()
            if final is not None:
                self.island.load_adapter_state(unflatten(self.layout, final))  # end on the last global adapter
            self.link.close(done.reason[:200] if done else "error")
            if self.on_leave is not None:
                self.on_leave(self.core.version if final is not None else None)
        if done.error:
            raise YetoError(done.reason)
        self.log(f"syncer finished the run: {done.reason}")
        return self._result(done)

    def _next_task(self) -> Train | Done:
        """The core's next task. With --overlap, a pipeline with nothing to take yet (full, or the run's last round,
        which waits for the merge before it) trains on instead of waiting: those steps are the next round's."""
        while True:
            t_wait = time.perf_counter()
            ahead = self._next_round_ahead()
            task = self.link.next_task(timeout_s=0.0 if ahead else None)
            if self.t_start is not None:
                self.stall_s += time.perf_counter() - t_wait
            if not isinstance(task, Wait):
                return task
            if self.carry is None:  # (a streamed start keeps the island's adapter: `since` is not used)
                self.carry = Carry(RoundStats(ahead), self.starts.held_global)
            self._step(self.carry.count)

    def _next_round_ahead(self) -> int:
        """A pipelined island with deltas in flight and room for more steps: the round its steps now go to (0: none,
        wait for the core)."""
        pipelined = self.core.policy.pipeline > 1
        if not self.overlap or not pipelined or self.t_start is None or self.starts.held_global is None:
            return 0
        limit = self.core.policy.train_on_limit(self.max_inner_steps)
        latest = self.link.latest_round_in_flight()
        if not latest or (self.carry is not None and self.carry.count.steps >= limit):
            return 0
        return latest + 1

    def _round(self, task: Train) -> None:
        if self.core.shard is not None:
            self.island.use_shard(*self.core.shard)  # the data shard the syncer says (a no-op once held)
        if self.t_start is None:
            self.t_start = time.perf_counter()
            self.first_round = (task.round, self.island.step_count)
        self._set_horizon(task.round)
        rnd = self._start(task)
        if self.task_evals is not None and self.task_evals.due_round(task.round):
            self.task_evals.keep(task.round, task.base_version, task.adapter, self.island.step_count)
        if self.on_round_start is not None:
            self.on_round_start(self.link.counted_residual())
        verdict = self.link.after_step(rnd.steps, rnd.window_steps) if rnd.steps else StepVerdict.CONTINUE
        while verdict is StepVerdict.CONTINUE:
            self._step(rnd)
            verdict = self.link.after_step(rnd.steps, rnd.window_steps)
        if verdict is StepVerdict.CARRY:
            self._carry(task, rnd)
        elif verdict is StepVerdict.ABANDON:
            self.stats.abandoned += 1
            self.starts.abandoned()
            self.log(f"round {task.round} closed without us after {rnd.steps} steps: starting from the new global")
        elif verdict is not StepVerdict.STOP:  # (STOP: next_task says why)
            self._push(task, rnd)

    def _set_horizon(self, round_number: int) -> None:
        """Stretch the LR schedule over the run (`RoundPolicy.schedule_horizon`): in time windows the island's pace,
        its steps a round since its first, says where the run ends in its own steps."""
        first_round, first_step = self.first_round
        rounds = round_number - first_round
        pace = (self.island.step_count - first_step) / rounds if rounds > 0 else None
        total = self.core.policy.schedule_horizon(self.island.step_count, pace, round_number)
        if total is not None and total != self.horizon:
            self.horizon = total
            self.island.set_total_steps(total)

    def _start(self, task: Train) -> RoundStats:
        """Load the round's start (`RoundStart.start`: the carried steps on top of its global, a streamed run's kept
        parts, or --merge-alpha's blend; a streamed run's last round syncs the whole adapter: each part's steps since
        its last sync go up then), with the round's step counts: new, or those of the steps carried into it."""
        carry, self.carry = self.carry, None
        rnd = RoundStats(task.round) if carry is None else carry.count
        if carry is not None and carry.into(task.round):
            self.stats.carried -= 1
            self.log(f"round {task.round}: the late delta that held its place was refused; its {rnd.steps} "
                     "steps go to it after all")
        start = self.starts.start(task.adapter, lambda: flatten(self.layout, self.island.adapter_state()), carry,
                                  self.core.policy, self.link.take_given_back)
        self.island.load_adapter_state(unflatten(self.layout, start))
        return rnd

    def _step(self, rnd: RoundStats) -> None:
        s = inner_step(self.island, rnd, self.stats, self.step_delay)
        if self.on_step is not None:
            self.on_step(s)

    def _carry(self, task: Train, rnd: RoundStats) -> None:
        """Our previous delta, late, holds this round's place: train on until the next global comes (at most
        --max-inner-steps in all), and carry it all on top of it (a fresh delta)."""
        limit = self.core.policy.train_on_limit(self.max_inner_steps)
        while self.link.carrying() and rnd.steps < limit:
            self._step(rnd)
        self.carry = Carry(rnd, task.adapter, place=task.round)
        self.stats.carried += 1
        self.log(f"round {task.round}: our previous delta (late) holds its place in the syncer; carrying "
                 f"{rnd.steps} steps onto the next global")

    def _push(self, task: Train, rnd: RoundStats) -> None:
        local = flatten(self.layout, self.island.adapter_state())
        pushed_part = synced_fragments(self.layout, self.core.part(task.round))
        self.starts.pushed(local, pushed_part, self.core.policy.fragments > 1)
        header = self.task_evals.header() if self.task_evals is not None else None
        self.stats.delta_bytes.append(self.link.push(local, rnd.counts(header)))
        self.stats.rounds += 1
        if self.progress:
            wall = time.perf_counter() - self.t_start if self.t_start is not None else 0.0
            self.progress({"round": task.round, "steps": rnd.steps, "loss": rnd.loss, "tokens": rnd.tokens,
                           "loss_tokens": rnd.loss_tokens, "step": rnd.last_step, "lr": rnd.last_lr,
                           "delta_norm": _norm_on(local - task.adapter, fragment_pieces(self.layout, pushed_part)),
                           "delta_bytes": self.stats.delta_bytes[-1], "stall_s": round(self.stall_s, 4),
                           "utilization": self.stats.compute_s / wall if wall else 0.0,
                           "lag": max(0, self.core.version - max(task.base_version, task.round - 1))})
        if self.task_evals is not None:  # score the round's global while its merge is awaited (or trained through)
            self.task_evals.evaluate_pending(self.island, lambda flat: self.island.load_adapter_state(
                unflatten(self.layout, flat)), local, self.link.awaiting_merge)
        if self.overlap and self.core.policy.pipeline <= 1:  # train on while the merge is in flight; those steps go
            # on top of the merged adapter (a pipeline trains the next rounds' parts, then on while full: `_next_task`)
            nxt = RoundStats(task.round + 1)
            limit = self.core.policy.train_on_limit(self.max_inner_steps)
            while self.link.awaiting_merge() and nxt.steps < limit:
                self._step(nxt)
            self.carry = Carry(nxt, local) if nxt.steps else None

    def _result(self, done: Done) -> dict[str, Any]:
        wall = time.perf_counter() - self.t_start if self.t_start is not None else 0.0
        stats, link = self.stats, self.link
        return {
            "rounds": stats.rounds,
            "abandoned_rounds": stats.abandoned,
            "carried_rounds": stats.carried,
            "version": self.core.version,
            "complete": done.complete,
            "wall_s": wall,
            "compute_s": stats.compute_s,
            "stall_s": self.stall_s,
            "utilization": stats.compute_s / wall if wall else 0.0,
            "bytes_sent": link.bytes_sent,
            "bytes_received": link.bytes_received,
            "delta_bytes": stats.delta_bytes,
        }
