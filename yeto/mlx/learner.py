"""The MLX learner island: `python -m yeto.mlx.learner` with the torch learner's flags.

Same adapter (yeto.mlx.lora matches peft), same target rule (yeto.lora), same
blocks and masks (yeto.data with the Hugging Face tokenizer), same weighted
per-token cross-entropy re-derived in MLX. One process is one island; with
`--syncer` the DiLoCo bridge (yeto.diloco) drives it exactly as it drives the
torch learner, crossing mx -> numpy only at round boundaries.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable

import numpy as np

from yeto import YetoError
from yeto.data import Blocks, prepare_data
from yeto.island import BatchSampler, TrainConfig, island_record, lr_lambda, make_train_command, train
from yeto.micro_batch import WHOLE_BATCH
from yeto.models import load_tokenizer, resolve_model


def sft_loss_mx(logits, targets, weights):
    """sum_i w_i * CE(logits_i, target_i) / sum_i w_i: yeto.losses.sft_loss in MLX."""
    import mlx.core as mx
    import mlx.nn as nn

    ce = nn.losses.cross_entropy(logits.astype(mx.float32), targets, reduction="none")
    return (ce * weights).sum() / mx.maximum(weights.sum(), 1e-8)


class MLXLearner:
    """Model + our LoRALinear + data + AdamW on MLX: a `yeto.diloco.Island`."""

    backend = "mlx"

    def __init__(self, cfg: TrainConfig, log: Callable[[str], None] = print):
        if cfg.loss_function != "cross_entropy":
            raise YetoError(f"the MLX learner supports --loss-function cross_entropy only, got {cfg.loss_function!r} "
                            "(a torch callable cannot run on MLX)")
        for name in ("batch_size", "grad_accum", "max_steps", "seq_len"):
            if getattr(cfg, name) < 1:
                raise YetoError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(cfg, name)}")
        if cfg.base_quantization != "none":
            raise YetoError("--base-quantization is the torch learner's (bitsandbytes); an MLX island quantizes "
                            "through mlx-lm's converted models instead (drop it)")
        if cfg.shard != "ddp":
            raise YetoError(f"--shard {cfg.shard} is for torchrun islands of the torch learner; an MLX island is one "
                            "process (drop --shard)")
        if cfg.micro_batch_size != WHOLE_BATCH:
            raise YetoError("--micro-batch-size is the torch learner's; an MLX island runs each --batch-size whole "
                            "(lower --batch-size and raise --grad-accum to use less memory)")
        if cfg.gradient_checkpointing or cfg.full_logits:
            log("note: --gradient-checkpointing / --full-logits are torch-learner options; ignored on MLX")
        from yeto.mlx.compat import import_mlx_lm, load_mlx_model

        import_mlx_lm()
        import mlx.core as mx
        import mlx.optimizers as optim
        from transformers import AutoConfig

        from yeto.lora import lora_spec_for, select_targets
        from yeto.mlx.lora import apply_lora, freeze_lora_a, mlx_linears

        self.cfg = cfg
        self.mx = mx
        self.model_artifact = resolve_model(cfg.model, cfg.model_revision)  # a hub snapshot is materialized first
        self.tokenizer = load_tokenizer(self.model_artifact, cfg.trust_remote_code)
        self.data = prepare_data(cfg.data, self.tokenizer, cfg.seq_len, cfg.learner_id, cfg.num_learners,
                                 cfg.eval_fraction, cfg.seed, cfg.data_revision)
        log(f"data: {json.dumps(self.data.stats)}")
        mx.random.seed(cfg.seed)
        self.model = load_mlx_model(self.model_artifact.path)
        hf_config = AutoConfig.from_pretrained(self.model_artifact.path, trust_remote_code=cfg.trust_remote_code)
        linears = mlx_linears(self.model)
        self.targets = select_targets(linears, hf_config, cfg.lora_targets, ["lm_head"])
        self.lora = lora_spec_for(self.targets, linears, cfg.lora_r, cfg.lora_alpha, cfg.lora_dropout)
        apply_lora(self.model, self.targets, cfg.lora_r, cfg.lora_alpha, cfg.lora_dropout)
        if cfg.lora_freeze_a:
            freeze_lora_a(self.model)
        n_train = sum(int(np.prod(v.shape)) for v in self.adapter_state().values())
        import os

        blas = "OpenBLAS preloaded" if "openblas" in os.environ.get("LD_PRELOAD", "") else "MLX's bundled BLAS"
        log(f"model: {self.model_artifact.name} @ {self.model_artifact.revision[:19]} "
            f"on MLX {mx.default_device()} ({blas}); "
            f"LoRA r={cfg.lora_r} on {len(self.targets)} linears, {n_train / 1e6:.2f}M trainable params")
        self.optimizer = optim.AdamW(learning_rate=cfg.lr, betas=[0.9, 0.999], eps=1e-8, weight_decay=cfg.weight_decay)
        self.total_steps = cfg.max_steps
        self.sampler = BatchSampler(len(self.data.train), cfg.batch_size, cfg.seed + 1000 * cfg.learner_id)
        import mlx.nn as nn

        self._value_and_grad = nn.value_and_grad(self.model, self._loss)
        self.step_count = 0
        self.tokens_seen = 0
        self.loss_tokens_seen = 0

    # ------------------------------------------------------------------ the math

    def _head(self, h):
        model = self.model
        if hasattr(model, "lm_head"):
            return model.lm_head(h)
        return model.model.embed_tokens.as_linear(h)

    def _loss(self, model, ids, rows, targets, weights):
        """Loss on the loss-bearing rows only: the LM head runs on those rows (as the torch learner)."""
        hidden = model.model(ids)
        h = hidden[:, :-1].reshape(-1, hidden.shape[-1])[rows]
        return sft_loss_mx(self._head(h), targets, weights)

    def _batch(self, blocks: Blocks, idx: np.ndarray):
        mx = self.mx
        ids = blocks.input_ids[idx]
        w = blocks.loss_mask[idx][:, 1:].reshape(-1)
        rows = np.flatnonzero(w > 0)
        targets = ids[:, 1:].reshape(-1)[rows]
        return (mx.array(ids), mx.array(rows.astype(np.int32)), mx.array(targets.astype(np.int32)), mx.array(w[rows]),
                float(w.sum()))

    def step(self) -> dict[str, Any]:
        from mlx.optimizers import clip_grad_norm
        from mlx.utils import tree_map

        mx, cfg = self.mx, self.cfg
        self.model.train()
        micro = [self._batch(self.data.train, self.sampler.next()) for _ in range(cfg.grad_accum)]
        total_w = sum(m[4] for m in micro)
        grads, loss_sum = None, 0.0
        for ids, rows, targets, w, wsum in micro:
            if wsum == 0:
                continue
            loss, g = self._value_and_grad(self.model, ids, rows, targets, w)
            share = wsum / total_w
            g = tree_map(lambda x: x * share, g)
            grads = g if grads is None else tree_map(lambda a, b: a + b, grads, g)
            loss_sum += float(loss) * wsum
        lr = cfg.lr * lr_lambda(self.step_count, cfg.warmup_steps, self.total_steps, cfg.min_lr_ratio)
        norm = 0.0
        if grads is not None:  # every micro-batch may lack targets only in degenerate data; then no update
            grads, norm = clip_grad_norm(grads, cfg.max_grad_norm)
            self.optimizer.learning_rate = lr
            self.optimizer.update(self.model, grads)
            mx.eval(self.model.trainable_parameters(), self.optimizer.state)
        self.step_count += 1
        tokens = sum(int(m[0].size) for m in micro)
        self.tokens_seen += tokens
        self.loss_tokens_seen += int(total_w)
        return {"step": self.step_count, "loss": loss_sum / max(total_w, 1e-8), "lr": lr, "grad_norm": float(norm),
                "tokens": tokens, "loss_tokens": int(total_w)}

    def evaluate(self, blocks: Blocks | None = None) -> float | None:
        blocks = self.data.eval if blocks is None else blocks
        if len(blocks) == 0:
            return None
        self.model.eval()
        total = weight = 0.0
        for start in range(0, len(blocks), self.cfg.batch_size):
            ids, rows, targets, w, wsum = self._batch(
                blocks, np.arange(start, min(start + self.cfg.batch_size, len(blocks)))
            )
            if wsum:
                total += float(self._loss(self.model, ids, rows, targets, w)) * wsum
                weight += wsum
        return total / weight if weight else None

    # ------------------------------------------------------------------ the Island view

    def adapter_state(self) -> dict[str, np.ndarray]:
        from yeto.mlx.lora import lora_state

        return {k: np.array(v, dtype=np.float32) for k, v in lora_state(self.model).items()}

    def load_adapter_state(self, state: dict[str, np.ndarray]) -> None:
        from yeto.mlx.lora import to_mlx_path

        mine = self.adapter_state()
        missing = set(mine) - set(state)
        if missing:
            raise YetoError(f"adapter state lacks {len(missing)} tensors, e.g. {sorted(missing)[0]}")
        self.model.load_weights(
            [(to_mlx_path(k), self.mx.array(np.asarray(state[k], dtype=np.float32))) for k in mine], strict=False
        )
        self.mx.eval(self.model.trainable_parameters())

    def adapter_config(self) -> dict[str, Any]:
        from yeto.adapter import peft_config_dict

        return peft_config_dict(self.lora, self.record())

    def set_total_steps(self, total: int) -> None:
        self.total_steps = total

    def record(self) -> dict[str, Any]:
        return island_record(self)

    def save(self, out_dir: str | Path) -> Path:
        from yeto.adapter import write_adapter

        return write_adapter(out_dir, self.adapter_state(), self.adapter_config(), self.record())


train_command = make_train_command(lambda cfg, progress: train(cfg, MLXLearner, progress),
                                   doc="Train a LoRA adapter on one MLX island (Apple silicon; MLX's CPU backend on "
                                       "Linux).")


def main() -> None:
    from yeto.cli import run_typer
    from yeto.mlx.compat import reexec_with_fast_blas

    reexec_with_fast_blas()
    run_typer(train_command)


if __name__ == "__main__":
    main()
