"""One island's training, whatever the backend: its config, LR schedule, batch order, metrics and loop.

A backend (`yeto.learner`: torch + peft; `yeto.mlx.learner`: MLX) supplies the learner object, an
`yeto.diloco.Island` with `evaluate`, `save` and step counters; everything here is shared and imports
no tensor library, so an MLX island never loads torch. `run_training` is the standalone loop (progress
bar, periodic eval) or, with --syncer, the DiLoCo island loop of `yeto.diloco`.
"""

from __future__ import annotations

import json
import math
import signal
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Callable, Optional

import numpy as np
import typer

from yeto import YetoError, __version__
from yeto.micro_batch import WHOLE_BATCH

DTYPES = ("auto", "float32", "bfloat16", "float16")  # --dtype (auto: fp32 on CPU, bf16 on GPU for torch)

if TYPE_CHECKING:
    from yeto.checkpoint import TrainState
    from yeto.data import Blocks, DataSource, PreparedData


@dataclass
class TrainConfig:
    model: str = "smollm2-135m"
    data: str = "data/demo"
    out: str = "runs/train"
    model_revision: Optional[str] = None
    data_revision: Optional[str] = None
    data_split: str = "train"  # the dataset split trained on (a hub dataset or a directory with split files)
    data_config: Optional[str] = None  # the dataset config (subset) read, for datasets that have several
    trust_remote_code: bool = False
    seq_len: int = 256
    batch_size: int = 4
    grad_accum: int = 1
    max_steps: int = 100
    lr: float = 2e-4
    warmup_steps: int = 10
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.0
    max_grad_norm: float = 1.0
    lora_r: int = 16
    lora_alpha: float = 32.0
    lora_dropout: float = 0.05
    lora_targets: str = "auto"
    loss_function: str = "cross_entropy"
    eval_every: int = 50
    eval_fraction: float = 0.05
    seed: int = 0
    learner_id: int = 0
    num_learners: int = 0  # 0: standalone the whole data, in a fleet the shard count the syncer says
    device: str = "auto"
    dtype: str = "auto"
    gradient_checkpointing: bool = False
    full_logits: bool = False
    syncer: Optional[str] = None
    overlap: bool = False
    threads: int = 0
    max_inner_steps: int = 0
    step_delay: float = 0.0
    syncer_timeout: float = 30.0
    give_up_after: float = 1800.0
    join_key: Optional[str] = None
    insecure: bool = False
    shard: str = "ddp"  # a torchrun island's frozen base: replicated on every rank (ddp) or sharded (fsdp)
    base_quantization: str = "none"  # "nf4": QLoRA (the frozen base in 4 bits, bitsandbytes, CUDA)
    lora_freeze_a: bool = False  # FFA-LoRA: lora_A stays at the run's shared initialization, only lora_B trains
    micro_batch_size: str = WHOLE_BATCH  # blocks through the model at once: "all", N or "auto" (see yeto.micro_batch)
    save_every: int = 50  # standalone: save the training state every N steps (0: only at the end); fleet: each round
    fresh: bool = False  # start over, replacing the training state saved in --out
    init_adapter: Optional[str] = None  # start from this peft adapter (a directory or hub id) instead of LoRA's init


def lr_lambda(step: int, warmup: int, total: int, min_ratio: float) -> float:
    """Linear warmup, then cosine decay to `min_ratio` of the peak."""
    if step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


