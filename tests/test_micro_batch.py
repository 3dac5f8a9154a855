"""--micro-batch-size: the gradient does not depend on it, and `auto` finds the largest size that fits.

Device memory cannot run out on demand on this machine, so the out-of-memory a GPU would raise is played by a
forward hook that raises torch's own OutOfMemoryError for a batch above a budget (the stand-in for a device)."""

import numpy as np
import pytest
import torch

import yeto.backends.torch.island
from tests.conftest import DEMO_DATA
from yeto import YetoError
from yeto.backends.torch.island import TorchIsland, TrainConfig
from yeto.island.micro_batch import chunks, largest_that_fits, parse_micro_batch_size
from yeto.models.materialize import load_model


def test_largest_that_fits_is_found_in_few_probes():
    for batch in range(1, 18):
        for budget in range(0, 20):
            probes: list[int] = []

            def fits(n):
                probes.append(n)
                return n <= budget

            assert largest_that_fits(fits, batch) == min(budget, batch), (batch, budget)
            assert probes[0] == batch and len(probes) <= 1 + int(np.ceil(np.log2(batch)))
            assert all(1 <= n <= batch for n in probes)


def test_micro_batch_size_values():
    assert parse_micro_batch_size("all", 8) == 8
    assert parse_micro_batch_size("auto", 8) is None
    assert parse_micro_batch_size("3", 8) == 3 and parse_micro_batch_size("32", 8) == 8
    for bad in ("0", "-2", "half", ""):
        with pytest.raises(YetoError, match="--micro-batch-size must be all, auto or a positive integer"):
            parse_micro_batch_size(bad, 8)
    assert chunks(7, 3) == [slice(0, 3), slice(3, 6), slice(6, 7)]


def island(tiny_model, micro, budget=None, dropout=0.0, logs=None):
    cfg = TrainConfig(model=str(tiny_model("llama")), data=str(DEMO_DATA), seq_len=64, batch_size=8, max_steps=4,
                      lora_r=4, lora_dropout=dropout, micro_batch_size=micro, threads=1)
    if budget is None:
        return TorchIsland(cfg, log=(logs.append if logs is not None else lambda s: None))

    def device_memory(module, args, kwargs):  # the device: a forward of more than `budget` blocks runs out
        ids = kwargs.get("input_ids", args[0] if args else None)
        if ids is not None and ids.shape[0] > budget:
            raise torch.OutOfMemoryError(f"CUDA out of memory (budget: {budget} blocks)")

    def load_on_device(*args, **kwargs):
        model = load_model(*args, **kwargs)
        model.model.register_forward_pre_hook(device_memory, with_kwargs=True)
        return model

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(yeto.backends.torch.island, "load_model", load_on_device)
        return TorchIsland(cfg, log=(logs.append if logs is not None else lambda s: None))


def trained(island, steps=4):
    for _ in range(steps):
        island.step()
    return island.adapter_state()


def test_the_gradient_does_not_depend_on_the_micro_batch_size(tiny_model):
    whole, ones = trained(island(tiny_model, "all")), trained(island(tiny_model, "1"))
    assert max(float(np.abs(v).max()) for k, v in whole.items() if "lora_B" in k) > 1e-4  # it trained
    for k in whole:
        np.testing.assert_allclose(ones[k], whole[k], rtol=1e-4, atol=1e-6, err_msg=k)


def test_auto_probes_the_largest_micro_batch_that_fits_and_trains_as_that_size_would(tiny_model):
    logs: list[str] = []
    probed = island(tiny_model, "auto", budget=3, dropout=0.1, logs=logs)
    assert probed.micro_batch == 3
    assert any(line.startswith("micro-batch: 3 of --batch-size 8") and "out of memory" in line for line in logs), logs
    a = trained(probed)  # (torch's random stream is global: each island seeds it when made, then trains)
    b = trained(island(tiny_model, "3", dropout=0.1))  # with dropout: the probes left the random stream untouched
    for k in a:
        np.testing.assert_array_equal(a[k], b[k], err_msg=k)
    assert all(p.grad is None for p in island(tiny_model, "auto", budget=5).trainable.values())


def test_auto_says_what_to_do_when_not_even_one_block_fits(tiny_model):
    with pytest.raises(YetoError, match="one block of --seq-len 64 does not fit on cpu: lower --seq-len"):
        island(tiny_model, "auto", budget=0)


def test_the_mlx_island_refuses_micro_batch_sizes(tiny_model):
    pytest.importorskip("mlx.core")
    from yeto.backends.mlx.island import MLXIsland

    cfg = TrainConfig(model=str(tiny_model("llama")), data=str(DEMO_DATA), micro_batch_size="auto")
    with pytest.raises(YetoError, match="--micro-batch-size is the torch island's"):
        MLXIsland(cfg, log=lambda s: None)
