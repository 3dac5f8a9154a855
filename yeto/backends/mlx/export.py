"""`yeto export ADAPTER --merged OUT` on MLX (a Mac with `yeto[mlx]` alone): mlx-lm's own fuse (each LoRA layer's
`fuse()`: W + scale x B A) and its own `save` (safetensors, config, tokenizer and chat template), the checkpoint
`mlx_lm.fuse` writes. For most architectures its tensor names are transformers' own, so AutoModelForCausalLM loads
it as it loads torch's export; Gemma 3 and LFM2-MoE keep mlx-lm's names (yeto.backends.mlx.lora.RENAMES), which
mlx-lm loads and transformers does not."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable, Optional

from yeto.models.adapter import AUTO_DTYPE, check_export, export_dir_for, finish_export


def export_merged(adapter: str | Path, out: str | Path, model: Optional[str] = None,
                  model_revision: Optional[str] = None, dtype: str = AUTO_DTYPE, force: bool = False,
                  trust_remote_code: bool = False, log: Callable[[str], None] = print) -> Path:
    """Write base + adapter fused to `out` (written beside it, then moved in place: a failed export leaves no half
    checkpoint); returns `out`."""
    out = Path(out).expanduser()
    check_export(out, dtype, force)
    import mlx.core as mx
    from mlx.utils import tree_unflatten
    from mlx_lm.utils import save

    from yeto.backends.mlx.generate import add_adapter, load_base

    base, tokenizer, artifact, adapter_dir = load_base(model, adapter, model_revision, trust_remote_code)
    log(f"base {artifact.name} @ {artifact.revision[:19]}; adapter {adapter_dir}; on MLX {mx.default_device()}")
    add_adapter(base, adapter_dir)
    fused = [(n, m.fuse(dequantize=False)) for n, m in base.named_modules() if hasattr(m, "fuse")]  # mlx_lm.fuse's
    base.update_modules(tree_unflatten(fused))
    config = json.loads((Path(artifact.path) / "config.json").read_text())
    if dtype != AUTO_DTYPE:
        base.set_dtype(getattr(mx, dtype))
        config["torch_dtype"] = dtype
    written = str(next(v.dtype for _, v in _weights(base))).removeprefix("mlx.core.")
    tmp = export_dir_for(out)
    save(tmp, artifact.path, base, tokenizer, config, donate_model=False)
    finish_export(tmp, out, {"base": artifact.to_dict(), "adapter": str(adapter_dir.resolve()), "dtype": written,
                             "backend": "mlx"}, adapter_dir)
    log(f"merged model: {out}, {written} ({len(fused)} LoRA layers fused by mlx-lm; mlx_lm.load and, for most "
        "architectures, AutoModelForCausalLM.from_pretrained load it)")
    return out


def _weights(model):
    from mlx.utils import tree_flatten

    return tree_flatten(model.parameters())
