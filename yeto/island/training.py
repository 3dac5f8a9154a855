"""One island's run, whatever the backend: the session, resume and --init-adapter, the standalone loop, and the
DiLoCo island loop of `yeto.island.diloco` with --syncer.

`train(cfg, backend)` is the one entry every backend's island runs through (`yeto train --backend ...`, `python -m
yeto.backends.torch`, `python -m yeto.backends.mlx`): the backend (a `yeto.island.interface.Backend`) supplies the
`Island`; nothing here imports a tensor library, so an MLX island never loads torch.
"""

from __future__ import annotations

import json
import math
import signal
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Optional

import numpy as np

from yeto import YetoError
from yeto.island.train_config import TrainConfig
from yeto.island.metrics import METRICS_FILE, RUN_FILE, MetricsLog
from yeto.island.task_eval import TaskEvals, console_line, load_eval_task
from yeto.report.trackers import Trackers, check_installed, open_trackers, parse_report_to, run_group

if TYPE_CHECKING:
    from yeto.eval.task import Task
    from yeto.island.checkpoint import TrainState
    from yeto.island.interface import Backend, Island


@dataclass
class Session:
    """What a run needs before any model loads: its console, its --out directory and, with --syncer, its key."""
    console: Any
    out: Path
    join_key: Any
    log: Callable[[str], None]
    before_state_commit: Optional[Callable[[int], None]] = None  # `train`'s: see save_state


def open_session(cfg: TrainConfig, before_state_commit: Optional[Callable[[int], None]] = None) -> Session:
    """Check the key and make --out before the model loads, so a missing key is one line at once (the flags were
    checked by the backend: `train`)."""
    from rich.console import Console

    check_installed(parse_report_to(cfg.report_to))
    console = Console(stderr=True)
    join_key = None
    if cfg.syncer:
        from yeto.sync.shell.keys import island_join_key

        join_key = island_join_key(cfg.join_key, cfg.insecure, cfg.syncer)
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    return Session(console, out, join_key, lambda s: console.print(f"[dim]{s}[/dim]"), before_state_commit)


def train(cfg: TrainConfig, backend: Backend, show_progress: bool = True,
          before_state_commit: Optional[Callable[[int], None]] = None) -> dict[str, Any]:
    """Train one island on `backend`; the adapter lands in `out/adapter`. A process that follows another of its
    island (a torchrun rank other than 0) makes the calls that one relays and returns its own short summary.
    `before_state_commit(step)` runs as each training state is written, before it replaces the last one (the
    entry point's fault hook)."""
    backend.check_flags(cfg)  # (one line before the key, the --out or a model is touched)
    task = load_eval_task(cfg)  # (every process of an island: a bad task file stops them all alike)
    if not show_progress:
        from yeto.models.materialize import quiet_progress_bars

        quiet_progress_bars()
    followed = backend.follow(cfg)
    if followed is not None:
        return followed
    session = open_session(cfg, before_state_commit)
    with backend.island(cfg, session.log) as island:
        return run_training(island, cfg, session, show_progress, task)


def start_from_adapter(island: Island, name: str, log: Callable[[str], None]) -> None:
    """Load an existing peft adapter into a fresh island (`--init-adapter`), refused in one line when its base or
    LoRA shape is not this run's (the syncer's --init-adapter check)."""
    from yeto.sync.shell.store import load_init_adapter
    from yeto.sync.core.contract import init_adapter_problem
    from yeto.sync.wire.layout import build_layout

    init = load_init_adapter(name)
    problem = init_adapter_problem(init, build_layout(island.adapter_state()), island.adapter_config(),
                                   {"base_revision": island.model_artifact.revision})
    if problem:
        raise YetoError(f"--init-adapter {name} cannot start this run: {problem}; train with its settings "
                        "(--model, --lora-r, --lora-alpha, --lora-targets) or pick another adapter")
    island.load_adapter_state(init.tensors)
    log(f"starting from the adapter {name}")


