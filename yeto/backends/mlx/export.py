"""`yeto export ADAPTER --merged OUT` on MLX (a Mac with `yeto[mlx]` alone): mlx-lm's own fuse (each LoRA layer's
`fuse()`: W + scale x B A) and its own `save` (safetensors, config, tokenizer and chat template), the checkpoint
`mlx_lm.fuse` writes. For most architectures its tensor names are transformers' own, so AutoModelForCausalLM loads
it as it loads torch's export; Gemma 3 and LFM2-MoE keep mlx-lm's names (yeto.backends.mlx.lora.RENAMES), which
mlx-lm loads and transformers does not."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Callable, Optional

from yeto import YetoError, in_current_words
from yeto.models.adapter import RUN_RECORD

EXPORT_RECORD = "yeto_export.json"  # (the torch export's record, the same fields)
AUTO_DTYPE = "auto"  # the weights' own dtype, as the base's checkpoint holds them
DTYPES = (AUTO_DTYPE, "float32", "bfloat16", "float16")


def check_out(out: Path, force: bool) -> None:
    """A file, or a directory with something in it (unless --force), is not overwritten."""
    if out.exists() and not out.is_dir():
        raise YetoError(f"--merged {out} is a file: pass a directory")
    if out.is_dir() and any(out.iterdir()) and not force:
        raise YetoError(f"--merged {out} exists and is not empty: pick a new directory, or pass --force to replace it")


def export_merged(adapter: str | Path, out: str | Path, model: Optional[str] = None,
                  model_revision: Optional[str] = None, dtype: str = AUTO_DTYPE, force: bool = False,
                  trust_remote_code: bool = False, log: Callable[[str], None] = print) -> Path:
    """Write base + adapter fused to `out` (written beside it, then moved in place: a failed export leaves no half
    checkpoint); returns `out`."""
    if dtype not in DTYPES:
        raise YetoError(f"unknown --dtype {dtype!r}: use {', '.join(DTYPES)}")
    out = Path(out).expanduser()
    check_out(out, force)
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
    tmp = out.with_name(f".{out.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    save(tmp, artifact.path, base, tokenizer, config, donate_model=False)
    record = {"base": artifact.to_dict(), "adapter": str(adapter_dir.resolve()), "dtype": written, "backend": "mlx"}
    if (adapter_dir / RUN_RECORD).is_file():
        record["adapter_run"] = in_current_words(json.loads((adapter_dir / RUN_RECORD).read_text()))
    (tmp / EXPORT_RECORD).write_text(json.dumps(record, indent=2, sort_keys=True))
    if out.exists():
        shutil.rmtree(out)
    tmp.rename(out)
    log(f"merged model: {out}, {written} ({len(fused)} LoRA layers fused by mlx-lm; mlx_lm.load and, for most "
        "architectures, AutoModelForCausalLM.from_pretrained load it)")
    return out


def _weights(model):
    from mlx.utils import tree_flatten

    return tree_flatten(model.parameters())