class BatchSampler:
    """Endless, deterministic batches of block indices: a fresh seeded permutation per epoch."""

    def __init__(self, n: int, batch_size: int, seed: int):
        self.n, self.batch_size, self.seed = n, batch_size, seed
        self.epoch, self.pos = 0, 0
        self.order = np.random.default_rng([seed, 0]).permutation(n)

    def next(self) -> np.ndarray:
        idx = []
        while len(idx) < self.batch_size:
            if self.pos == self.n:
                self.epoch += 1
                self.pos = 0
                self.order = np.random.default_rng([self.seed, self.epoch]).permutation(self.n)
            take = min(self.batch_size - len(idx), self.n - self.pos)
            idx.extend(self.order[self.pos : self.pos + take])
            self.pos += take
        return np.asarray(idx)

    def position(self) -> dict[str, int]:
        """Where the batches are: enough to draw the same next batch after a restart."""
        return {"n": self.n, "batch_size": self.batch_size, "seed": self.seed, "epoch": self.epoch, "pos": self.pos}

    def seek(self, position: dict[str, int]) -> None:
        """Continue from a saved `position` (of a sampler over the same blocks, batch size and seed)."""
        mine = {k: v for k, v in self.position().items() if k in ("n", "batch_size", "seed")}
        theirs = {k: position.get(k) for k in mine}
        if mine != theirs:
            raise YetoError(f"the saved batch position is for another sampler ({theirs}, here {mine}): pass --fresh "
                            "to start over")
        self.epoch, self.pos = int(position["epoch"]), int(position["pos"])
        self.order = np.random.default_rng([self.seed, self.epoch]).permutation(self.n)


class ShardedData:
    """A learner's data (every backend): the dataset read and checked before the learner joins a run, and its
    shard of it taken once known: at start from --learner-id of --num-learners (or the whole of it standalone),
    else from the syncer's welcome (`use_shard`), which cuts the data into the run's shard count."""

    source: "DataSource"
    data: Optional["PreparedData"] = None
    shard: Optional[tuple[int, int]] = None
    sampler: Optional[BatchSampler] = None
    ranks: int = 1

    def read_data(self, cfg: TrainConfig, tokenizer: Any, log: Callable[[str], None]) -> None:
        from yeto.data import read_data

        self.source = read_data(cfg.data, tokenizer, cfg.seq_len, cfg.eval_fraction, cfg.seed, cfg.data_revision,
                                cfg.data_split, cfg.data_config)
        self._log_data = log
        if cfg.num_learners or not cfg.syncer:
            self.use_shard(cfg.learner_id if cfg.num_learners else 0, cfg.num_learners or 1)
        else:
            log(f"data: {json.dumps(self.source.stats)}; the syncer says which shard this learner trains on")

    def use_shard(self, index: int, count: int) -> None:
        """Train on shard `index` of `count` from here on (a no-op if it is the shard held)."""
        if self.shard == (index, count):
            return
        cfg = self.cfg  # type: ignore[attr-defined]
        self.data = self.source.shard(index, count)
        self.shard = (index, count)
        self._log_data(f"data: {json.dumps(self.data.stats)}")
        # every rank of a torchrun island draws the same global batch (ranks x --batch-size) and takes its slice
        self.sampler = BatchSampler(len(self.data.train), cfg.batch_size * self.ranks, cfg.seed + 1000 * cfg.learner_id)

    def resume_data(self, meta: dict[str, Any]) -> None:
        """Take the shard and batch position a saved training state had (a restarted learner goes on with them)."""
        if meta.get("shard"):
            self.use_shard(*meta["shard"])
        if meta.get("sampler") and self.sampler is not None:
            self.sampler.seek(meta["sampler"])

    def train_blocks(self) -> "Blocks":
        if self.data is None or self.sampler is None:
            raise YetoError("this learner has no data shard yet: pass --num-learners, or join a syncer (it says "
                            "which shard)")
        return self.data.train

    def data_record(self) -> dict[str, Any]:
        return {"data": self.source.artifact.to_dict(),
                "data_stats": self.data.stats if self.data is not None else self.source.stats}


def island_record(learner) -> dict[str, Any]:
    """What a saved adapter and run.json say about the island that made it (any backend)."""
    from yeto.provenance import loss_identity

    return {
        "yeto_version": __version__,
        "backend": learner.backend,
        "model": learner.model_artifact.to_dict(),
        **learner.data_record(),
        "config": asdict(learner.cfg),
        "loss": loss_identity(learner.cfg.loss_function),
        "steps": learner.step_count,
        "tokens": learner.tokens_seen,
        "loss_tokens": learner.loss_tokens_seen,
        "ranks": getattr(learner, "ranks", 1),  # processes of a torchrun island (the island's batch is theirs)
    }


