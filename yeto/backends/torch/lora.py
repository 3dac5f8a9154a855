"""The torch island's LoRA: the linears of a torch model and the peft `LoraConfig` for the targets that
`yeto.island.lora_targets`'s backend-neutral rules choose (peft needs torch; the MLX island builds a `LoraSpec`
instead)."""

from __future__ import annotations

from yeto.island.lora_targets import Linear, check_lora, peft_target_modules, select_targets
from yeto.models.catalog import num_experts


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


def lora_config_for(chosen: list[str], linears: list[Linear], r: int = 16, alpha: float = 32.0, dropout: float = 0.05,
                    moe: bool = False):
    """The peft LoraConfig the torch island builds its adapter from: the linears `select_targets`
    chose, among all of the model's `linears` (`moe`: an MoE model's, see `peft_target_modules`)."""
    from peft import LoraConfig

    check_lora(r, dropout)
    targets = peft_target_modules(chosen, [n for n, _, _ in linears], moe)
    return LoraConfig(r=r, lora_alpha=alpha, lora_dropout=dropout, target_modules=targets, task_type="CAUSAL_LM",
                      bias="none")


def lora_config(model, mode: str = "auto", r: int = 16, alpha: float = 32.0, dropout: float = 0.05):
    """A peft LoraConfig for a torch `model` under the rule `mode`."""
    linears, exclude = torch_linears(model)
    return lora_config_for(select_targets(linears, model.config, mode, exclude), linears, r, alpha, dropout,
                           num_experts(model.config) > 0)
