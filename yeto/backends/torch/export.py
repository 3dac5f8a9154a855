"""`yeto export ADAPTER --merged OUT`: the base model with the adapter merged into its weights, as a plain
transformers checkpoint (safetensors shards, config, tokenizer and chat template) that
`AutoModelForCausalLM.from_pretrained(OUT)` loads, and vLLM or llama.cpp's converter take as they are.

peft does the merge (`merge_and_unload`: W + scale x B A per adapted linear) and transformers the writing
(`save_pretrained`); the base is the one the adapter records, unless --model names it (it must be that base). The
weights are written in the base's own dtype (`--dtype auto`; its config says which), unless --dtype names another.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable, Optional

from yeto.models.adapter import (AUTO_DTYPE, EXPORT_RECORD, adapter_base, check_export, export_dir_for,
                                 find_adapter_dir, finish_export)

__all__ = ["EXPORT_RECORD", "export_merged"]
MAX_SHARD_SIZE = "5GB"  # transformers' default shard size, named: the hub and vLLM expect shards about this big


def export_merged(adapter: str | Path, out: str | Path, model: Optional[str] = None,
                  model_revision: Optional[str] = None, dtype: str = AUTO_DTYPE, force: bool = False,
                  trust_remote_code: bool = False, log: Callable[[str], None] = print) -> Path:
    """Write base + adapter merged to `out` (written beside it, then moved in place: a failed export leaves no half
    checkpoint); returns `out`. `dtype` "auto": the base's own (a bfloat16 model stays bfloat16: half the bytes of
    float32, and the precision it was published in)."""
    import torch
    from peft import PeftModel

    from yeto.models.materialize import load_model, load_tokenizer, own_dtype

    adapter_dir = find_adapter_dir(adapter)
    out = Path(out).expanduser()
    check_export(out, dtype, force)
    base_artifact = adapter_base(adapter_dir, model, model_revision)
    log(f"base {base_artifact.name} @ {base_artifact.revision[:19]}; adapter {adapter_dir}")
    named = own_dtype(base_artifact) if dtype == AUTO_DTYPE else dtype
    chosen = getattr(torch, named, None) if named else None
    # (a config that names no dtype: transformers' "auto" takes the checkpoint's weights' own)
    base = load_model(base_artifact, "cpu", chosen if isinstance(chosen, torch.dtype) else AUTO_DTYPE,
                      trust_remote_code)
    written = str(base.dtype).removeprefix("torch.")
    merged = PeftModel.from_pretrained(base, str(adapter_dir)).merge_and_unload()
    tokenizer = load_tokenizer(base_artifact, trust_remote_code)
    tmp = export_dir_for(out)
    merged.save_pretrained(tmp, safe_serialization=True, max_shard_size=MAX_SHARD_SIZE)
    tokenizer.save_pretrained(tmp)  # the chat template rides in tokenizer_config.json / chat_template.jinja
    finish_export(tmp, out, {"base": base_artifact.to_dict(), "adapter": str(adapter_dir.resolve()),
                             "dtype": written}, adapter_dir)
    log(f"merged model: {out}, {written} (AutoModelForCausalLM.from_pretrained loads it)")
    return out
