"""The MLX island: `yeto train --backend mlx` (or `python -m yeto.backends.mlx`), the torch island's
flags.

Same adapter (yeto.backends.mlx.lora matches peft), same target rule (yeto.island.lora_targets), same
blocks and masks (yeto.island.data with the Hugging Face tokenizer), same weighted
per-token cross-entropy re-derived in MLX, and the same optimizer step as the
torch island's `torch.optim.AdamW` + `clip_grad_norm_` + `LambdaLR`. One process
is one island; with `--syncer` the DiLoCo bridge (yeto.island.diloco) drives it exactly
as it drives the torch island, crossing mx -> numpy only at round boundaries.
A flag this backend cannot honour is refused (`check_flags`), never ignored.
"""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator, Optional

import numpy as np

from yeto import YetoError
from yeto.eval.task import Prompt
from yeto.island.checkpoint import TrainState
from yeto.island.data import Blocks
from yeto.island.train_config import TrainConfig, check_config
from yeto.island.metrics import island_record
from yeto.island.schedule import lr_lambda
from yeto.island.shard import ShardedData
from yeto.island.micro_batch import WHOLE_BATCH
from yeto.models.materialize import load_tokenizer, resolve_model

if TYPE_CHECKING:
    import mlx.core as mx
    import mlx.nn as nn

# torch.optim.AdamW's defaults, which the torch island uses
ADAM_BETAS = (0.9, 0.999)
ADAM_EPS = 1e-8
DEVICES = ("auto", "cpu")  # auto: MLX's default device (the Apple GPU; the CPU on Linux)
PROBE_TOKENS = 16  # tokens of the start-up check that the loss-rows-only path gives the model's own logits


def check_flags(cfg: TrainConfig) -> None:
    """Refuse, one line each and before any model loads, the flags an MLX island cannot honour (after the checks
    every backend makes)."""
    check_config(cfg)
    if cfg.loss_function != "cross_entropy":
        raise YetoError(f"the MLX island supports --loss-function cross_entropy only, got {cfg.loss_function!r} "
                        "(a torch callable cannot run on MLX)")
    if cfg.device not in DEVICES:
        raise YetoError(f"--device {cfg.device} is the torch island's; an MLX island runs on MLX's default device "
                        "(the Apple GPU; the CPU on Linux): use --device auto or cpu")
    if cfg.gradient_checkpointing:
        raise YetoError("--gradient-checkpointing is the torch island's; an MLX island keeps every activation "
                        "(lower --batch-size and raise --grad-accum to use less memory)")
    if cfg.base_quantization != "none":
        raise YetoError("--base-quantization is the torch island's (bitsandbytes); an MLX island quantizes "
                        "through mlx-lm's converted models instead (drop it)")
    if cfg.shard != "ddp":
        raise YetoError(f"--shard {cfg.shard} is for torchrun islands of the torch island; an MLX island is one "
                        "process (drop --shard)")
    if cfg.micro_batch_size != WHOLE_BATCH:
        raise YetoError("--micro-batch-size is the torch island's; an MLX island runs each --batch-size whole "
                        "(lower --batch-size and raise --grad-accum to use less memory)")


def sft_loss_mx(logits, targets, weights):
    """sum_i w_i * CE(logits_i, target_i) / sum_i w_i: yeto.backends.torch.losses.sft_loss in MLX."""
    import mlx.core as mx
    import mlx.nn as nn

    ce = nn.losses.cross_entropy(logits.astype(mx.float32), targets, reduction="none")
    return (ce * weights).sum() / mx.maximum(weights.sum(), 1e-8)


def find_decoder(model: nn.Module) -> Optional[nn.Module]:
    """The module that holds the model's blocks (mlx-lm's `model.layers`), wherever it sits (`model.model`,
    `model.transformer`, `model.language_model.model`, ...), or None."""
    layers = getattr(model, "layers", None)
    if not layers:
        return None
    first = layers[0]
    for _, module in model.named_modules():
        if any(isinstance(v, list) and v and v[0] is first for v in module.values()):
            return module
    return None


_ROWS_CLASSES: dict[type, type] = {}