def resume_state(island: Island, cfg: TrainConfig, out: Path, log: Callable[[str], None]) -> Optional[TrainState]:
    """Load the training state saved in --out into `island`, if there is one and it is this run's: a state of
    another run, or a finished standalone one, is refused with what differs (--fresh starts over); an island's
    finished state resumes, for the syncer decides whether its run goes on (`yeto launch` extends a finished fleet).
    None: a fresh start."""
    from yeto.island.checkpoint import STATE_FILE, differences, load_state, run_identity

    if cfg.fresh:
        return None
    state = load_state(out)
    if state is None:
        return None
    path, step = out / STATE_FILE, int(state.meta["step"])
    diff = differences(state.meta["run"], run_identity(island))
    if diff:
        raise YetoError(f"{path} is the training state of another run ({'; '.join(diff)}): resume with the same flags, "
                        "pass --fresh to start over (replacing it), or use another --out")
    if state.meta.get("finished") and not cfg.syncer and step >= cfg.max_steps:  # (in a fleet, the syncer says)
        raise YetoError(f"{out} holds a finished run ({step} steps): raise --max-steps to train further, pass "
                        "--fresh to start over, or use another --out")
    if not cfg.syncer and step > cfg.max_steps:
        raise YetoError(f"{path} is at step {step}, past --max-steps {cfg.max_steps}: raise --max-steps, or pass "
                        "--fresh to start over")
    island.load_training_state(state, adapter=not cfg.syncer)
    log(f"resuming from {path} at step {step}" + (" (the syncer brings the current global adapter)"
                                                   if cfg.syncer else ""))
    return state


def evaluate_start(island: Island, resumed: Optional[TrainState]) -> Optional[float]:
    """The eval loss a run starts from. A resumed island's is that of the adapter it saved (the global it resumed
    from), not its fresh LoRA's (the base model's): its own adapter stays until the syncer's global replaces it, so
    a syncer with no run yet is founded as before."""
    if resumed is None or not resumed.group("adapter"):
        return island.evaluate()
    own = island.adapter_state()
    island.load_adapter_state(resumed.group("adapter"))
    try:
        return island.evaluate()
    finally:
        island.load_adapter_state(own)


def save_training_state(island: Island, session: Session, residual: Optional[np.ndarray] = None,
                        finished: bool = False) -> None:
    """Save what `resume_state` needs (with --syncer, the delta quantizer's error-feedback residual too)."""
    from yeto.island.checkpoint import run_identity, save_state

    state = island.training_state()
    state.meta.update(run=run_identity(island), finished=finished)
    if residual is not None:
        state.tensors["residual"] = residual
    save_state(session.out, state, session.before_state_commit)