class MetricsLog:
    """Append-only JSONL: one object per event, each with wall time."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._f = open(self.path, "a", buffering=1)

    def write(self, **event: Any) -> None:
        self._f.write(json.dumps({"time": round(time.time(), 3), **event}) + "\n")

    def close(self) -> None:
        self._f.close()


def check_config(cfg: TrainConfig) -> None:
    """The flags every backend checks before it loads anything: one line naming the flag and the fix."""
    from yeto.checks import check_address, check_out_dir, check_range

    for name in ("batch_size", "grad_accum", "max_steps", "seq_len", "lora_r"):
        check_range(getattr(cfg, name), f"--{name.replace('_', '-')}", low=1)
    check_range(cfg.seq_len, "--seq-len", low=2)
    check_range(cfg.lr, "--lr", low=0, low_open=True)
    check_range(cfg.lora_alpha, "--lora-alpha", low=0, low_open=True)
    check_range(cfg.lora_dropout, "--lora-dropout", low=0, high=1, high_open=True)
    check_range(cfg.min_lr_ratio, "--min-lr-ratio", low=0, high=1)
    check_range(cfg.max_grad_norm, "--max-grad-norm", low=0, low_open=True)
    check_range(cfg.eval_fraction, "--eval-fraction", low=0, high=1, high_open=True)
    for name in ("warmup_steps", "weight_decay", "eval_every", "save_every", "threads", "max_inner_steps",
                 "step_delay", "learner_id", "num_learners"):
        check_range(getattr(cfg, name), f"--{name.replace('_', '-')}", low=0)
    if cfg.num_learners and cfg.learner_id >= cfg.num_learners:
        raise YetoError(f"--learner-id must be in [0, {cfg.num_learners}) with --num-learners {cfg.num_learners}, "
                        f"got {cfg.learner_id}: fix one, or drop --num-learners (the syncer then says the count)")
    check_range(cfg.syncer_timeout, "--syncer-timeout", low=0, low_open=True)
    check_range(cfg.give_up_after, "--give-up-after", low=0, low_open=True)
    if cfg.dtype not in DTYPES:
        raise YetoError(f"unknown --dtype {cfg.dtype!r}: use {', '.join(DTYPES)}")
    if cfg.syncer:
        check_address(cfg.syncer)
    check_out_dir(cfg.out)


@dataclass
class Session:
    """What a run needs before any model loads: its console, its --out directory and, with --syncer, its key."""
    console: Any
    out: Path
    join_key: Any
    log: Callable[[str], None]


def open_session(cfg: TrainConfig) -> Session:
    """Check the key and make --out before the model loads, so a missing key is one line at once."""
    from rich.console import Console

    check_config(cfg)
    console = Console(stderr=True)
    join_key = None
    if cfg.syncer:
        from yeto.sync.auth import learner_join_key

        join_key = learner_join_key(cfg.join_key, cfg.insecure, cfg.syncer)
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    return Session(console, out, join_key, lambda s: console.print(f"[dim]{s}[/dim]"))


def train(cfg: TrainConfig, learner_cls: Callable[..., Any], show_progress: bool = True) -> dict[str, Any]:
    """Train one single-process island of `learner_cls`'s backend; the adapter lands in `out/adapter`."""
    session = open_session(cfg)
    return run_training(learner_cls(cfg, log=session.log), cfg, session, show_progress)


