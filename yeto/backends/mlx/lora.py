"""LoRA for MLX that matches peft exactly: names, shapes, init, scale, flatten order.

mlx-lm's own LoRA stores transposed factors under other names; ours stores
`lora_A` as (r, in) and `lora_B` as (out, r) like peft, initializes A with
kaiming-uniform(a=sqrt(5)) (uniform in ±1/sqrt(in)) and B with zeros, and adds
`(alpha / r) * dropout(x) @ A.T @ B.T` to the frozen base linear. So the MLX
tree path `model.layers.N.self_attn.q_proj.lora_A` is peft's
`base_model.model.model.layers.N.self_attn.q_proj.lora_A.default.weight`.
"""

from __future__ import annotations

import math

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_unflatten

from yeto.island.lora import Linear

PEFT_PREFIX = "base_model.model."
PEFT_SUFFIX = ".default.weight"


def to_peft_name(mlx_path: str) -> str:
    ("""`model.layers.0.self_attn.q_proj.lora_A` -> """
     """`base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight`.""")
    return PEFT_PREFIX + mlx_path + PEFT_SUFFIX


def to_mlx_path(peft_name: str) -> str:
    if not (peft_name.startswith(PEFT_PREFIX) and peft_name.endswith(PEFT_SUFFIX)):
        raise ValueError(f"not a peft LoRA parameter name: {peft_name}")
    return peft_name[len(PEFT_PREFIX) : -len(PEFT_SUFFIX)]


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
    out = []
    for name, m in model.named_modules():
        if isinstance(m, (nn.Linear, nn.QuantizedLinear)):
            o, i = linear_shape(m)
            out.append((name, i, o))
    return out


def apply_lora(model: nn.Module, targets: list[str], r: int, alpha: float, dropout: float = 0.0) -> None:
    """Freeze the model and wrap each target linear in a LoRALinear (in sorted name order,
    so the random init draws are the same whatever the tree order)."""
    model.freeze()
    modules = dict(model.named_modules())
    missing = [t for t in targets if t not in modules]
    if missing:
        raise ValueError(f"LoRA targets not in the MLX model: {missing[:3]}")
    model.update_modules(tree_unflatten([(t, LoRALinear(modules[t], r, alpha, dropout)) for t in sorted(targets)]))


def lora_state(model: nn.Module) -> dict[str, mx.array]:
    """The LoRA arrays (trained or frozen) under their peft names."""
    return {to_peft_name(k): v for k, v in tree_flatten(model.parameters()) if k.endswith((".lora_A", ".lora_B"))}


def freeze_lora_a(model: nn.Module) -> None:
    """FFA-LoRA: every lora_A keeps its value (the run's shared initialization); only lora_B trains."""
    for _, m in model.named_modules():
        if isinstance(m, LoRALinear):
            m.freeze(keys=["lora_A"], recurse=False)