def run_training(island: Island, cfg: TrainConfig, session: Session, show_progress: bool = True,
                 task: Optional[Task] = None) -> dict[str, Any]:
    """Evaluate, train (standalone or as an island of --syncer's run), evaluate again, save the adapter. With
    `task` (--eval-task), its accuracy too: at the start, every --eval-task-every rounds or steps, at the end.

    The training state is saved in --out as it goes (yeto.island.checkpoint), and the same command resumes from it."""
    from rich.markup import escape

    out, console = session.out, session.console
    resumed = resume_state(island, cfg, out, session.log)
    if resumed is None and cfg.init_adapter:
        start_from_adapter(island, cfg.init_adapter, session.log)
    record = island.record()
    metrics = MetricsLog(out / METRICS_FILE, open_island_trackers(cfg, record, session.log))
    (out / RUN_FILE).write_text(json.dumps(record, indent=2))
    if resumed is not None:
        metrics.write(event="resumed", step=island.step_count, tokens=island.tokens_seen)
    eval0 = evaluate_start(island, resumed if cfg.syncer else None)
    metrics.write(event="eval", step=island.step_count, eval_loss=eval0)
    tag = f"[bold]island {cfg.island_id}[/bold] " if cfg.syncer else ""
    evals = None
    if task is not None:
        def report(event: dict[str, Any]) -> None:
            metrics.write(**event)
            console.print(f"{tag}{escape(console_line(event))}")

        evals = TaskEvals.of(cfg, task, report)
        if not cfg.syncer:  # (a fleet's island scores its first global, in its first wait: `IslandLoop`)
            evals.evaluate(island)
    if cfg.syncer:
        residual = resumed.tensors.get("residual") if resumed is not None else None
        held: dict[str, Optional[int]] = {"version": None}  # the global the island is left holding (None: none)

        def on_leave(version: Optional[int]) -> None:
            held["version"] = version

        try:
            extra = _island_loop(island, cfg, metrics, console, tag, session.join_key, residual,
                                 lambda r: save_training_state(island, session, r), on_leave, evals)
        except BaseException as e:  # refused, gave up on the syncer, Ctrl-C, SIGTERM, a crash: keep the adapter
            try:
                adapter = island.save(out / "adapter")
                metrics.write(event="aborted", steps=island.step_count, reason=repr(e)[:300],
                              global_version=held["version"])
                metrics.close()  # (the trackers flush what they hold)
                what = (f"the last global it received, version {held['version']}" if held["version"] is not None else
                        "it received no global from the syncer: this is its own starting adapter")
                console.print(f"{tag}[yellow]stopped early[/yellow]; adapter ({what}): {adapter}")
            except Exception as save_error:  # never hide the first error behind a second one
                console.print(f"{tag}[red]could not save the adapter[/red]: {save_error!r}")
            raise
        if hasattr(island, "relay_s"):  # a torchrun island (RelayedIsland): rank 0's time relaying to the others
            extra["relay_s"] = round(island.relay_s, 3)
        done = f"{extra['rounds']} rounds, {island.step_count} steps, utilization {extra['utilization']:.1%}"
    else:
        extra = _standalone_loop(island, cfg, metrics, console, eval0, show_progress, session, evals)
        done = f"{island.step_count} steps, {extra['tok_s']:.0f} tok/s"
    final_eval = island.evaluate()
    metrics.write(event="eval", step=island.step_count, eval_loss=final_eval)
    if evals is not None:  # (a fleet's: the run's last global, after its last merge)
        evals.evaluate(island, version=extra.get("version"), holds=not cfg.syncer)
        extra.update(evals.summary())
    adapter = island.save(out / "adapter")
    save_training_state(island, session, finished=True)
    summary = {"adapter": str(adapter), "steps": island.step_count, "eval_loss_before": eval0,
               "eval_loss_after": final_eval, "tokens": island.tokens_seen, "loss_tokens": island.loss_tokens_seen,
               "shard": list(island.shard) if island.shard else None,
               "skipped_files": island.source.stats.get("skipped_files", []), **extra}
    metrics.write(event="done", **summary)
    metrics.close()
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    ev = (f"eval loss {eval0:.3f} -> {final_eval:.3f}" if eval0 is not None and final_eval is not None
          else "no eval split")
    skipped = summary["skipped_files"]
    if evals is not None:
        ev += escape(f"; task {task.name} {_percent(extra['task_accuracy_before'])} -> "
                     f"{_percent(extra['task_accuracy_after'])}")
    if skipped:
        ev += escape(f"; skipped {len(skipped)} file(s) of --data: {', '.join(skipped)}")
    console.print(f"{tag}[green]done[/green]: {done}, {ev}; adapter: {adapter}")
    return summary


def _percent(accuracy: Optional[float]) -> str:
    return "-" if accuracy is None else f"{100 * accuracy:.1f}%"


def open_island_trackers(cfg: TrainConfig, record: dict[str, Any], log: Callable[[str], None]) -> Optional[Trackers]:
    """--report-to's trackers for this island: one run named `<run>-island-<id>` (standalone: `<run>`), grouped by
    the run's name, its config the island's record (flags, model, data, loss)."""
    group = run_group(cfg.run_name, cfg.out if not cfg.syncer else Path(cfg.out).resolve().parent)
    name = f"{group}-island-{cfg.island_id}" if cfg.syncer else group
    return open_trackers(cfg.report_to, cfg.out, name, group, record, log)


