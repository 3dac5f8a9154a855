"""The torch island's training loss: weighted per-token cross-entropy, and user-supplied losses (the MLX island
re-derives the built-in one in MLX: yeto.backends.mlx.island.sft_loss_mx).

A loss function takes the rows that carry loss (already selected and flattened):

    fn(logits: Tensor[N, V], targets: Tensor[N] (int64), weights: Tensor[N] (float)) -> Tensor[]

and returns the weighted mean over those rows. The island calls it once per
micro-batch and rescales by the micro-batch's share of the step's total weight,
so a step's loss is token-weighted over the whole accumulated batch.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

from yeto import YetoError
from yeto.models.user_code import load_user_function

LossFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def sft_loss(logits: torch.Tensor, targets: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """sum_i w_i * CE(logits_i, target_i) / sum_i w_i (normalized by weight, not by row count)."""
    ce = F.cross_entropy(logits.float(), targets, reduction="none")
    return (ce * weights).sum() / weights.sum().clamp_min(1e-8)


BUILTIN: dict[str, LossFn] = {"cross_entropy": sft_loss}


def load_loss_function(spec: str) -> LossFn:
    """'cross_entropy', 'package.module:function' or 'path/to/loss.py:function'."""
    if spec in BUILTIN:
        return BUILTIN[spec]
    if ":" not in spec:
        raise YetoError(f"unknown --loss-function {spec!r}: use one of {sorted(BUILTIN)}, 'module:function' or "
                        "'path/to/loss.py:function'")
    return load_user_function(spec, "--loss-function")
