"""The torch learner island: one process, one LoRA adapter, AdamW inner steps.

`TorchLearner` holds the model, data and optimizer and exposes the pieces a
training loop needs (`step`, `evaluate`, `adapter_state`, `save`); `train`
is the standalone loop around them, with a progress bar and a JSONL metrics
log. The DiLoCo bridge drives the same `step` between syncs.

Run it as `yeto train ...` or `python -m yeto.learner ...`.
"""

from __future__ import annotations

import json
import math
import signal
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Annotated, Any, Callable, Optional

import numpy as np
import torch
import typer

from yeto import YetoError, __version__
from yeto.adapter import save_adapter
from yeto.data import Blocks, prepare_data
from yeto.losses import LossFn, load_loss_function
from yeto.lora import is_lora_a, lora_config
from yeto.micro_batch import WHOLE_BATCH, chunks, largest_that_fits, parse_micro_batch_size
from yeto.models import default_device, load_model, load_tokenizer, resolve_model
from yeto.torchrun import SHARDINGS, RankGroup, RelayedIsland, follow, shard_base


@dataclass
class TrainConfig:
    model: str = "smollm2-135m"
    data: str = "data/demo"
    out: str = "runs/train"
    model_revision: Optional[str] = None
    data_revision: Optional[str] = None
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
    num_learners: int = 1
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


def masked_loss(model, input_ids: torch.Tensor, loss_mask: torch.Tensor, loss_fn: LossFn,
                full_logits: bool = False) -> torch.Tensor:
    """Loss over the loss-bearing positions only.

    The LM head (hidden x vocab, the widest matmul of a small model) and the
    cross-entropy run only on rows whose next token is a target, so on chat data
    the prompt tokens cost a forward/backward through the body and nothing more.
    """
    weights = loss_mask[:, 1:]
    sel = weights > 0
    targets = input_ids[:, 1:][sel]
    w = weights[sel]
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    decoder = getattr(base, getattr(base, "base_model_prefix", "model"), None)
    head = base.get_output_embeddings() if hasattr(base, "get_output_embeddings") else None
    special_logits = any(getattr(base.config, k, None)
                         for k in ("final_logit_softcapping", "logit_scale", "logits_scaling"))
    if full_logits or decoder is None or head is None or special_logits:
        logits = model(input_ids=input_ids, use_cache=False).logits[:, :-1][sel]
    else:
        hidden = decoder(input_ids=input_ids, use_cache=False).last_hidden_state
        logits = head(hidden[:, :-1][sel])
    return loss_fn(logits, targets, w)


