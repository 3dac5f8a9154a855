"""The torch island: one process (or one torchrun group), one LoRA adapter, AdamW inner steps.

`TorchIsland` holds the model, data and optimizer and exposes the pieces a
training loop needs (the `yeto.island.interface.Island` members); `yeto.island.training`
runs the loop around them (standalone, or as one island of a DiLoCo run).

Run it as `yeto train --backend torch ...` (the default off Apple silicon) or `python -m yeto.backends.torch ...`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Optional

import numpy as np
import torch

from yeto import YetoError
from yeto.models.adapter import save_adapter
from yeto.island.checkpoint import TrainState
from yeto.eval.task import Prompt
from yeto.island.data import Blocks
from yeto.backends.torch.generate import greedy_batch
from yeto.backends.torch.losses import LossFn, load_loss_function
from yeto.backends.torch.lora import lora_config
from yeto.island.lora_targets import is_lora_a
from yeto.island.micro_batch import chunks, largest_that_fits, parse_micro_batch_size
from yeto.island.train_config import TrainConfig, check_config
from yeto.island.metrics import island_record
from yeto.island.schedule import lr_lambda
from yeto.island.shard import ShardedData
from yeto.models.materialize import default_device, load_model, load_tokenizer, resolve_model
from yeto.backends.torch.torchrun import SHARDINGS, RankGroup, shard_base

__all__ = ["TorchIsland", "TrainConfig", "masked_loss"]


def check_device(device: str) -> None:
    """--device names a device this machine has: auto, cpu, cuda, cuda:N or mps."""
    kind, _, index = device.partition(":")
    if kind not in ("auto", "cpu", "cuda", "mps") or (index and (kind != "cuda" or not index.isdigit())):
        raise YetoError(f"unknown --device {device!r}: use auto, cpu, cuda, cuda:N or mps")
    if kind == "cuda" and not torch.cuda.is_available():
        raise YetoError(f"--device {device}, but this machine has no CUDA device torch can use: use --device auto "
                        "or cpu (or install torch's CUDA build)")
    if kind == "cuda" and index and int(index) >= torch.cuda.device_count():
        raise YetoError(f"--device {device}, but this machine has {torch.cuda.device_count()} CUDA device(s)")
    if kind == "mps" and not torch.backends.mps.is_available():
        raise YetoError("--device mps, but MPS is not available here (Apple silicon only): use --device auto or cpu")


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


class TorchIsland(ShardedData):
    """Model + LoRA + data + AdamW: the state of one island's inner loop (a `yeto.island.diloco.Island`)."""

    backend = "torch"

    def __init__(self, cfg: TrainConfig, log: Callable[[str], None] = print, group: Optional[RankGroup] = None):
        self.cfg = cfg
        self.group = group  # a torchrun island: this rank trains on its slice of every global batch
        check_config(cfg)
        check_device(cfg.device)
        if cfg.threads > 0:
            torch.set_num_threads(cfg.threads)
        self.device = default_device() if cfg.device == "auto" else cfg.device
        if group is not None and self.device == "cuda":
            self.device = f"cuda:{group.local_rank}"
        dtype = None if cfg.dtype == "auto" else {"float32": torch.float32, "bfloat16": torch.bfloat16,
                                                  "float16": torch.float16}[cfg.dtype]
        self.loss_fn = load_loss_function(cfg.loss_function)
        self.model_artifact = resolve_model(cfg.model, cfg.model_revision)
        self.tokenizer = load_tokenizer(self.model_artifact, cfg.trust_remote_code)
        self.ranks = group.world if group is not None else 1
        self.read_data(cfg, self.tokenizer, log)
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
        tried: dict[int, bool] = {}

        def fits(n: int) -> bool:
            shape = (n, self.cfg.seq_len)  # (the tokens do not matter, only the shape)
            ids, mask = self._batch(Blocks(np.zeros(shape, np.int64), np.ones(shape, np.float32)), np.arange(n))
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
        blocks = self.train_blocks()
        micro = [self._batch(blocks, self._mine(self.sampler.next())) for _ in range(cfg.grad_accum)]
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
        blocks = self.source.eval if blocks is None else blocks
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

    def generate(self, prompts: list[Prompt], max_new_tokens: int) -> list[str]:
        """Greedy answers from the model as it is (base + the adapter held), dropout off; training mode after."""
        self.model.eval()
        try:
            return greedy_batch(self.model, self.tokenizer, prompts, max_new_tokens)
        finally:
            self.model.train()

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
        from yeto.models.adapter import peft_config_dict

        return peft_config_dict(self.model.peft_config["default"], self.record())

    def set_total_steps(self, total: int) -> None:
        """Stretch the LR schedule over the whole run (the syncer knows how long it is)."""
        cfg = self.cfg
        self.total_steps = total
        self.scheduler.lr_lambdas[0] = lambda s: lr_lambda(s, cfg.warmup_steps, total, cfg.min_lr_ratio)
        self._apply_lr()

    def _apply_lr(self) -> None:
        """The schedule's LR at the current step, now (LambdaLR sets it only when it steps: the next step would still
        take the LR the old schedule gave it)."""
        self.scheduler.last_epoch = self.step_count
        lr = self.cfg.lr * self.scheduler.lr_lambdas[0](self.step_count)
        for g in self.optimizer.param_groups:
            g["lr"] = lr
        self.scheduler._last_lr = [lr]

    def record(self) -> dict[str, Any]:
        return island_record(self)

    def save(self, out_dir: str | Path) -> Path:
        return save_adapter(self.model, out_dir, self.record())

    def training_state(self) -> TrainState:
        """The adapter, AdamW moments, counters, schedule position, batch position and dropout RNG
        (yeto.island.checkpoint)."""
        tensors = {f"adapter/{k}": v for k, v in self.adapter_state().items()}
        param_steps = {}
        for name, p in self.trainable.items():
            st = self.optimizer.state.get(p)
            if st:
                tensors[f"exp_avg/{name}"] = st["exp_avg"].detach().float().cpu().numpy()
                tensors[f"exp_avg_sq/{name}"] = st["exp_avg_sq"].detach().float().cpu().numpy()
                param_steps[name] = int(st["step"])
        tensors["rng/torch"] = torch.get_rng_state().numpy()
        if self.device.startswith("cuda"):
            tensors["rng/cuda"] = torch.cuda.get_rng_state(self.device).numpy()
        meta = {"backend": self.backend, "step": self.step_count, "tokens": self.tokens_seen,
                "loss_tokens": self.loss_tokens_seen, "total_steps": getattr(self, "total_steps", self.cfg.max_steps),
                "sampler": self.sampler.position() if self.sampler else None, "shard": self.shard,
                "param_steps": param_steps}
        return TrainState(meta, tensors)

    @torch.no_grad()
    def load_training_state(self, state: TrainState, adapter: bool = True) -> None:
        """Continue from `state` (`adapter`: restore its adapter too; in a fleet the rejoin brings the global)."""
        if adapter:
            self.load_adapter_state(state.group("adapter"))
        exp_avg, exp_avg_sq, steps = state.group("exp_avg"), state.group("exp_avg_sq"), state.meta["param_steps"]
        for name, p in self.trainable.items():
            if name in exp_avg and p.requires_grad:
                self.optimizer.state[p] = {
                    "step": torch.tensor(float(steps[name]), dtype=torch.float32),
                    "exp_avg": torch.from_numpy(exp_avg[name].copy()).to(p.device, p.dtype),
                    "exp_avg_sq": torch.from_numpy(exp_avg_sq[name].copy()).to(p.device, p.dtype)}
        self.step_count, self.tokens_seen = int(state.meta["step"]), int(state.meta["tokens"])
        self.loss_tokens_seen = int(state.meta["loss_tokens"])
        self.resume_data(state.meta)
        if state.meta.get("total_steps") and self.cfg.syncer:  # (standalone: --max-steps, which may have grown)
            self.set_total_steps(int(state.meta["total_steps"]))
        self._apply_lr()  # the schedule continues at the saved step (no second warm-up)
        rng = state.group("rng")
        if "torch" in rng:
            torch.set_rng_state(torch.from_numpy(rng["torch"].copy()))
        if "cuda" in rng and self.device.startswith("cuda"):
            torch.cuda.set_rng_state(torch.from_numpy(rng["cuda"].copy()), self.device)
