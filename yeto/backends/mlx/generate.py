"""Greedy answers from the base model and from base + adapter on MLX, side by side: `yeto generate` on a Mac with
`yeto[mlx]` alone (no torch). mlx-lm's own `generate` runs over mlx-lm's own LoRA layers, which hold the peft
adapter's factors (peft's A is (r, in), B (out, r): mlx-lm's `lora_a` and `lora_b` are their transposes)."""

from __future__ import annotations

import json
import math
from functools import partial
from pathlib import Path
from typing import Any, Iterator, Optional, Sequence

from yeto import YetoError
from yeto.eval.task import Generate, Prompt
from yeto.eval.task import prompt_text as prompt_text_of
from yeto.models.adapter import ADAPTER_CONFIG, adapter_base, find_adapter_dir, read_adapter
from yeto.models.provenance import Artifact

DEVICES = ("auto", "cpu")  # MLX's default device (the Apple GPU; the CPU on Linux), or the CPU


def set_device(device: str) -> None:
    """MLX runs on its default device or the CPU; a torch device name is one line."""
    import mlx.core as mx

    if device not in DEVICES:
        raise YetoError(f"--device {device!r}: MLX runs on the Apple GPU or the CPU, use auto or cpu (or --backend "
                        "torch for a torch device)")
    if device == "cpu":
        mx.set_default_device(mx.cpu)


def lora_scale(config: dict[str, Any], r: int) -> float:
    """peft's scale of a LoRA layer: alpha / r (rsLoRA: alpha / sqrt(r))."""
    alpha = float(config.get("lora_alpha", r))
    return alpha / math.sqrt(r) if config.get("use_rslora") else alpha / r


def add_adapter(model: Any, adapter_dir: Path) -> int:
    """Wrap every linear the peft adapter in `adapter_dir` adapts in mlx-lm's LoRALinear holding its factors;
    returns how many. A tensor the model has no linear for is one line."""
    import mlx.core as mx
    from mlx.utils import tree_unflatten
    from mlx_lm.tuner.lora import LoRALinear

    from yeto.backends.mlx.lora import renames_of, to_mlx_path

    config = json.loads((adapter_dir / ADAPTER_CONFIG).read_text())
    tensors, renames = read_adapter(adapter_dir), renames_of(model)
    modules = dict(model.named_modules())
    layers = []
    for name, a in sorted(tensors.items()):
        if ".lora_A." not in name:
            continue
        path = to_mlx_path(name, renames).removesuffix(".lora_A")
        b = tensors.get(name.replace(".lora_A.", ".lora_B."))
        if path not in modules or b is None:
            raise YetoError(f"{adapter_dir}: the adapter's {name} has no linear {path} in this model (or no lora_B): "
                            "is it this base's adapter?")
        r = a.shape[0]
        layer = LoRALinear.from_base(modules[path], r=r, dropout=0.0, scale=lora_scale(config, r))
        layer.lora_a, layer.lora_b = mx.array(a.T), mx.array(b.T)
        layers.append((path, layer))
    model.update_modules(tree_unflatten(layers))
    return len(layers)


def remove_adapter(model: Any) -> int:
    """Put back the linear each of mlx-lm's LoRA layers wraps (what `add_adapter` put on comes off: the base as it
    loaded, for the next adapter); returns how many."""
    from mlx.utils import tree_unflatten
    from mlx_lm.tuner.lora import LoRALinear

    layers = [(name, m.linear) for name, m in model.named_modules() if isinstance(m, LoRALinear)]
    model.update_modules(tree_unflatten(layers))
    return len(layers)


def task_generators(artifact: Artifact, adapter_dirs: Sequence[Path], device: str = "auto",
                    trust_remote_code: bool = False) -> Iterator[Generate]:
    """The base's greedy batched generate, then each adapter's, on one base loaded once (each adapter's LoRA layers
    put on, then taken off before the next), as yeto.backends.torch.generate.task_generators gives them."""
    from yeto.backends.mlx.compat import load_mlx_model

    set_device(device)
    model, tokenizer = load_mlx_model(artifact.path), load_tokenizer(artifact, trust_remote_code)
    yield partial(greedy_batch, model, tokenizer)
    for adapter_dir in adapter_dirs:
        add_adapter(model, adapter_dir)
        try:
            yield partial(greedy_batch, model, tokenizer)
        finally:
            remove_adapter(model)


def load_base(model_name: Optional[str], adapter: str | Path, model_revision: Optional[str] = None,
              trust_remote_code: bool = False) -> tuple[Any, Any, Artifact, Path]:
    """(mlx-lm's model of the adapter's base, its tokenizer, the base's artifact, the adapter's directory)."""
    from yeto.backends.mlx.compat import load_mlx_model

    adapter_dir = find_adapter_dir(adapter)
    artifact = adapter_base(adapter_dir, model_name, model_revision)
    return load_mlx_model(artifact.path), load_tokenizer(artifact, trust_remote_code), artifact, adapter_dir


def load_tokenizer(artifact: Artifact, trust_remote_code: bool = False) -> Any:
    """mlx-lm's tokenizer of `artifact`, decoding as the model wrote it: transformers' clean-up (a WordPiece
    post-process that strips spaces before punctuation) is off, as in the torch twin, where a BPE tokenizer whose
    config asks for it would have transformers warn."""
    from yeto.backends.mlx.compat import import_mlx_lm

    extra = {"clean_up_tokenization_spaces": False, **({"trust_remote_code": True} if trust_remote_code else {})}
    return import_mlx_lm().utils.load_tokenizer(Path(artifact.path), extra)


def prompt_text(tokenizer: Any, prompt: str) -> str:
    """The prompt as a user turn of the model's chat template (the plain prompt where it has none)."""
    if getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                             add_generation_prompt=True)
    return prompt


def greedy(model: Any, tokenizer: Any, prompt: str, max_new_tokens: int) -> str:
    """mlx-lm's generate, greedy (its default sampler is argmax)."""
    from mlx_lm import generate

    return generate(model, tokenizer, prompt_text(tokenizer, prompt), max_tokens=max_new_tokens).strip()


def greedy_batch(model: Any, tokenizer: Any, prompts: list[Prompt], max_new_tokens: int) -> list[str]:
    """Greedy answers to `prompts` in one batch (mlx-lm's batch_generate; its default sampler is argmax), each
    prompt rendered as training renders it (yeto.eval.task.prompt_text), as the torch twin does."""
    from mlx_lm.generate import batch_generate

    ids = [tokenizer.encode(prompt_text_of(p, tokenizer), add_special_tokens=not isinstance(p, list)) for p in prompts]
    texts = batch_generate(model, tokenizer, ids, max_tokens=max_new_tokens).texts
    return [t.strip() for t in texts]


def compare(model_name: Optional[str], adapter: str | Path, prompts: list[str], max_new_tokens: int = 64,
            model_revision: Optional[str] = None, device: str = "auto",
            trust_remote_code: bool = False) -> list[tuple[str, str, str]]:
    """[(prompt, base answer, adapted answer)], as yeto.backends.torch.generate.compare gives them."""
    set_device(device)
    model, tokenizer, _, adapter_dir = load_base(model_name, adapter, model_revision, trust_remote_code)
    before = [greedy(model, tokenizer, p, max_new_tokens) for p in prompts]
    add_adapter(model, adapter_dir)
    after = [greedy(model, tokenizer, p, max_new_tokens) for p in prompts]
    return list(zip(prompts, before, after))
