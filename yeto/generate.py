"""Greedy answers from the base model and from base + adapter, side by side."""

from __future__ import annotations

from pathlib import Path

import torch

from yeto import YetoError
from yeto.adapter import ADAPTER_CONFIG, find_adapter_dir, read_provenance
from yeto.models import default_device, load_model, load_tokenizer, resolve_model
from yeto.provenance import Artifact


def _prompt_ids(tokenizer, prompt: str, chat: bool) -> torch.Tensor:
    if chat and getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                             add_generation_prompt=True)
        return tokenizer(text, add_special_tokens=False, return_tensors="pt")["input_ids"]
    return tokenizer(prompt, return_tensors="pt")["input_ids"]


@torch.no_grad()
def greedy(model, tokenizer, prompt: str, max_new_tokens: int = 64, chat: bool = True) -> str:
    ids = _prompt_ids(tokenizer, prompt, chat).to(model.device)
    out = model.generate(
        input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, do_sample=False,
        pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
    )
    return tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True).strip()


def adapter_base(adapter_dir: Path, model: str | None, revision: str | None) -> Artifact:
    """The base model to load under an adapter: the one it records (yeto's provenance, else peft's
    `base_model_name_or_path`), or `model` when given, which must then be that same base (same content)."""
    import json

    try:
        recorded = read_provenance(adapter_dir).get("model") or {}
    except YetoError:  # an adapter yeto did not write: peft's own record of its base
        config = json.loads((adapter_dir / ADAPTER_CONFIG).read_text())
        recorded = {"name": config.get("base_model_name_or_path"), "revision": config.get("revision")}
    if model is None:
        if not recorded.get("name"):
            raise YetoError(f"{adapter_dir} does not record its base model: pass --model")
        local = recorded.get("path") if recorded.get("source") == "local" else None
        return resolve_model(local or recorded["name"], revision or recorded.get("requested_revision"))
    artifact = resolve_model(model, revision)
    if recorded.get("revision") and recorded.get("source") and artifact.revision != recorded["revision"]:
        raise YetoError(f"--model {model} ({artifact.revision[:19]}) is not the base this adapter was trained on: "
                        f"{recorded.get('name')} ({str(recorded['revision'])[:19]}); drop --model to use that one")
    return artifact


def compare(model_name: str | None, adapter: str | Path, prompts: list[str], max_new_tokens: int = 64,
            model_revision: str | None = None, device: str = "auto",
            trust_remote_code: bool = False) -> list[tuple[str, str, str]]:
    """[(prompt, base answer, adapted answer)]; the adapter is loaded by peft itself, on the base it records
    (`model_name` None) or on `model_name`, checked to be that base."""
    from peft import PeftModel

    adapter_dir = find_adapter_dir(adapter)
    artifact = adapter_base(adapter_dir, model_name, model_revision)
    device = default_device() if device == "auto" else device
    tokenizer = load_tokenizer(artifact, trust_remote_code)
    base = load_model(artifact, device, trust_remote_code=trust_remote_code).eval()
    before = [greedy(base, tokenizer, p, max_new_tokens) for p in prompts]
    tuned = PeftModel.from_pretrained(base, str(adapter_dir)).eval()
    after = [greedy(tuned, tokenizer, p, max_new_tokens) for p in prompts]
    return list(zip(prompts, before, after))