@contextmanager
def loss_rows_only(decoder: nn.Module, rows: mx.array) -> Iterator[None]:
    """While active, `decoder` returns only the loss rows of its output, as (1, N, hidden): the model's own
    `__call__` then runs its head and logit transforms (soft-capping, scaling, ...) on those rows alone.

    The decoder's class is swapped for a subclass for the duration (its parameters stay where they are), so this
    works for every mlx-lm architecture without re-implementing its head; the island checks at start that it
    gives the model's own logits and otherwise runs the whole model."""
    base = type(decoder)
    sub = _ROWS_CLASSES.get(base)
    if sub is None:
        import mlx.core as mx

        def __call__(self, *args, **kwargs):
            h = base.__call__(self, *args, **kwargs)
            picked = type(self).rows
            if picked is None or not isinstance(h, mx.array) or h.ndim != 3:
                return h
            return h[:, :-1].reshape(-1, h.shape[-1])[picked][None]

        sub = _ROWS_CLASSES[base] = type(f"{base.__name__}LossRows", (base,), {"__call__": __call__, "rows": None})
    sub.rows = rows
    decoder.__class__ = sub
    try:
        yield
    finally:
        decoder.__class__ = base
        sub.rows = None


def loss_rows_decoder(model: nn.Module) -> Optional[nn.Module]:
    """The decoder to cut to the loss rows (`loss_rows_only`: the LM head then runs on those rows only, as in the
    torch island) if that gives the model's own logits on a probe; else None (the whole model runs)."""
    import mlx.core as mx

    decoder = find_decoder(model)
    if decoder is None:
        return None
    model.eval()  # (no dropout in the probe)
    ids = mx.arange(1, PROBE_TOKENS + 1)[None]
    rows = mx.arange(PROBE_TOKENS - 2, 0, -2)  # every other row, last first: mixing positions would show
    full = model(ids)
    tol = 1e-4 if full.dtype == mx.float32 else 2e-2  # relative: the two paths' matmuls differ in shape only
    full = full[:, :-1].reshape(-1, full.shape[-1])[rows].astype(mx.float32)
    with loss_rows_only(decoder, rows):
        cut = model(ids)[0].astype(mx.float32)
    if cut.shape != full.shape or float(mx.abs(cut - full).max()) > tol * max(1.0, float(mx.abs(full).max())):
        return None
    return decoder