def _standalone_loop(island: Island, cfg: TrainConfig, metrics: MetricsLog, console, eval0: float | None,
                     show_progress: bool, session: Session, evals: Optional[TaskEvals] = None) -> dict[str, Any]:
    """Up to `--max-steps` steps (from where a resumed run was) with a progress bar, periodic eval (the task's too)
    and saves."""
    from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn,
                               TimeRemainingColumn)

    history: list[dict[str, Any]] = []
    progress = Progress(
        TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.fields[info]}"),
        TimeElapsedColumn(), TimeRemainingColumn(), console=console, disable=not show_progress,
    )
    t0 = time.perf_counter()
    last_eval = eval0
    tokens0, loss_tokens0 = island.tokens_seen, island.loss_tokens_seen
    with progress:
        task = progress.add_task("train", total=cfg.max_steps, completed=island.step_count, info="")
        while island.step_count < cfg.max_steps:
            t = time.perf_counter()
            s = island.step()
            if cfg.step_delay:
                time.sleep(cfg.step_delay)  # a simulated slow island (tests): the delay counts as its compute
            dt = time.perf_counter() - t
            s.update(tok_s=s["tokens"] / dt, loss_tok_s=s["loss_tokens"] / dt)
            if not math.isfinite(s["loss"]):
                raise YetoError(f"loss is {s['loss']} at step {s['step']}; lower --lr or check the data")
            if cfg.eval_every and s["step"] % cfg.eval_every == 0 and s["step"] < cfg.max_steps:
                last_eval = island.evaluate()
                metrics.write(event="eval", step=s["step"], eval_loss=last_eval)
            metrics.write(event="step", **s)
            if evals is not None and evals.due_step(s["step"], cfg.max_steps):
                evals.evaluate(island)
            history.append(s)
            if cfg.save_every and s["step"] % cfg.save_every == 0 and s["step"] < cfg.max_steps:
                save_training_state(island, session)
            ev = f" eval {last_eval:.3f}" if last_eval is not None else ""
            progress.update(task, advance=1, info=f"loss {s['loss']:.3f}{ev} {s['tok_s']:.0f} tok/s")
    elapsed = time.perf_counter() - t0
    first, last = (history[0]["loss"], history[-1]["loss"]) if history else (None, None)
    return {"first_loss": first, "last_loss": last, "tok_s": (island.tokens_seen - tokens0) / elapsed,
            "loss_tok_s": (island.loss_tokens_seen - loss_tokens0) / elapsed}


def _island_loop(island: Island, cfg: TrainConfig, metrics: MetricsLog, console, tag: str, join_key,
                 residual: Optional[np.ndarray], save_state: Callable[[np.ndarray], None],
                 on_leave: Callable[[Optional[int]], None], evals: Optional[TaskEvals] = None) -> dict[str, Any]:
    """One island of a DiLoCo run: the syncer decides rounds, merges and the end; `save_state(residual)` runs at
    the start of every round, and `residual` (a resumed island's) seeds the delta quantizer's error feedback;
    `on_leave(version)`: the global the island is left holding, however it ends (None: it received none)."""
    from rich.markup import escape

    from yeto.island.diloco import island_identity, run_island
    from yeto.sync.core.island import LinkTimeouts

    def on_round(r: dict[str, Any]) -> None:
        metrics.write(event="round", **r)
        console.print(f"{tag}round {r['round']}: {r['steps']} steps, loss {r['loss']:.4f}, {r['tokens']} tokens")

    def on_sigterm(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt  # unwinds the training loop, which says goodbye; train() saves the adapter

    previous = (signal.signal(signal.SIGTERM, on_sigterm) if threading.current_thread() is threading.main_thread()
                else None)
    try:
        return run_island(island, cfg.syncer, cfg.island_id, overlap=cfg.overlap, progress=on_round,
                          max_inner_steps=cfg.max_inner_steps, step_delay=cfg.step_delay,
                          join_key=join_key, identity=island_identity(cfg.out), residual=residual,
                          on_round_start=save_state, on_step=lambda s: metrics.track(event="step", **s),
                          on_leave=on_leave, task_evals=evals,
                          timeouts=LinkTimeouts(dead_after_s=cfg.syncer_timeout, give_up_s=cfg.give_up_after),
                          log_fn=lambda s: console.print(f"{tag}[dim]{escape(s)}[/dim]"))
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
