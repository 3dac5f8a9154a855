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
  reshuffle which expert every token visits.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Iterable, Optional

from yeto import YetoError

ATTENTION_REGEX = r".*\.(self_attn|attention|attn)\.(q_proj|k_proj|v_proj|o_proj|out_proj|qkv_proj)$"
ROUTER_REGEX = r"(.*\.)?(gate|router|shared_expert_gate|expert_gate|moe_gate|wg|gating)$"
EXPERT_REGEX = r".*\.experts\.\d+\..*"
MODES = ("attention", "all-linear", "auto")
MOE_KEYS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")

Linear = tuple[str, int, int]  # (module name, in_features, out_features)


def is_lora_a(peft_name: str) -> bool:
    """A LoRA down-projection (`lora_A`, or an embedding's `lora_embedding_A`), by its peft name."""
    return ".lora_A." in peft_name or ".lora_embedding_A." in peft_name


def num_experts(config) -> int:
    for key in MOE_KEYS:
        v = getattr(config, key, None)
        if isinstance(v, int) and v > 1:
            return v
    return 0


def is_router(name: str, out_features: int, config) -> bool:
    n = num_experts(config)
    return bool(re.fullmatch(ROUTER_REGEX, name)) or (n > 0 and out_features == n and ".experts." not in name)


def select_targets(linears: Iterable[Linear], config, mode: str, exclude: Iterable[str] = ()) -> list[str]:
    """Sorted full names of the linears to adapt (`exclude`: the output head)."""
    if mode not in MODES:
        raise YetoError(f"unknown --lora-targets {mode!r}: use one of {', '.join(MODES)}")
    excluded = set(exclude)
    linears = [(n, i, o) for n, i, o in linears if n not in excluded and not n.endswith("lm_head")]
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


def peft_target_modules(chosen: list[str], all_names: Iterable[str]) -> str | list[str]:
    """The shortest peft `target_modules` that selects exactly `chosen`.

    peft matches a list entry when a module name equals it or ends with
    '.' + it, and a string as a full regex. Prefer the short suffix list (what a
    person writes), then the attention regex, then the exact names.
    """
    all_names = list(all_names)
    chosen_set = set(chosen)
    suffixes = sorted({n.rsplit(".", 1)[-1] for n in chosen})
    by_suffix = {n for n in all_names if n.rsplit(".", 1)[-1] in suffixes}
    if by_suffix == chosen_set:
        return suffixes
    if {n for n in all_names if re.fullmatch(ATTENTION_REGEX, n)} == chosen_set:
        return ATTENTION_REGEX
    return sorted(chosen_set)


def torch_linears(model) -> tuple[list[Linear], list[str]]:
    """(linears, names to exclude: the output embedding) of a torch model."""
    import torch.nn as nn

    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    linears, exclude = [], []
    for name, mod in model.named_modules():
        if isinstance(mod, nn.Linear):
            linears.append((name, mod.in_features, mod.out_features))
            if mod is head:
                exclude.append(name)
    return linears, exclude


def _check_lora(r: int, dropout: float) -> None:
    if r < 1:
        raise YetoError(f"--lora-r must be at least 1, got {r}")
    if not 0.0 <= dropout < 1.0:
        raise YetoError(f"--lora-dropout must be in [0, 1), got {dropout}")


def lora_config_for(chosen: list[str], linears: list[Linear], r: int = 16, alpha: float = 32.0, dropout: float = 0.05):
    """The peft LoraConfig the torch learner builds its adapter from: the linears `select_targets`
    chose, among all of the model's `linears`."""
    from peft import LoraConfig

    _check_lora(r, dropout)
    targets = peft_target_modules(chosen, [n for n, _, _ in linears])
    return LoraConfig(r=r, lora_alpha=alpha, lora_dropout=dropout, target_modules=targets, task_type="CAUSAL_LM",
                      bias="none")


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
                  dropout: float = 0.05) -> LoraSpec:
    """As `lora_config_for`, as a LoraSpec (no peft, no torch): the MLX island's."""
    _check_lora(r, dropout)
    return LoraSpec(r, alpha, dropout, peft_target_modules(chosen, [n for n, _, _ in linears]))


def lora_config(model, mode: str = "auto", r: int = 16, alpha: float = 32.0, dropout: float = 0.05):
    """A peft LoraConfig for a torch `model` under the rule `mode`."""
    linears, exclude = torch_linears(model)
    return lora_config_for(select_targets(linears, model.config, mode, exclude), linears, r, alpha, dropout)