def start_from_adapter(learner, name: str, log: Callable[[str], None]) -> None:
    """Load an existing peft adapter into a fresh learner (`--init-adapter`), refused in one line when its base or
    LoRA shape is not this run's (the syncer's --init-adapter check)."""
    from yeto.adapter import load_init_adapter
    from yeto.sync.core.contract import init_adapter_problem
    from yeto.sync.layout import build_layout

    init = load_init_adapter(name)
    problem = init_adapter_problem(init, build_layout(learner.adapter_state()), learner.adapter_config(),
                                   {"base_revision": learner.model_artifact.revision})
    if problem:
        raise YetoError(f"--init-adapter {name} cannot start this run: {problem}; train with its settings "
                        "(--model, --lora-r, --lora-alpha, --lora-targets) or pick another adapter")
    learner.load_adapter_state(init.tensors)
    log(f"starting from the adapter {name}")


def resume_state(learner, cfg: TrainConfig, out: Path, log: Callable[[str], None]) -> Optional[TrainState]:
    """Load the training state saved in --out into `learner`, if there is one and it is this run's: a state of
    another run, or of a finished one, is refused with what differs (--fresh starts over); None: a fresh start."""
    from yeto.checkpoint import STATE_FILE, differences, load_state, run_identity

    if not hasattr(learner, "load_training_state"):
        log("note: this backend saves no training state: a restart starts its optimizer and LR schedule afresh")
        return None
    if cfg.fresh:
        return None
    state = load_state(out)
    if state is None:
        return None
    path, step = out / STATE_FILE, int(state.meta["step"])
    diff = differences(state.meta["run"], run_identity(learner))
    if diff:
        raise YetoError(f"{path} is the training state of another run ({'; '.join(diff)}): resume with the same flags, "
                        "pass --fresh to start over (replacing it), or use another --out")
    if state.meta.get("finished") and (cfg.syncer or step >= cfg.max_steps):
        more = "" if cfg.syncer else " raise --max-steps to train further,"
        raise YetoError(f"{out} holds a finished run ({step} steps):{more} pass --fresh to start over, or use "
                        "another --out")
    if not cfg.syncer and step > cfg.max_steps:
        raise YetoError(f"{path} is at step {step}, past --max-steps {cfg.max_steps}: raise --max-steps, or pass "
                        "--fresh to start over")
    learner.load_training_state(state, adapter=not cfg.syncer)
    log(f"resuming from {path} at step {step}" + (" (the syncer brings the current global adapter)"
                                                   if cfg.syncer else ""))
    return state


def save_training_state(learner, cfg: TrainConfig, out: Path, residual: Optional[np.ndarray] = None,
                        finished: bool = False) -> None:
    """Save what `resume_state` needs (with --syncer, the delta quantizer's error-feedback residual too)."""
    from yeto.checkpoint import run_identity, save_state

    if not hasattr(learner, "training_state"):
        return
    state = learner.training_state()
    state.meta.update(run=run_identity(learner), finished=finished)
    if residual is not None:
        state.tensors["residual"] = residual
    save_state(out, state)


