"""Do the torch and MLX backends build the same adapter? (names, shapes, count)

It sits above both backends (peers that never import each other): the one place that loads them side by side."""

from __future__ import annotations

from yeto.models.materialize import resolve_model


def torch_adapter_specs(path: str, mode: str = "auto", r: int = 16) -> dict[str, tuple[int, ...]]:
    import torch
    from peft import get_peft_model
    from transformers import AutoConfig, AutoModelForCausalLM

    from yeto.backends.torch.lora import lora_config

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path))
    peft_model = get_peft_model(model, lora_config(model, mode, r=r, alpha=2 * r))
    return {n: tuple(p.shape) for n, p in peft_model.named_parameters() if p.requires_grad}


def mlx_adapter_specs(path: str, mode: str = "auto", r: int = 16) -> dict[str, tuple[int, ...]]:
    from transformers import AutoConfig

    from yeto.island.lora_targets import select_targets
    from yeto.backends.mlx.compat import load_mlx_model
    from yeto.backends.mlx.lora import apply_lora, lora_state, mlx_linears

    model = load_mlx_model(path)
    linears = mlx_linears(model)
    apply_lora(model, select_targets(linears, AutoConfig.from_pretrained(path), mode, ["lm_head"]), r, 2 * r)
    return {n: tuple(v.shape) for n, v in lora_state(model).items()}


def name_parity(model: str, mode: str = "auto", r: int = 16) -> tuple[int, int, list[str]]:
    """(torch tensor count, MLX tensor count, mismatch lines)."""
    path = resolve_model(model).path
    t, m = torch_adapter_specs(path, mode, r), mlx_adapter_specs(path, mode, r)
    problems = [f"only in torch: {n} {list(t[n])}" for n in sorted(set(t) - set(m))]
    problems += [f"only in MLX:   {n} {list(m[n])}" for n in sorted(set(m) - set(t))]
    problems += [f"shape differs: {n} torch {list(t[n])} vs MLX {list(m[n])}"
                 for n in sorted(set(t) & set(m)) if t[n] != m[n]]
    return len(t), len(m), problems