class TorchLearner:
    """Model + LoRA + data + AdamW: the state of one island's inner loop (a `yeto.diloco.Island`)."""

    backend = "torch"

    def __init__(self, cfg: TrainConfig, log: Callable[[str], None] = print, group: Optional[RankGroup] = None):
        self.cfg = cfg
        self.group = group  # a torchrun island: this rank trains on its slice of every global batch
        if cfg.threads > 0:
            torch.set_num_threads(cfg.threads)
        self.device = default_device() if cfg.device == "auto" else cfg.device
        if group is not None and self.device == "cuda":
            self.device = f"cuda:{group.local_rank}"
        dtype = None if cfg.dtype == "auto" else {"float32": torch.float32, "bfloat16": torch.bfloat16,
                                                  "float16": torch.float16}.get(cfg.dtype)
        if cfg.dtype != "auto" and dtype is None:
            raise YetoError(f"unknown --dtype {cfg.dtype!r}: use auto, float32, bfloat16 or float16")
        for name in ("batch_size", "grad_accum", "max_steps", "seq_len"):
            if getattr(cfg, name) < 1:
                raise YetoError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(cfg, name)}")
        self.loss_fn = load_loss_function(cfg.loss_function)
        self.model_artifact = resolve_model(cfg.model, cfg.model_revision)
        self.tokenizer = load_tokenizer(self.model_artifact, cfg.trust_remote_code)
        self.data = prepare_data(
            cfg.data, self.tokenizer, cfg.seq_len, cfg.learner_id, cfg.num_learners, cfg.eval_fraction, cfg.seed,
            cfg.data_revision
        )
        log(f"data: {json.dumps(self.data.stats)}")
        torch.manual_seed(cfg.seed)
        base = load_model(self.model_artifact, self.device, dtype, cfg.trust_remote_code, cfg.base_quantization)
        from peft import get_peft_model

        self.lora = lora_config(base, cfg.lora_targets, cfg.lora_r, cfg.lora_alpha, cfg.lora_dropout)
        if cfg.gradient_checkpointing:
            base.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            base.enable_input_require_grads()
        self.model = get_peft_model(base, self.lora)
        self.trainable = {n: p for n, p in self.model.named_parameters() if p.requires_grad}  # the whole adapter
        if cfg.lora_freeze_a:  # still exchanged (the run's shared A), never updated: averaging B is then exact
            for name, p in self.trainable.items():
                p.requires_grad_(not is_lora_a(name))
        self.optimized = [p for p in self.trainable.values() if p.requires_grad]
        if cfg.shard not in SHARDINGS:
            raise YetoError(f"--shard must be one of {', '.join(SHARDINGS)}, got {cfg.shard!r}")
        if cfg.shard == "fsdp":
            if group is None:
                raise YetoError("--shard fsdp shards the frozen base across the ranks of a torchrun island: run under "
                                "torchrun --nproc-per-node N (N >= 2), or drop --shard")
            log(shard_base(self.model, base, list(self.trainable.values())))
        n_train = sum(p.numel() for p in self.optimized)
        log(f"model: {self.model_artifact.name} @ {self.model_artifact.revision[:19]} on {self.device}; "
            f"LoRA r={cfg.lora_r} on {len(self.trainable) // 2} linears, {n_train / 1e6:.2f}M trainable params")
        self.optimizer = torch.optim.AdamW(self.optimized, lr=cfg.lr, weight_decay=cfg.weight_decay, betas=(0.9, 0.999))
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda s: lr_lambda(s, cfg.warmup_steps, cfg.max_steps, cfg.min_lr_ratio)
        )
        self.ranks = group.world if group is not None else 1
        # every rank draws the same global batch (ranks x --batch-size) and trains on its own slice of it
        self.sampler = BatchSampler(len(self.data.train), cfg.batch_size * self.ranks, cfg.seed + 1000 * cfg.learner_id)
        if group is not None:
            group.align(list(self.trainable.values()))
        size = parse_micro_batch_size(cfg.micro_batch_size, cfg.batch_size)
        self.micro_batch = size if size is not None else self._probe_micro_batch(log)
        self.step_count = 0
        self.tokens_seen = 0
        self.loss_tokens_seen = 0

    def _batch(self, blocks: Blocks, idx: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        ids = torch.from_numpy(blocks.input_ids[idx]).to(self.device)
        mask = torch.from_numpy(blocks.loss_mask[idx]).to(self.device)
        return ids, mask

    def _probe_micro_batch(self, log: Callable[[str], None]) -> int:
        """--micro-batch-size auto: the largest micro-batch whose forward and backward fit on this device (and, in a
        torchrun island, on every rank), probed with full-length blocks whose every position bears loss. The probes
        leave no gradient and no trace in the random streams, so training is what it would be with that size given."""
        blocks = self.data.train
        tried: dict[int, bool] = {}

        def fits(n: int) -> bool:
            ids, mask = self._batch(blocks, np.arange(n) % len(blocks))
            ok = True
            try:
                masked_loss(self.model, ids, torch.ones_like(mask), self.loss_fn, self.cfg.full_logits).backward()
            except torch.OutOfMemoryError:
                ok = False  # (leaving the handler drops the exception and the activations its frames hold)
            self.optimizer.zero_grad(set_to_none=True)
            if self.device.startswith("cuda"):
                torch.cuda.empty_cache()
            if self.group is not None:
                ok = self.group.all(ok)
            tried[n] = ok
            return ok

        cuda = [torch.device(self.device)] if self.device.startswith("cuda") else []
        with torch.random.fork_rng(devices=cuda):
            self.model.train()
            size = largest_that_fits(fits, self.cfg.batch_size)
        if size == 0:
            raise YetoError(f"one block of --seq-len {self.cfg.seq_len} does not fit on {self.device}: "
                            "lower --seq-len, or add --gradient-checkpointing, --shard fsdp or --base-quantization nf4")
        too_big = sorted(n for n, ok in tried.items() if not ok)
        log(f"micro-batch: {size} of --batch-size {self.cfg.batch_size} (probed on {self.device}"
            + (f"; {too_big[0]} ran out of memory)" if too_big else ")"))
        return size

    def _mine(self, idx: np.ndarray) -> np.ndarray:
        """This rank's slice of a global batch."""
        if self.group is None:
            return idx
        b = self.cfg.batch_size
        return idx[self.group.rank * b:(self.group.rank + 1) * b]

    def step(self) -> dict[str, Any]:
        """One optimizer step over `grad_accum` micro-batches, token-weighted across them (and, in a torchrun
        island, across the ranks: the gradient is the whole global batch's)."""
        cfg = self.cfg
        self.model.train()
        micro = [self._batch(self.data.train, self._mine(self.sampler.next())) for _ in range(cfg.grad_accum)]
        total_w = sum(float(m[:, 1:].sum()) for _, m in micro)
        if self.group is not None:
            (total_w,) = self.group.sum_scalars(total_w)
        loss_sum = 0.0
        for ids, mask in micro:
            for rows in chunks(len(ids), self.micro_batch):
                w = float(mask[rows, 1:].sum())
                if w == 0:
                    continue
                loss = masked_loss(self.model, ids[rows], mask[rows], self.loss_fn, cfg.full_logits)
                (loss * (w / total_w)).backward()
                loss_sum += float(loss.detach()) * w
        tokens = sum(ids.numel() for ids, _ in micro)
        if self.group is not None:
            self.group.sum_grads(self.optimized)
            loss_sum, tokens = self.group.sum_scalars(loss_sum, tokens)
            tokens = int(tokens)
        grad_norm = float(torch.nn.utils.clip_grad_norm_(self.optimized, cfg.max_grad_norm))
        lr = self.scheduler.get_last_lr()[0]
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.step_count += 1
        self.tokens_seen += tokens
        self.loss_tokens_seen += int(total_w)
        return {"step": self.step_count, "loss": loss_sum / max(total_w, 1e-8), "lr": lr, "grad_norm": grad_norm,
                "tokens": tokens, "loss_tokens": int(total_w)}

    @torch.no_grad()
    def evaluate(self, blocks: Blocks | None = None) -> float | None:
        """Token-weighted mean loss over the held-out blocks."""
        blocks = self.data.eval if blocks is None else blocks
        if len(blocks) == 0:
            return None
        self.model.eval()
        total, weight = 0.0, 0.0
        for rows in chunks(len(blocks), self.micro_batch):
            ids, mask = self._batch(blocks, np.arange(rows.start, rows.stop))
            w = float(mask[:, 1:].sum())
            if w:
                total += float(masked_loss(self.model, ids, mask, self.loss_fn, self.cfg.full_logits)) * w
                weight += w
        return total / weight if weight else None

    def adapter_state(self) -> dict[str, np.ndarray]:
        """The canonical `{peft parameter name: fp32 array}` view the syncer exchanges
        (`base_model.model.<path>.lora_A.default.weight`)."""
        return {k: p.detach().float().cpu().numpy().copy() for k, p in self.trainable.items()}

    @torch.no_grad()
    def load_adapter_state(self, state: dict[str, np.ndarray]) -> None:
        missing = set(self.trainable) - set(state)
        if missing:
            raise YetoError(f"adapter state lacks {len(missing)} tensors, e.g. {sorted(missing)[0]}")
        for k, p in self.trainable.items():
            p.copy_(torch.from_numpy(np.asarray(state[k])).to(p.dtype))

    def adapter_config(self) -> dict[str, Any]:
        from yeto.adapter import peft_config_dict

        return peft_config_dict(self.model.peft_config["default"], self.record())

    def set_total_steps(self, total: int) -> None:
        """Stretch the LR schedule over the whole run (the syncer knows how long it is)."""
        cfg = self.cfg
        self.scheduler.lr_lambdas[0] = lambda s: lr_lambda(s, cfg.warmup_steps, total, cfg.min_lr_ratio)

    def record(self) -> dict[str, Any]:
        return island_record(self)

    def save(self, out_dir: str | Path) -> Path:
        return save_adapter(self.model, out_dir, self.record())


def island_record(learner) -> dict[str, Any]:
    """What a saved adapter and run.json say about the island that made it (any backend)."""
    return {
        "yeto_version": __version__,
        "backend": learner.backend,
        "model": learner.model_artifact.to_dict(),
        "data": learner.data.artifact.to_dict(),
        "data_stats": learner.data.stats,
        "config": asdict(learner.cfg),
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


def train(cfg: TrainConfig, show_progress: bool = True,
          learner_cls: Callable[..., Any] | None = None) -> dict[str, Any]:
    """Train one island: standalone (steps, periodic eval, final eval) or, with --syncer, as part
    of a DiLoCo run. The adapter is saved under `out/adapter`. `learner_cls` picks the backend."""
    from rich.console import Console

    console = Console(stderr=True)
    join_key = None
    group = RankGroup.from_env() if learner_cls is None else None  # under torchrun: one island, several ranks
    if group is not None and not group.leader:
        return _follow_rank(cfg, group)
    if cfg.syncer:  # before the model loads: a missing or bad key is a one-line error at once
        from yeto.sync.auth import learner_join_key

        join_key = learner_join_key(cfg.join_key, cfg.insecure, cfg.syncer)
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    log = lambda s: console.print(f"[dim]{s}[/dim]")  # noqa: E731
    learner = TorchLearner(cfg, log, group) if learner_cls is None else learner_cls(cfg, log=log)
    # in a torchrun island every call rank 0 makes goes to the other ranks first (a sharded forward is collective)
    island = RelayedIsland(learner, group) if group is not None else learner
    try:
        return _train(island, cfg, out, console, show_progress, join_key)
    finally:
        if group is not None:
            island.finish()  # the other ranks stop following (they would otherwise wait for a collective)
            group.close()


def _train(learner, cfg: TrainConfig, out: Path, console, show_progress: bool, join_key) -> dict[str, Any]:
    metrics = MetricsLog(out / "metrics.jsonl")
    (out / "run.json").write_text(json.dumps(learner.record(), indent=2))
    eval0 = learner.evaluate()
    metrics.write(event="eval", step=0, eval_loss=eval0)
    if cfg.syncer:
        tag = f"[bold]island {cfg.learner_id}[/bold] "
        try:
            extra = _island_loop(learner, cfg, metrics, console, tag, join_key)
        except BaseException as e:  # refused, gave up on the syncer, Ctrl-C, SIGTERM, a crash: keep the adapter
            try:
                adapter = learner.save(out / "adapter")
                metrics.write(event="aborted", steps=learner.step_count, reason=repr(e)[:300])
                console.print(f"{tag}[yellow]stopped early[/yellow]; adapter (the last global it received): {adapter}")
            except Exception as save_error:  # never hide the first error behind a second one
                console.print(f"{tag}[red]could not save the adapter[/red]: {save_error!r}")
            raise
        if isinstance(learner, RelayedIsland):
            extra["relay_s"] = round(learner.relay_s, 3)  # rank 0's time relaying to the other ranks
        done = f"{extra['rounds']} rounds, {learner.step_count} steps, utilization {extra['utilization']:.1%}"
    else:
        tag = ""
        extra = _standalone_loop(learner, cfg, metrics, console, eval0, show_progress)
        done = f"{learner.step_count} steps, {extra['tok_s']:.0f} tok/s"
    final_eval = learner.evaluate()
    metrics.write(event="eval", step=learner.step_count, eval_loss=final_eval)
    adapter = learner.save(out / "adapter")
    summary = {"adapter": str(adapter), "steps": learner.step_count, "eval_loss_before": eval0,
               "eval_loss_after": final_eval, "tokens": learner.tokens_seen, "loss_tokens": learner.loss_tokens_seen,
               **extra}
    metrics.write(event="done", **summary)
    metrics.close()
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    ev = (f"eval loss {eval0:.3f} -> {final_eval:.3f}" if eval0 is not None and final_eval is not None
          else "no eval split")
    console.print(f"{tag}[green]done[/green]: {done}, {ev}; adapter: {adapter}")
    return summary


def _follow_rank(cfg: TrainConfig, group: RankGroup) -> dict[str, Any]:
    """A torchrun island's rank other than 0: the same model and data, its slice of every batch, and the calls rank
    0 relays (standalone or with --syncer). Rank 0 alone logs, saves and talks."""
    try:
        learner = TorchLearner(cfg, log=lambda s: None, group=group)
        follow(learner, group)
    finally:
        group.close()
    return {"rank": group.rank, "steps": learner.step_count}


def _standalone_loop(learner, cfg: TrainConfig, metrics: MetricsLog, console, eval0: float | None,
                     show_progress: bool) -> dict[str, Any]:
    """`--max-steps` steps with a progress bar and periodic eval."""
    from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn,
                               TimeRemainingColumn)

    history: list[dict[str, Any]] = []
    progress = Progress(
        TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.fields[info]}"),
        TimeElapsedColumn(), TimeRemainingColumn(), console=console, disable=not show_progress,
    )
    t0 = time.perf_counter()
    last_eval = eval0
    with progress:
        task = progress.add_task("train", total=cfg.max_steps, info="")
        for _ in range(cfg.max_steps):
            t = time.perf_counter()
            s = learner.step()
            dt = time.perf_counter() - t
            s.update(tok_s=s["tokens"] / dt, loss_tok_s=s["loss_tokens"] / dt)
            if not math.isfinite(s["loss"]):
                raise YetoError(f"loss is {s['loss']} at step {s['step']}; lower --lr or check the data")
            if cfg.eval_every and s["step"] % cfg.eval_every == 0 and s["step"] < cfg.max_steps:
                last_eval = learner.evaluate()
                metrics.write(event="eval", step=s["step"], eval_loss=last_eval)
            metrics.write(event="step", **s)
            history.append(s)
            ev = f" eval {last_eval:.3f}" if last_eval is not None else ""
            progress.update(task, advance=1, info=f"loss {s['loss']:.3f}{ev} {s['tok_s']:.0f} tok/s")
    elapsed = time.perf_counter() - t0
    return {"first_loss": history[0]["loss"], "last_loss": history[-1]["loss"],
            "tok_s": learner.tokens_seen / elapsed, "loss_tok_s": learner.loss_tokens_seen / elapsed}


