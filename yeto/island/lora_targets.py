"""Which linears get a LoRA adapter, decided from the model's module names and HF config.

The rules are pure functions over `(name, in_features, out_features)` triples so
every backend (torch, MLX) adapts exactly the same layers:

- `attention`: the attention projections, matched by `ATTENTION_REGEX`. It
  covers Llama-style `q/k/v/o_proj` and LFM2's attention `out_proj`, but not
  LFM2's short-convolution `conv.in_proj`/`conv.out_proj`.
- `all-linear`: every linear except the output head and MoE routers/gates.
- `auto`: `attention` for dense models. For MoE models (config has
  `num_experts`, `num_local_experts`, `n_routed_experts` or `moe_num_experts`):
  attention plus every linear outside the routed experts (dense MLP layers,
  shared experts), and never a router or gate. Routed experts are left alone:
  each sees a fraction of the tokens and adapting them multiplies the adapter
  by the expert count; routers are left alone because small changes to them
  reshuffle which expert every token visits. (transformers 5 fuses each
  layer's routed experts into 3-D tensors, `experts.gate_up_proj`, which are no
  linears: then no rule adapts them, `all-linear` included.)

A multimodal checkpoint's vision or audio tower and its projector (`NON_TEXT_REGEX`) are never adapted: yeto
trains on text, which never reaches them.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Iterable, Optional

from yeto import YetoError
from yeto.models.catalog import num_experts

ATTENTION_REGEX = r".*\.(self_attn|attention|attn)\.(q_proj|k_proj|v_proj|o_proj|out_proj|qkv_proj)$"
ROUTER_REGEX = r"(.*\.)?(gate|router|shared_expert_gate|expert_gate|moe_gate|wg|gating)$"
EXPERT_REGEX = r".*\.experts\.\d+\..*"
NON_TEXT_REGEX = r"(.*\.)?(vision_tower|vision_model|multi_modal_projector|audio_tower|visual)(\..*)?"
MODES = ("attention", "all-linear", "auto")

Linear = tuple[str, int, int]  # (module name, in_features, out_features)


def is_lora_a(peft_name: str) -> bool:
    """A LoRA down-projection (`lora_A`, or an embedding's `lora_embedding_A`), by its peft name."""
    return ".lora_A." in peft_name or ".lora_embedding_A." in peft_name


def is_router(name: str, out_features: int, config) -> bool:
    n = num_experts(config)
    return bool(re.fullmatch(ROUTER_REGEX, name)) or (n > 0 and out_features == n and ".experts." not in name)


def select_targets(linears: Iterable[Linear], config, mode: str, exclude: Iterable[str] = ()) -> list[str]:
    """Sorted full names of the linears to adapt (`exclude`: the output head)."""
    if mode not in MODES:
        raise YetoError(f"unknown --lora-targets {mode!r}: use one of {', '.join(MODES)}")
    excluded = set(exclude)
    linears = [(n, i, o) for n, i, o in linears
               if n not in excluded and not n.endswith("lm_head") and not re.fullmatch(NON_TEXT_REGEX, n)]
    attention = {n for n, _, _ in linears if re.fullmatch(ATTENTION_REGEX, n)}
    moe = num_experts(config) > 0
    if mode == "attention" or (mode == "auto" and not moe):
        chosen = attention
    elif mode == "all-linear":
        chosen = {n for n, _, o in linears if not is_router(n, o, config)}
    else:  # auto on an MoE model
        chosen = attention | {n for n, _, o in linears
                              if not is_router(n, o, config) and not re.fullmatch(EXPERT_REGEX, n)}
    if not chosen:
        raise YetoError(f"--lora-targets {mode}: no linear layer of this model matches "
                        f"(model_type={getattr(config, 'model_type', '?')})")
    return sorted(chosen)


def peft_target_modules(chosen: list[str], all_names: Iterable[str], moe: bool = False) -> str | list[str]:
    """The shortest peft `target_modules` that selects exactly `chosen`.

    peft matches a list entry when a module name equals it or ends with
    '.' + it, and a string as a full regex. Prefer the short suffix list (what a
    person writes), then the attention regex, then the exact names. An MoE model
    (`moe`) gets the exact names: peft reads a bare leaf name there (`down_proj`)
    or the leaves a regex matches as the transformers-4 name of the fused routed
    experts too, and would adapt the experts the rules leave alone.
    """
    all_names = list(all_names)
    chosen_set = set(chosen)
    if moe:
        return sorted(chosen_set)
    suffixes = sorted({n.rsplit(".", 1)[-1] for n in chosen})
    by_suffix = {n for n in all_names if n.rsplit(".", 1)[-1] in suffixes}
    if by_suffix == chosen_set:
        return suffixes
    if {n for n in all_names if re.fullmatch(ATTENTION_REGEX, n)} == chosen_set:
        return ATTENTION_REGEX
    return sorted(chosen_set)


def check_lora(r: int, dropout: float) -> None:
    """--lora-r and --lora-dropout in range (every backend's adapter)."""
    if r < 1:
        raise YetoError(f"--lora-r must be at least 1, got {r}")
    if not 0.0 <= dropout < 1.0:
        raise YetoError(f"--lora-dropout must be in [0, 1), got {dropout}")


@dataclass
class LoraSpec:
    """An adapter's peft description without peft (which needs torch), for a backend that runs without it: `to_dict`
    is an adapter_config.json peft loads, the fields left out taking peft's defaults (those yeto's LoraConfig has)."""

    r: int
    lora_alpha: float
    lora_dropout: float
    target_modules: str | list[str]
    base_model_name_or_path: Optional[str] = None
    revision: Optional[str] = None

    def to_dict(self) -> dict[str, Any]:
        targets = self.target_modules if isinstance(self.target_modules, str) else sorted(self.target_modules)
        return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "bias": "none", "inference_mode": True,
                "r": self.r, "lora_alpha": self.lora_alpha, "lora_dropout": self.lora_dropout,
                "target_modules": targets, "base_model_name_or_path": self.base_model_name_or_path,
                "revision": self.revision}


def lora_spec_for(chosen: list[str], linears: list[Linear], r: int = 16, alpha: float = 32.0,
                  dropout: float = 0.05, moe: bool = False) -> LoraSpec:
    """As the torch island's `lora_config_for` (yeto.backends.torch.lora), as a LoraSpec (no peft, no torch):
    the MLX island's."""
    check_lora(r, dropout)
    return LoraSpec(r, alpha, dropout, peft_target_modules(chosen, [n for n, _, _ in linears], moe))
