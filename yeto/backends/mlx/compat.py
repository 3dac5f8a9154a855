"""Compatibility shims between mlx-lm, transformers and Linux.

- `import_mlx_lm`: mlx-lm, or a clear error naming the fix when it fails to import.
- `mlx_config_shim`: transformers >= 4.54 writes `rope_parameters: {rope_theta: ...}` instead of a
  top-level `rope_theta`; mlx-lm then silently falls back to its default theta and, for SmolLM2,
  generates garbage. The shim hoists those keys back to where mlx-lm reads them, and fills the
  few keys mlx-lm requires that transformers 5 does not write (LFM2's `block_dim`).
- `fast_blas_env`: the Linux `mlx[cpu]` wheel bundles a slow reference BLAS; Debian's OpenBLAS
  (`libopenblas0-pthread`), preloaded, multiplies matrices tens of times faster (see docs/benchmarks.md,
  MLX island). `set_blas_threads` then sets its thread count (`--threads`).
- `load_mlx_model` refuses, in one line, a model type mlx-lm has no implementation of, or one the MLX island does
  not train yet (`NOT_YET`); `mlx_implements` says beforehand which it trains (`yeto models` marks the others).
"""

from __future__ import annotations

import ctypes
import json
import os
import sys
from pathlib import Path
from typing import Any

from yeto import YetoError

OPENBLAS_CANDIDATES = (
    "/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3",
    "/usr/lib/aarch64-linux-gnu/openblas-pthread/libblas.so.3",
)


def import_mlx_lm():
    """Import mlx_lm, or explain what to install."""
    try:
        import mlx.core  # noqa: F401
    except ImportError as e:
        raise YetoError(f"MLX is not installed ({e}); install yeto's mlx extra: pip install 'yeto[mlx]' "
                        "(on Linux this pulls mlx[cpu])") from e
    try:
        import mlx_lm
        import mlx_lm.utils  # noqa: F401
    except ImportError as e:
        # mlx-lm releases before 0.28 import tokenizer internals that transformers 5 lacks;
        # yeto never uses mlx-lm's tokenizer wrapper, but the import itself fails.
        import transformers

        raise YetoError(f"mlx-lm failed to import under transformers {transformers.__version__} ({e}); "
                        "upgrade it: pip install -U 'mlx-lm>=0.28'") from e
    return mlx_lm


# keys mlx-lm requires that transformers 5 does not write, derived from ones it does write
DERIVED_KEYS = {"lfm2": {"block_dim": "hidden_size"}, "qwen3_moe": {"num_experts": "num_local_experts"}}
# Gemma 3's rope per layer type (transformers 5: rope_parameters.{full,sliding}_attention), as mlx-lm's keys
LAYER_TYPE_ROPE = {"full_attention": "rope_theta", "sliding_attention": "rope_local_base_freq"}
# model types mlx-lm implements that the MLX island does not train yet, and why (`load_mlx_model` refuses them)
NOT_YET = {
    "gpt_oss": "mlx-lm loads the hub's MXFP4 expert tensors only, not the unquantized layout transformers saves",
}


def mlx_config_shim(config: dict[str, Any]) -> dict[str, Any]:
    """Config overrides for mlx-lm: hoist `rope_parameters` entries to the top level; derive the keys it needs."""
    rope = config.get("rope_parameters")
    out: dict[str, Any] = {}
    if isinstance(rope, dict):
        for layer_type, key in LAYER_TYPE_ROPE.items():
            if isinstance(rope.get(layer_type), dict) and "rope_theta" in rope[layer_type] and key not in config:
                out[key] = rope[layer_type]["rope_theta"]
        if "rope_theta" in rope and "rope_theta" not in config:
            out["rope_theta"] = rope["rope_theta"]
        kind = rope.get("rope_type", "default")
        if kind not in (None, "default") and "rope_scaling" not in config:
            out["rope_scaling"] = {k: v for k, v in rope.items() if k != "rope_theta"} | {"type": kind}
        if "partial_rotary_factor" in rope and "partial_rotary_factor" not in config:
            out["partial_rotary_factor"] = rope["partial_rotary_factor"]
    for key, source in DERIVED_KEYS.get(config.get("model_type", ""), {}).items():
        if key not in config and source in config:
            out[key] = config[source]
    text = config.get("text_config")
    if isinstance(text, dict) and "vocab_size" in text and "vocab_size" not in config:  # mlx-lm's gemma3 reads it here
        out["vocab_size"] = text["vocab_size"]
    pattern = sliding_window_pattern(config.get("layer_types"))
    if pattern and "sliding_window_pattern" not in config:
        out["sliding_window_pattern"] = pattern
    for sub in ("text_config",):
        if isinstance(config.get(sub), dict):
            inner = mlx_config_shim(config[sub])
            if inner:
                out[sub] = {**config[sub], **inner}
    return out