def _island_loop(learner, cfg: TrainConfig, metrics: MetricsLog, console, tag: str, join_key) -> dict[str, Any]:
    """One island of a DiLoCo run: the syncer decides rounds, merges and the end."""
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
                          join_key=join_key, identity=learner_identity(cfg.out),
                          timeouts=LinkTimeouts(dead_after_s=cfg.syncer_timeout, give_up_s=cfg.give_up_after),
                          log_fn=lambda s: console.print(f"{tag}[dim]{escape(s)}[/dim]"))
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


# ----------------------------------------------------------------------------- CLI

D = TrainConfig()


def make_train_command(learner_cls: Callable[..., Any] | None = None,
                       doc: str = "Train a LoRA adapter on one island.") -> Callable[..., None]:
    """The `train` command with every flag, for any backend (the MLX learner reuses it)."""

    def command(**kwargs: Any) -> None:
        progress = kwargs.pop("progress")
        train(TrainConfig(**kwargs), show_progress=progress, learner_cls=learner_cls)

    import functools
    import inspect

    wrapper = functools.wraps(_train_signature)(command)
    wrapper.__signature__ = inspect.signature(_train_signature, eval_str=True)
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
    num_learners: Annotated[int, typer.Option(help="How many learners share the data "
                                                   "(each gets a disjoint shard).")] = D.num_learners,
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
    step_delay: Annotated[float, typer.Option(help="Sleep this long after each inner step, "
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
    progress: Annotated[bool, typer.Option(help="Show the progress bar.")] = True,
) -> None:
    """(the flags of `yeto train`; see make_train_command)"""


train_command = make_train_command(doc="Train a LoRA adapter on one island (torch + peft): standalone, "
                                       "or with --syncer as part of a DiLoCo run.")


def main() -> None:
    from yeto.cli import run_typer

    run_typer(train_command)


if __name__ == "__main__":
    main()
