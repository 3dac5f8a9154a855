"""The tensor backends, peers that never import each other: torch (+ peft) and MLX.

`choose_backend` turns `yeto train --backend auto|torch|mlx` into one of them (auto: MLX on Apple silicon where
`yeto[mlx]` is installed, torch everywhere else) and `load_backend` gives its `yeto.island.interface.Backend`;
`choose_runtime` does the same for `yeto generate` and `yeto export`, whose auto also takes MLX where it is all
there is (a Mac's `yeto[mlx]` alone); none imports a tensor library.
"""

from __future__ import annotations

import platform
from typing import TYPE_CHECKING, Optional

from yeto import TORCH_EXTRA, YetoError, missing_module, missing_torch, require_torch

if TYPE_CHECKING:
    from yeto.island.interface import Backend

AUTO, TORCH, MLX = "auto", "torch", "mlx"
NAMES = (TORCH, MLX)
CHOICES = (AUTO, *NAMES)
MLX_MODULES = ("mlx", "mlx_lm")  # the mlx extra's (pip install 'yeto[mlx]')
MLX_EXTRA = "pip install 'yeto[mlx]'"
APPLE_SILICON = ("Darwin", "arm64")  # (platform.system(), platform.machine()) of a Mac MLX trains on


def missing_mlx() -> Optional[str]:
    """The first of the mlx extra's modules this install cannot import (None when it has them all)."""
    return missing_module(MLX_MODULES)


def apple_silicon() -> bool:
    return (platform.system(), platform.machine()) == APPLE_SILICON


def choose_backend(requested: str, what: str = "yeto train") -> str:
    """The backend `--backend requested` names (auto: MLX on Apple silicon with the mlx extra, else torch), refused
    in one line when it is unknown or its extra is not installed."""
    if requested not in CHOICES:
        raise YetoError(f"unknown --backend {requested!r}: use auto, torch or mlx")
    name = requested
    if requested == AUTO:
        name = MLX if apple_silicon() and missing_mlx() is None else TORCH
    if name == MLX:
        missing = missing_mlx()
        if missing is not None:
            raise YetoError(f"--backend mlx, but this install has no {missing}: {MLX_EXTRA} (on Linux it pulls "
                            "mlx[cpu]), or train with --backend torch")
    else:
        require_torch(what if requested == AUTO else f"{what} --backend torch")
    return name


def choose_runtime(requested: str, what: str) -> str:
    """The backend `yeto generate` or `yeto export` runs on: `choose_backend`'s, except that auto also picks MLX
    where torch is missing and MLX is installed (they train nothing, so a Mac's `yeto[mlx]` alone does both); with
    neither installed, one line naming both extras."""
    if requested == AUTO and missing_torch() is not None:
        if missing_mlx() is None:
            return MLX
        raise YetoError(f"{what} runs on torch or MLX and this install has neither: {TORCH_EXTRA} (on a Mac: "
                        f"{MLX_EXTRA})")
    return choose_backend(requested, what)


def load_backend(name: str) -> Backend:
    """The backend called `name` (one of NAMES); it loads its tensor library only when it trains."""
    if name == MLX:
        from yeto.backends.mlx.backend import MLXBackend

        return MLXBackend()
    if name == TORCH:
        from yeto.backends.torch.backend import TorchBackend

        return TorchBackend()
    raise YetoError(f"unknown backend {name!r}: use {', '.join(NAMES)}")