def sliding_window_pattern(layer_types: Any) -> int | None:
    """Gemma's `sliding_window_pattern` (every Nth layer global) from transformers 5's `layer_types`, where they
    follow one; mlx-lm reads only the pattern, and defaults it to 6."""
    if not isinstance(layer_types, list) or not {"full_attention", "sliding_attention"} <= set(layer_types):
        return None
    n = layer_types.index("full_attention") + 1
    periodic = all((t == "full_attention") == ((i + 1) % n == 0) for i, t in enumerate(layer_types))
    return n if periodic else None


def mlx_implements(model_type: str) -> bool | None:
    """Whether the installed mlx-lm has an implementation of `model_type` (its own remapping included); None when
    mlx-lm is not installed."""
    import importlib.util

    if importlib.util.find_spec("mlx_lm") is None:
        return None
    import mlx_lm.utils

    remapped = mlx_lm.utils.MODEL_REMAPPING.get(model_type, model_type)
    return model_type not in NOT_YET and importlib.util.find_spec(f"mlx_lm.models.{remapped}") is not None


def load_mlx_model(path: str | Path):
    """mlx-lm's model for a HF directory, with the config shim applied."""
    mlx_lm = import_mlx_lm()
    path = Path(path)
    config = json.loads((path / "config.json").read_text())
    if config.get("model_type") in NOT_YET:
        raise YetoError(f"the MLX island does not train model_type {config['model_type']!r} yet "
                        f"({NOT_YET[config['model_type']]}); train this model with the torch island "
                        "(yeto train --backend torch)")
    overrides = mlx_config_shim(config)
    get_classes = getattr(mlx_lm.utils, "_get_classes", None)  # mlx-lm's own lookup (remappings included)
    if get_classes is not None:
        try:
            get_classes({**config, **overrides})
        except ValueError as e:
            raise YetoError(f"mlx-lm {mlx_lm.__version__} has no implementation of model_type "
                            f"{config.get('model_type')!r} ({e}); train this model with the torch island "
                            "(yeto train --backend torch)") from e
    model, _ = mlx_lm.utils.load_model(path, model_config=overrides)
    return model


def fast_blas_library() -> str | None:
    for cand in OPENBLAS_CANDIDATES:
        if os.path.exists(cand):
            return cand
    return None


def fast_blas_env(env: dict[str, str] | None = None) -> dict[str, str] | None:
    """The environment with OpenBLAS preloaded, or None if not on Linux / not installed / already set."""
    env = dict(os.environ if env is None else env)
    lib = fast_blas_library()
    if (not sys.platform.startswith("linux") or lib is None or lib in env.get("LD_PRELOAD", "")
            or env.get("YETO_NO_FAST_BLAS")):
        return None
    env["LD_PRELOAD"] = f"{lib}:{env['LD_PRELOAD']}" if env.get("LD_PRELOAD") else lib
    return env


def set_blas_threads(n: int) -> bool:
    """Set OpenBLAS's thread count where OpenBLAS is this process's BLAS (preloaded); False where it is not."""
    setter = getattr(ctypes.CDLL(None), "openblas_set_num_threads", None)  # the global namespace: preloaded libraries
    if setter is None:
        return False
    setter(ctypes.c_int(n))
    return True


def reexec_with_fast_blas() -> None:
    """Re-exec this process with OpenBLAS preloaded (before MLX is imported), once."""
    env = fast_blas_env()
    if env is None or "mlx.core" in sys.modules:
        return
    os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], env)