def run_training(learner, cfg: TrainConfig, session: Session, show_progress: bool = True) -> dict[str, Any]:
    """Evaluate, train (standalone or as an island of --syncer's run), evaluate again, save the adapter.

    The training state is saved in --out as it goes (yeto.checkpoint), and the same command resumes from it."""
    out, console = session.out, session.console
    resumed = resume_state(learner, cfg, out, session.log)
    if resumed is None and cfg.init_adapter:
        start_from_adapter(learner, cfg.init_adapter, session.log)
    metrics = MetricsLog(out / "metrics.jsonl")
    (out / "run.json").write_text(json.dumps(learner.record(), indent=2))
    if resumed is not None:
        metrics.write(event="resumed", step=learner.step_count, tokens=learner.tokens_seen)
    eval0 = learner.evaluate()
    metrics.write(event="eval", step=learner.step_count, eval_loss=eval0)
    if cfg.syncer:
        tag = f"[bold]island {cfg.learner_id}[/bold] "
        residual = resumed.tensors.get("residual") if resumed is not None else None
        try:
            extra = _island_loop(learner, cfg, metrics, console, tag, session.join_key, residual,
                                 lambda r: save_training_state(learner, cfg, out, r))
        except BaseException as e:  # refused, gave up on the syncer, Ctrl-C, SIGTERM, a crash: keep the adapter
            try:
                adapter = learner.save(out / "adapter")
                metrics.write(event="aborted", steps=learner.step_count, reason=repr(e)[:300])
                console.print(f"{tag}[yellow]stopped early[/yellow]; adapter (the last global it received): {adapter}")
            except Exception as save_error:  # never hide the first error behind a second one
                console.print(f"{tag}[red]could not save the adapter[/red]: {save_error!r}")
            raise
        if hasattr(learner, "relay_s"):  # a torchrun island: rank 0's time relaying to the other ranks
            extra["relay_s"] = round(learner.relay_s, 3)
        done = f"{extra['rounds']} rounds, {learner.step_count} steps, utilization {extra['utilization']:.1%}"
    else:
        tag = ""
        extra = _standalone_loop(learner, cfg, metrics, console, eval0, show_progress, out)
        done = f"{learner.step_count} steps, {extra['tok_s']:.0f} tok/s"
    final_eval = learner.evaluate()
    metrics.write(event="eval", step=learner.step_count, eval_loss=final_eval)
    adapter = learner.save(out / "adapter")
    save_training_state(learner, cfg, out, finished=True)
    summary = {"adapter": str(adapter), "steps": learner.step_count, "eval_loss_before": eval0,
               "eval_loss_after": final_eval, "tokens": learner.tokens_seen, "loss_tokens": learner.loss_tokens_seen,
               "shard": list(learner.shard) if getattr(learner, "shard", None) else None, **extra}
    metrics.write(event="done", **summary)
    metrics.close()
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    ev = (f"eval loss {eval0:.3f} -> {final_eval:.3f}" if eval0 is not None and final_eval is not None
          else "no eval split")
    console.print(f"{tag}[green]done[/green]: {done}, {ev}; adapter: {adapter}")
    return summary


def _standalone_loop(learner, cfg: TrainConfig, metrics: MetricsLog, console, eval0: float | None,
                     show_progress: bool, out: Path) -> dict[str, Any]:
    """Up to `--max-steps` steps (from where a resumed run was) with a progress bar, periodic eval and saves."""
    from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn,
                               TimeRemainingColumn)

    history: list[dict[str, Any]] = []
    progress = Progress(
        TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.fields[info]}"),
        TimeElapsedColumn(), TimeRemainingColumn(), console=console, disable=not show_progress,
    )
    t0 = time.perf_counter()
    last_eval = eval0
    tokens0, loss_tokens0 = learner.tokens_seen, learner.loss_tokens_seen
    with progress:
        task = progress.add_task("train", total=cfg.max_steps, completed=learner.step_count, info="")
        while learner.step_count < cfg.max_steps:
            t = time.perf_counter()
            s = learner.step()
            if cfg.step_delay:
                time.sleep(cfg.step_delay)  # a simulated slow island (tests): the delay counts as its compute
            dt = time.perf_counter() - t
            s.update(tok_s=s["tokens"] / dt, loss_tok_s=s["loss_tokens"] / dt)
            if not math.isfinite(s["loss"]):
                raise YetoError(f"loss is {s['loss']} at step {s['step']}; lower --lr or check the data")
            if cfg.eval_every and s["step"] % cfg.eval_every == 0 and s["step"] < cfg.max_steps:
                last_eval = learner.evaluate()
                metrics.write(event="eval", step=s["step"], eval_loss=last_eval)
            metrics.write(event="step", **s)
            history.append(s)
            if cfg.save_every and s["step"] % cfg.save_every == 0 and s["step"] < cfg.max_steps:
                save_training_state(learner, cfg, out)
            ev = f" eval {last_eval:.3f}" if last_eval is not None else ""
            progress.update(task, advance=1, info=f"loss {s['loss']:.3f}{ev} {s['tok_s']:.0f} tok/s")
    elapsed = time.perf_counter() - t0
    first, last = (history[0]["loss"], history[-1]["loss"]) if history else (None, None)
    return {"first_loss": first, "last_loss": last, "tok_s": (learner.tokens_seen - tokens0) / elapsed,
            "loss_tok_s": (learner.loss_tokens_seen - loss_tokens0) / elapsed}