class MLXIsland(ShardedData):
    """Model + our LoRALinear + data + AdamW on MLX: a `yeto.island.diloco.Island`."""

    backend = "mlx"

    def __init__(self, cfg: TrainConfig, log: Callable[[str], None] = print):
        check_flags(cfg)
        from yeto.backends.mlx.compat import import_mlx_lm, load_mlx_model, set_blas_threads

        import_mlx_lm()
        if cfg.threads > 0 and not set_blas_threads(cfg.threads):
            raise YetoError("--threads sets OpenBLAS's threads, and this MLX island does not run on OpenBLAS (run it "
                            "as yeto train --backend mlx on Linux with libopenblas0-pthread installed, or drop "
                            "--threads)")
        import mlx.core as mx

        if cfg.device == "cpu":
            mx.set_default_device(mx.cpu)
        import mlx.optimizers as optim
        from transformers import AutoConfig

        from yeto.island.lora_targets import lora_spec_for, select_targets
        from yeto.models.catalog import num_experts
        from yeto.backends.mlx.lora import apply_lora, freeze_lora_a, mlx_linears

        self.cfg = cfg
        self.mx = mx
        self.model_artifact = resolve_model(cfg.model, cfg.model_revision)  # a hub snapshot is materialized first
        self.tokenizer = load_tokenizer(self.model_artifact, cfg.trust_remote_code)
        self.read_data(cfg, self.tokenizer, log)
        mx.random.seed(cfg.seed)
        self.model = load_mlx_model(self.model_artifact.path)
        if cfg.dtype != "auto":  # the frozen base; the LoRA factors are made in float32, as peft keeps them
            self.model.set_dtype(getattr(mx, cfg.dtype))
        hf_config = AutoConfig.from_pretrained(self.model_artifact.path, trust_remote_code=cfg.trust_remote_code)
        linears = mlx_linears(self.model)
        self.targets = select_targets(linears, hf_config, cfg.lora_targets, ["lm_head"])
        self.lora = lora_spec_for(self.targets, linears, cfg.lora_r, cfg.lora_alpha, cfg.lora_dropout,
                                  num_experts(hf_config) > 0)
        apply_lora(self.model, self.targets, cfg.lora_r, cfg.lora_alpha, cfg.lora_dropout)
        if cfg.lora_freeze_a:
            freeze_lora_a(self.model)
        n_train = sum(int(np.prod(v.shape)) for v in self.adapter_state().values())
        import os

        blas = "OpenBLAS preloaded" if "openblas" in os.environ.get("LD_PRELOAD", "") else "MLX's bundled BLAS"
        log(f"model: {self.model_artifact.name} @ {self.model_artifact.revision[:19]} "
            f"on MLX {mx.default_device()} ({blas}); "
            f"LoRA r={cfg.lora_r} on {len(self.targets)} linears, {n_train / 1e6:.2f}M trainable params")
        # torch.optim.AdamW's step: p <- p * (1 - lr * wd), then p <- p - lr / (1 - b1^t) * m / (sqrt(v) /
        # sqrt(1 - b2^t) + eps). MLX's AdamW is that with bias_correction=True (its default, False, takes steps
        # ~3x torch's early on: m / sqrt(v) without the (1 - b^t) factors).
        self.optimizer = optim.AdamW(learning_rate=cfg.lr, betas=list(ADAM_BETAS), eps=ADAM_EPS,
                                     weight_decay=cfg.weight_decay, bias_correction=True)
        self.total_steps: Optional[int] = None  # the syncer's run length; None: --max-steps (or --epochs')
        import mlx.nn as nn

        self.decoder = None if cfg.full_logits else loss_rows_decoder(self.model)
        if self.decoder is None and not cfg.full_logits:
            log("loss: the loss-rows-only LM head does not give this model's own logits; it runs on every position")
        self._value_and_grad = nn.value_and_grad(self.model, self._loss)
        self.step_count = 0
        self.tokens_seen = 0
        self.loss_tokens_seen = 0
        self._generate_tokenizer: Any = None  # mlx-lm's wrapper, for `generate` (--eval-task): loaded when first used

    # ------------------------------------------------------------------ the math

    def _logits(self, model, ids, rows):
        """(N, vocab) logits of the loss-bearing rows, as the model's own forward makes them (its head, logit
        soft-capping and scaling included: yeto.backends.torch.island.masked_loss's logits)."""
        if self.decoder is None:
            logits = model(ids)
            return logits[:, :-1].reshape(-1, logits.shape[-1])[rows]
        with loss_rows_only(self.decoder, rows):
            return model(ids)[0]

    def _loss(self, model, ids, rows, targets, weights):
        """The torch island's masked_loss: sft_loss over the loss-bearing rows."""
        return sft_loss_mx(self._logits(model, ids, rows), targets, weights)

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
        blocks = self.train_blocks()
        micro = [self._batch(blocks, self.sampler.next()) for _ in range(cfg.grad_accum)]
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
        lr = cfg.lr * lr_lambda(self.step_count, cfg.warmup_steps, self.total_steps or cfg.max_steps,
                                 cfg.min_lr_ratio)
        norm = 0.0
        if grads is not None:  # every micro-batch may lack targets only in degenerate data; then no update
            # torch's clip_grad_norm_: g * min(1, max_norm / (total_norm + 1e-6)) over the whole adapter
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
        blocks = self.source.eval if blocks is None else blocks
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

    def generate(self, prompts: list[Prompt], max_new_tokens: int) -> list[str]:
        """Greedy answers from the model as it is (base + the adapter held; mlx-lm's batch generation over its
        own tokenizer, loaded once), dropout off; training mode after."""
        from yeto.backends.mlx.generate import greedy_batch, load_tokenizer as load_mlx_tokenizer

        if self._generate_tokenizer is None:
            self._generate_tokenizer = load_mlx_tokenizer(self.model_artifact, self.cfg.trust_remote_code)
        self.model.eval()
        try:
            return greedy_batch(self.model, self._generate_tokenizer, prompts, max_new_tokens)
        finally:
            self.model.train()

    # ------------------------------------------------------------------ the Island view

    def adapter_state(self) -> dict[str, np.ndarray]:
        from yeto.backends.mlx.lora import lora_state

        return {k: np.array(v, dtype=np.float32) for k, v in lora_state(self.model).items()}

    def load_adapter_state(self, state: dict[str, np.ndarray]) -> None:
        from yeto.backends.mlx.lora import renames_of, to_mlx_path

        mine, renames = self.adapter_state(), renames_of(self.model)
        missing = set(mine) - set(state)
        if missing:
            raise YetoError(f"adapter state lacks {len(missing)} tensors, e.g. {sorted(missing)[0]}")
        self.model.load_weights([(to_mlx_path(k, renames), self.mx.array(np.asarray(state[k], dtype=np.float32)))
                                 for k in mine], strict=False)
        self.mx.eval(self.model.trainable_parameters())

    def adapter_config(self) -> dict[str, Any]:
        from yeto.models.adapter import peft_config_dict

        return peft_config_dict(self.lora, self.record())

    def set_total_steps(self, total: int) -> None:
        self.total_steps = total

    def record(self) -> dict[str, Any]:
        return island_record(self)

    def save(self, out_dir: str | Path) -> Path:
        from yeto.models.adapter import write_adapter

        return write_adapter(out_dir, self.adapter_state(), self.adapter_config(), self.record())

    # ------------------------------------------------------------------ resuming (yeto.island.checkpoint)

    _MOMENTS = {"m": "exp_avg", "v": "exp_avg_sq"}  # MLX's AdamW state names -> torch's (the file's)

    def training_state(self) -> TrainState:
        """The adapter, AdamW moments, counters, schedule position, batch position and RNG key, under the torch
        island's canonical names."""
        from mlx.utils import tree_flatten

        from yeto.backends.mlx.lora import renames_of, to_peft_name

        renames = renames_of(self.model)
        tensors = {f"adapter/{k}": v for k, v in self.adapter_state().items()}
        flat = dict(tree_flatten(self.optimizer.state))
        for key, value in flat.items():
            path, _, moment = key.rpartition(".")
            if moment in self._MOMENTS and path.endswith((".lora_A", ".lora_B")):
                tensors[f"{self._MOMENTS[moment]}/{to_peft_name(path, renames)}"] = np.array(value, dtype=np.float32)
        step = int(flat["step"].item()) if "step" in flat else 0
        names = [k[len("exp_avg/"):] for k in tensors if k.startswith("exp_avg/")]
        tensors["rng/mlx"] = np.array(self.mx.random.state[0], dtype=np.uint32)
        meta = {"backend": self.backend, "step": self.step_count, "tokens": self.tokens_seen,
                "loss_tokens": self.loss_tokens_seen, "total_steps": self.total_steps or self.cfg.max_steps,
                "sampler": self.sampler.position() if self.sampler else None, "shard": self.shard,
                "param_steps": {n: step for n in names}}
        return TrainState(meta, tensors)

    def load_training_state(self, state: TrainState, adapter: bool = True) -> None:
        """Continue from `state` (`adapter`: restore its adapter too; in a fleet the rejoin brings the global)."""
        from mlx.utils import tree_flatten, tree_unflatten

        from yeto.backends.mlx.lora import renames_of, to_peft_name

        mx, renames = self.mx, renames_of(self.model)
        if adapter:
            self.load_adapter_state(state.group("adapter"))
        moments = {m: state.group(name) for m, name in self._MOMENTS.items()}
        self.optimizer.init(self.model.trainable_parameters())
        flat = dict(tree_flatten(self.optimizer.state))
        for key in flat:
            path, _, moment = key.rpartition(".")
            if moment in moments and path.endswith((".lora_A", ".lora_B")):
                saved = moments[moment].get(to_peft_name(path, renames))
                if saved is not None:
                    flat[key] = mx.array(saved)
        steps = set(state.meta["param_steps"].values())
        flat["step"] = mx.array(max(steps, default=0), dtype=mx.uint64)  # (MLX's AdamW keeps one step count)
        self.optimizer.state = tree_unflatten(list(flat.items()))
        self.step_count, self.tokens_seen = int(state.meta["step"]), int(state.meta["tokens"])
        self.loss_tokens_seen = int(state.meta["loss_tokens"])
        self.resume_data(state.meta)
        if state.meta.get("total_steps") and self.cfg.syncer:  # (standalone: --max-steps, which may have grown)
            self.total_steps = int(state.meta["total_steps"])
        key = state.group("rng").get("mlx")
        if key is not None:  # a key (hi, lo) is what mx.random.seed(hi << 32 | lo) sets
            mx.random.seed((int(key[0]) << 32) | int(key[1]))
        mx.eval(self.model.trainable_parameters(), self.optimizer.state)
