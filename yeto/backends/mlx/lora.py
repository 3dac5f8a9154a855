"""LoRA for MLX that matches peft exactly: names, shapes, init, scale, flatten order.

mlx-lm's own LoRA stores transposed factors under other names; ours stores
`lora_A` as (r, in) and `lora_B` as (out, r) like peft, initializes A with
kaiming-uniform(a=sqrt(5)) (uniform in ±1/sqrt(in)) and B with zeros, and adds
`(alpha / r) * dropout(x) @ A.T @ B.T` to the frozen base linear. So the MLX
tree path `model.layers.N.self_attn.q_proj.lora_A` is peft's
`base_model.model.model.layers.N.self_attn.q_proj.lora_A.default.weight`.
Where mlx-lm names a module otherwise than transformers (`RENAMES`: Gemma 3's multimodal decoder, LFM2-MoE's dense
MLP), paths are renamed both ways, so every name outside this module is transformers'.
"""

from __future__ import annotations

import math

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_unflatten

from yeto.island.lora_targets import Linear

PEFT_PREFIX = "base_model.model."
PEFT_SUFFIX = ".default.weight"

Renames = tuple[tuple[str, str], ...]  # (mlx-lm's path segment, transformers') pairs
RENAMES: dict[str, Renames] = {
    "gemma3": (("language_model.model.", "model.language_model."),),
    "lfm2_moe": ((".feed_forward.gate_proj", ".feed_forward.w1"), (".feed_forward.down_proj", ".feed_forward.w2"),
                 (".feed_forward.up_proj", ".feed_forward.w3")),
}


def renames_of(model: nn.Module) -> Renames:
    """The renames of an mlx-lm model (by its `model_type`); none for most."""
    return RENAMES.get(getattr(model, "model_type", ""), ())


def hf_path(mlx_path: str, renames: Renames = ()) -> str:
    """An mlx-lm module path as transformers names that module."""
    for mine, theirs in renames:
        mlx_path = mlx_path.replace(mine, theirs)
    return mlx_path


def mlx_module_path(hf: str, renames: Renames = ()) -> str:
    """A transformers module path as mlx-lm names that module."""
    for mine, theirs in renames:
        hf = hf.replace(theirs, mine)
    return hf


def to_peft_name(mlx_path: str, renames: Renames = ()) -> str:
    ("""`model.layers.0.self_attn.q_proj.lora_A` -> """
     """`base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight`.""")
    return PEFT_PREFIX + hf_path(mlx_path, renames) + PEFT_SUFFIX


def to_mlx_path(peft_name: str, renames: Renames = ()) -> str:
    if not (peft_name.startswith(PEFT_PREFIX) and peft_name.endswith(PEFT_SUFFIX)):
        raise ValueError(f"not a peft LoRA parameter name: {peft_name}")
    return mlx_module_path(peft_name[len(PEFT_PREFIX) : -len(PEFT_SUFFIX)], renames)


class LoRALinear(nn.Module):
    def __init__(self, base: nn.Module, r: int, alpha: float, dropout: float = 0.0):
        super().__init__()
        out_features, in_features = linear_shape(base)
        self.base = base
        self.base.freeze()
        self.scale = alpha / r
        self.dropout = nn.Dropout(dropout) if dropout > 0 else None
        bound = 1.0 / math.sqrt(in_features)  # kaiming_uniform_(a=sqrt(5)), as peft does
        self.lora_A = mx.random.uniform(-bound, bound, (r, in_features))
        self.lora_B = mx.zeros((out_features, r))

    def __call__(self, x: mx.array) -> mx.array:
        y = self.base(x)
        h = self.dropout(x) if self.dropout is not None else x
        return y + self.scale * ((h @ self.lora_A.T) @ self.lora_B.T).astype(y.dtype)


def linear_shape(m: nn.Module) -> tuple[int, int]:
    """(out, in) of an nn.Linear or nn.QuantizedLinear."""
    if isinstance(m, nn.QuantizedLinear):
        out, packed = m.weight.shape
        return out, packed * 32 // m.bits
    return tuple(m.weight.shape)


def mlx_linears(model: nn.Module) -> list[Linear]:
    """(name, in, out) of every linear, named like the HF module tree."""
    out, renames = [], renames_of(model)
    for name, m in model.named_modules():
        if isinstance(m, (nn.Linear, nn.QuantizedLinear)):
            o, i = linear_shape(m)
            out.append((hf_path(name, renames), i, o))
    return out


def apply_lora(model: nn.Module, targets: list[str], r: int, alpha: float, dropout: float = 0.0) -> None:
    """Freeze the model and wrap each target linear in a LoRALinear (in sorted name order,
    so the random init draws are the same whatever the tree order)."""
    model.freeze()
    renames = renames_of(model)
    modules = dict(model.named_modules())
    paths = {t: mlx_module_path(t, renames) for t in targets}  # targets: transformers' names
    missing = [t for t, path in paths.items() if path not in modules]
    if missing:
        raise ValueError(f"LoRA targets not in the MLX model: {missing[:3]}")
    model.update_modules(tree_unflatten([(paths[t], LoRALinear(modules[paths[t]], r, alpha, dropout))
                                         for t in sorted(targets)]))


def lora_state(model: nn.Module) -> dict[str, mx.array]:
    """The LoRA arrays (trained or frozen) under their peft names."""
    renames = renames_of(model)
    return {to_peft_name(k, renames): v for k, v in tree_flatten(model.parameters())
            if k.endswith((".lora_A", ".lora_B"))}


def freeze_lora_a(model: nn.Module) -> None:
    """FFA-LoRA: every lora_A keeps its value (the run's shared initialization); only lora_B trains."""
    for _, m in model.named_modules():
        if isinstance(m, LoRALinear):
            m.freeze(keys=["lora_A"], recurse=False)
