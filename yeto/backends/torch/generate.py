"""Greedy answers from the base model and from base + adapter, side by side."""

from __future__ import annotations

from functools import partial
from pathlib import Path
from typing import Iterator, Sequence

import torch

from yeto.eval.task import Generate, Prompt, prompt_text
from yeto.models.adapter import adapter_base, find_adapter_dir
from yeto.models.materialize import default_device, load_model, load_tokenizer
from yeto.models.provenance import Artifact


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
    # the answer as the model wrote it: the clean-up (a WordPiece post-process that strips spaces before punctuation)
    # is off, said here, where a BPE tokenizer whose config asks for it would have transformers warn that it ignores it
    return tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True,
                            clean_up_tokenization_spaces=False).strip()


@torch.no_grad()
def greedy_batch(model, tokenizer, prompts: list[Prompt], max_new_tokens: int) -> list[str]:
    """Greedy answers to `prompts` in one batch: left-padded, so every row's answer starts where its prompt ends."""
    texts = [prompt_text(p, tokenizer) for p in prompts]
    side = tokenizer.padding_side
    tokenizer.padding_side = "left"
    try:  # a chat rendering carries its own special tokens; raw text gets the tokenizer's (as in training)
        batch = tokenizer(texts, add_special_tokens=not isinstance(prompts[0], list), padding=True,
                          return_tensors="pt").to(model.device)
    finally:
        tokenizer.padding_side = side
    out = model.generate(**batch, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=tokenizer.pad_token_id,
                         eos_token_id=tokenizer.eos_token_id)
    return [t.strip() for t in tokenizer.batch_decode(out[:, batch["input_ids"].shape[1]:], skip_special_tokens=True,
                                                      clean_up_tokenization_spaces=False)]


def task_generators(artifact: Artifact, adapter_dirs: Sequence[Path], device: str = "auto",
                    trust_remote_code: bool = False) -> Iterator[Generate]:
    """The base's greedy batched generate, then each adapter's: the base loads once, peft wraps it for an adapter
    and unloads it before the next (its LoRA layers taken out, the base's own weights never changed), so every
    model answers the same prompts on one base without a reload per adapter."""
    from peft import PeftModel

    device = default_device() if device == "auto" else device
    tokenizer = load_tokenizer(artifact, trust_remote_code)
    base = load_model(artifact, device, trust_remote_code=trust_remote_code).eval()
    yield partial(greedy_batch, base, tokenizer)
    for adapter_dir in adapter_dirs:
        tuned = PeftModel.from_pretrained(base, str(adapter_dir)).eval()
        try:
            yield partial(greedy_batch, tuned, tokenizer)
        finally:
            base = tuned.unload()


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