def _island_loop(learner, cfg: TrainConfig, metrics: MetricsLog, console, tag: str, join_key,
                 residual: Optional[np.ndarray], save_state: Callable[[np.ndarray], None]) -> dict[str, Any]:
    """One island of a DiLoCo run: the syncer decides rounds, merges and the end; `save_state(residual)` runs at
    the start of every round, and `residual` (a resumed learner's) seeds the delta quantizer's error feedback."""
    from rich.markup import escape

    from yeto.diloco import learner_identity, run_island
    from yeto.sync.core.learner import LinkTimeouts

    def on_round(r: dict[str, Any]) -> None:
        metrics.write(event="round", **r)
        console.print(f"{tag}round {r['round']}: {r['steps']} steps, loss {r['loss']:.4f}, {r['tokens']} tokens")

    def on_sigterm(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt  # unwinds the training loop, which says goodbye; train() saves the adapter

    previous = (signal.signal(signal.SIGTERM, on_sigterm) if threading.current_thread() is threading.main_thread()
                else None)
    try:
        return run_island(learner, cfg.syncer, cfg.learner_id, overlap=cfg.overlap, progress=on_round,
                          max_inner_steps=cfg.max_inner_steps, step_delay=cfg.step_delay,
                          join_key=join_key, identity=learner_identity(cfg.out), residual=residual,
                          on_round_start=save_state,
                          timeouts=LinkTimeouts(dead_after_s=cfg.syncer_timeout, give_up_s=cfg.give_up_after),
                          log_fn=lambda s: console.print(f"{tag}[dim]{escape(s)}[/dim]"))
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


# ----------------------------------------------------------------------------- CLI

D = TrainConfig()
TEST_HOOKS = ("step_delay",)  # flags for fault tests (a simulated slow island): they work, --help does not show them
# `yeto train --help` shows these after the everyday flags (their defaults need no touching)
TRAIN_ADVANCED = ("model_revision", "data_revision", "data_config", "trust_remote_code", "grad_accum", "lora_freeze_a",
                  "micro_batch_size", "min_lr_ratio", "weight_decay", "max_grad_norm", "lora_dropout", "lora_targets",
                  "loss_function", "eval_fraction", "dtype", "gradient_checkpointing", "full_logits", "overlap",
                  "threads", "max_inner_steps", "syncer_timeout", "give_up_after", "shard", "base_quantization",
                  "save_every")


def make_train_command(train_fn: Callable[[TrainConfig, bool], dict[str, Any]], doc: str) -> Callable[..., None]:
    """The `train` command with every flag, for any backend: `train_fn(config, show_progress)` runs it."""

    def command(**kwargs: Any) -> None:
        progress = kwargs.pop("progress")
        train_fn(TrainConfig(**kwargs), progress)

    import functools
    import inspect

    from yeto.usage import with_help_panels

    wrapper = functools.wraps(_train_signature)(command)
    wrapper.__signature__ = inspect.signature(_train_signature, eval_str=True)
    with_help_panels(wrapper, advanced=TRAIN_ADVANCED, hidden=TEST_HOOKS)
    wrapper.__doc__ = doc
    return wrapper


def _train_signature(
    model: Annotated[str, typer.Option(help="Model alias (see `yeto models`), "
                                            "local HF directory, or hub id.")] = D.model,
    data: Annotated[str, typer.Option(help="Data: a .jsonl/.json/.parquet/.csv/.txt file, a directory of them, "
                                           "or a hub dataset id.")] = D.data,
    out: Annotated[str, typer.Option(help="Run directory: metrics.jsonl, run.json, "
                                          "summary.json and adapter/.")] = D.out,
    model_revision: Annotated[Optional[str], typer.Option(help="Hub revision (branch, tag or commit) of the model; "
                                                               "resolved to one commit and recorded.")] = None,
    data_revision: Annotated[Optional[str], typer.Option(help="Hub revision of the dataset; "
                                                              "resolved to one commit and recorded.")] = None,
    data_split: Annotated[str, typer.Option(help="Dataset split to train on; the held-out set is the dataset's "
                                                 "validation (else test) split where it has one, else "
                                                 "--eval-fraction of this split.")] = D.data_split,
    data_config: Annotated[Optional[str], typer.Option(help="Dataset config (subset) to read, for a dataset with "
                                                            "several (README `configs` or one subfolder each).")
                           ] = None,
    trust_remote_code: Annotated[bool, typer.Option(help="Allow the model repo's own Python code to run "
                                                         "(off unless given).")] = False,
    seq_len: Annotated[int, typer.Option(help="Tokens per packed block.")] = D.seq_len,
    batch_size: Annotated[int, typer.Option(help="Blocks per batch (per rank under torchrun).")] = D.batch_size,
    grad_accum: Annotated[int, typer.Option(help="Batches per optimizer step (gradient accumulation).")] = D.grad_accum,
    lora_freeze_a: Annotated[bool, typer.Option(help="Train lora_B only; lora_A stays at the run's shared "
                                                     "initialization (FFA-LoRA: the syncer's average of B is then "
                                                     "exact). Every learner of a run must agree.")] = False,
    micro_batch_size: Annotated[str, typer.Option(help="Blocks through the model at once: all (the whole batch), N, "
                                                       "or auto (the largest that fits the device, probed at start); "
                                                       "the gradient is the same whatever it is.")
                        ] = D.micro_batch_size,
    max_steps: Annotated[int, typer.Option(help="Optimizer steps to run "
                                                "(with --syncer the syncer decides when to stop; "
                                                "this is then the LR schedule's horizon for --round-seconds runs).")
                         ] = D.max_steps,
    lr: Annotated[float, typer.Option(help="Peak AdamW learning rate.")] = D.lr,
    warmup_steps: Annotated[int, typer.Option(help="Linear warmup steps before the cosine decay.")] = D.warmup_steps,
    min_lr_ratio: Annotated[float, typer.Option(help="Cosine decays to this fraction of --lr.")] = D.min_lr_ratio,
    weight_decay: Annotated[float, typer.Option(help="AdamW weight decay.")] = D.weight_decay,
    max_grad_norm: Annotated[float, typer.Option(help="Gradient clipping norm.")] = D.max_grad_norm,
    lora_r: Annotated[int, typer.Option(help="LoRA rank.")] = D.lora_r,
    lora_alpha: Annotated[float, typer.Option(help="LoRA alpha (scale = alpha / r).")] = D.lora_alpha,
    lora_dropout: Annotated[float, typer.Option(help="Dropout on the LoRA input.")] = D.lora_dropout,
    lora_targets: Annotated[str, typer.Option(help="Which linears to adapt: attention, all-linear or auto (attention; "
                                                   "MoE: plus non-expert linears, never routers).")] = D.lora_targets,
    loss_function: Annotated[str, typer.Option(help="cross_entropy, or module:function "
                                                    "taking (logits[N,V], targets[N], weights[N]) -> scalar.")
                             ] = D.loss_function,
    eval_every: Annotated[int, typer.Option(help="Evaluate the held-out loss every N steps "
                                                 "(0: only at start and end).")] = D.eval_every,
    eval_fraction: Annotated[float, typer.Option(help="Fraction of records held out "
                                                      "for the eval loss.")] = D.eval_fraction,
    seed: Annotated[int, typer.Option(help="Seed for the split, the batch order and the LoRA init.")] = D.seed,
    learner_id: Annotated[int, typer.Option(help="This learner's index, for data sharding.")] = D.learner_id,
    num_learners: Annotated[int, typer.Option(help="How many shards the data is cut into (this learner takes "
                                                   "--learner-id's). 0: the whole data standalone; with --syncer, "
                                                   "the run's count, which the syncer says.")] = D.num_learners,
    device: Annotated[str, typer.Option(help="auto, cpu, cuda, cuda:N or mps.")] = D.device,
    dtype: Annotated[str, typer.Option(help="auto (fp32 on CPU, bf16 on GPU), "
                                            "float32, bfloat16 or float16.")] = D.dtype,
    gradient_checkpointing: Annotated[bool, typer.Option(help="Recompute activations in the backward pass "
                                                              "to save memory.")] = False,
    full_logits: Annotated[bool, typer.Option(help="Compute the LM head on every position "
                                                   "(default: loss-bearing positions only).")] = False,
    syncer: Annotated[Optional[str], typer.Option(help="HOST:PORT of a syncer: train as one DiLoCo island of its run "
                                                       "(default: standalone).")] = None,
    overlap: Annotated[bool, typer.Option(help="With --syncer: keep training while a merge is in flight, "
                                               "then apply it as a correction.")] = False,
    threads: Annotated[int, typer.Option(help="torch CPU threads (0: torch's default).")] = D.threads,
    max_inner_steps: Annotated[int, typer.Option(help="With --syncer: do at most this many inner steps per round "
                                                      "(a weaker island contributing less; "
                                                      "0: the syncer's policy).")] = D.max_inner_steps,
    step_delay: Annotated[float, typer.Option(help="Sleep this long after each step, "
                                                   "to simulate a slow island (tests, benchmarks).")] = D.step_delay,
    syncer_timeout: Annotated[float, typer.Option(help="With --syncer: silence (seconds) after which the connection is "
                                                       "presumed dead and remade, with backoff.")] = D.syncer_timeout,
    give_up_after: Annotated[float, typer.Option(help="With --syncer: give up (exit 2, adapter saved) after the syncer "
                                                      "has been unreachable this long.")] = D.give_up_after,
    join_key: Annotated[Optional[str], typer.Option(help="With --syncer: the run's join key file (the syncer writes "
                                                         "DIR/join.key), or set YETO_JOIN_KEY to its contents.")
                        ] = None,
    insecure: Annotated[bool, typer.Option(help="With --syncer: no encryption, no key (a syncer on 127.0.0.1 "
                                                "started with --insecure).")] = False,
    shard: Annotated[str, typer.Option(help="Under torchrun: ddp (the frozen base on every rank) or fsdp (the frozen "
                                            "base sharded across the ranks per transformer block; LoRA whole on "
                                            "each), for a base larger than one device.")] = D.shard,
    base_quantization: Annotated[str, typer.Option(help="none, or nf4: the frozen base in 4-bit NF4 through "
                                                        "bitsandbytes (QLoRA; CUDA only).")] = D.base_quantization,
    save_every: Annotated[int, typer.Option(help="Save the training state (optimizer, schedule, data position, RNG) "
                                                 "in --out every N steps, so the same command resumes a killed run "
                                                 "(0: only at the end; with --syncer: every round).")] = D.save_every,
    fresh: Annotated[bool, typer.Option(help="Start over: ignore the training state in --out (of a killed or "
                                             "finished run) and replace it.")] = False,
    init_adapter: Annotated[Optional[str], typer.Option(help="Start from this peft adapter (directory or hub id) "
                                                             "instead of a fresh LoRA: a fine-tune continued; with "
                                                             "--syncer, the founding learner's becomes the run's "
                                                             "first global. Its base and LoRA shape must be the "
                                                             "run's.")] = None,
    progress: Annotated[bool, typer.Option(help="Show the progress bar.")] = True,
) -> None:
    """(the flags of `yeto train`; see make_train_command)"""
