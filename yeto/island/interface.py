"""What a tensor backend provides, written once: an `Island` (one island's model, adapter, data and optimizer) and
the `Backend` that makes one for `yeto.island.training.train`.

Every member here is used by the island's code (the DiLoCo loop in `yeto.island.diloco`, the run in
`yeto.island.training`, the training state in `yeto.island.checkpoint`, the record in `yeto.island.metrics`), and
both backends (`yeto.backends.torch`, `yeto.backends.mlx`) provide them all; tests/test_backends.py checks
that. The adapter crosses this line as `{canonical peft name: fp32 numpy array}`, so nothing here names a tensor
library.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, ContextManager, Optional, Protocol

import numpy as np

if TYPE_CHECKING:
    from yeto.island.checkpoint import TrainState
    from yeto.island.train_config import TrainConfig
    from yeto.island.data import Blocks, DataSource
    from yeto.eval.task import Prompt
    from yeto.models.provenance import Artifact


class Island(Protocol):
    """One island's model + LoRA adapter + data + inner optimizer, as the island's loops drive it."""

    backend: str  # "torch", "mlx": the records' and the syncer's name for it
    cfg: TrainConfig  # the flags it was made from
    model_artifact: Artifact  # the resolved model (its commit pins the run)
    source: DataSource  # the data read, before its shard is taken
    shard: Optional[tuple[int, int]]  # (index, count) of the data trained on; None until the syncer says
    ranks: int  # processes in the island (a torchrun group's; 1 otherwise)
    step_count: int  # optimizer steps taken (a resumed run's included)
    tokens_seen: int  # tokens through the model in training
    loss_tokens_seen: int  # of those, the loss-bearing ones

    def step(self) -> dict[str, Any]:
        """One optimizer step: {step, loss, lr, grad_norm, tokens, loss_tokens}."""
        ...

    def evaluate(self, blocks: Optional[Blocks] = None) -> Optional[float]:
        """The token-weighted mean loss over `blocks` (default: the held-out split); None when there are none."""
        ...

    def generate(self, prompts: list[Prompt], max_new_tokens: int) -> list[str]:
        """Greedy answers to `prompts` (chat turns or raw text) in one batch, from the base with the adapter it holds
        (`--eval-task`: `yeto.island.task_eval`); training mode is restored after."""
        ...

    def adapter_state(self) -> dict[str, np.ndarray]:
        """The adapter as {canonical peft name: fp32 array}: what the syncer exchanges."""
        ...

    def load_adapter_state(self, state: dict[str, np.ndarray]) -> None:
        """Take the adapter `state` (every tensor of `adapter_state`'s view)."""
        ...

    def adapter_config(self) -> dict[str, Any]:
        """adapter_config.json's content (peft's), the run's contract compares it across islands."""
        ...

    def record(self) -> dict[str, Any]:
        """What a saved adapter and run.json say about this island (`yeto.island.metrics.island_record`)."""
        ...

    def data_record(self) -> dict[str, Any]:
        """The data's part of `record`: the resolved data and its shard's stats."""
        ...

    def set_total_steps(self, total: int) -> None:
        """Stretch the LR schedule over `total` steps (the syncer knows how long the run is)."""
        ...

    def use_shard(self, index: int, count: int) -> None:
        """Train on shard `index` of `count` from here on (a no-op when it is the shard held)."""
        ...

    def save(self, out_dir: str | Path) -> Path:
        """Write the adapter as a peft adapter directory; returns it."""
        ...

    def training_state(self) -> TrainState:
        """Everything resuming needs: adapter, optimizer moments, counters, schedule, batch position, RNG."""
        ...

    def load_training_state(self, state: TrainState, adapter: bool = True) -> None:
        """Continue from `state` (`adapter`: restore its adapter too; in a fleet the rejoin brings the global)."""
        ...


class Backend(Protocol):
    """A tensor backend as `yeto.island.training.train` runs it: its checks, then its island (or, in a group of
    processes that is one island, this process's part in it)."""

    name: str  # "torch", "mlx": `yeto train --backend NAME`

    def check_flags(self, cfg: TrainConfig) -> None:
        """Refuse, one line each and before anything loads, the flags this backend cannot honour."""
        ...

    def follow(self, cfg: TrainConfig) -> Optional[dict[str, Any]]:
        """Where another process of the same island leads (a torchrun rank other than 0), follow it to the end and
        return this process's summary; None where this process leads."""
        ...

    def island(self, cfg: TrainConfig, log: Callable[[str], None]) -> ContextManager[Island]:
        """The island to train, held for the run and released after it (a torchrun group's other ranks let go)."""
        ...
