"""`yeto launch --epochs N`: a fleet's length from its data, counted before anything starts.

A fleet runs --outer-steps rounds of --inner-steps steps on every island, so N passes over the data is a number of
rounds: each island's shard (as the syncer deals them: island I of the fleet's count) is read and packed as the
island will read it (`yeto.island.data.read_data`, the model's tokenizer, no weights), its steps for N passes
counted as `yeto train --epochs` counts them (`yeto.island.shard.epoch_steps`), and the largest shard's steps,
in rounds, are the run's --outer-steps: every island passes over its shard at least N times.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from yeto import YetoError
from yeto.island.train_config import TrainConfig
from yeto.launch.plan import FleetPlan, is_object_store


@dataclass(frozen=True)
class EpochLength:
    """The rounds that pass `epochs` times over the largest shard, and what they were counted from."""

    epochs: float
    inner_steps: int
    steps: int  # the largest shard's optimizer steps for `epochs` passes
    island: int  # whose shard that is (the lowest id among equals)
    shards: int  # the fleet's shard count
    blocks: int  # that shard's training blocks
    per_step: int  # its island's blocks a step

    @property
    def outer_steps(self) -> int:
        return math.ceil(self.steps / self.inner_steps)

    def line(self) -> str:
        """What launch prints with its plan: the rounds, and the shard they were counted on."""
        return (f"--epochs {self.epochs:g}: --outer-steps {self.outer_steps} x --inner-steps {self.inner_steps} "
                f"({self.steps} steps: {self.epochs:g} passes over island {self.island}'s shard, the largest of "
                f"{self.shards}, {self.blocks} training blocks at {self.per_step} a step)")


def island_ranks(plan: FleetPlan, island: int) -> int:
    """The ranks island `island` trains on: a cloud island's GPUs (one torchrun group), else one (a local island,
    a reserved slot)."""
    spec = plan.islands[island] if island < len(plan.islands) else None
    return spec.gpus if spec is not None and not spec.local else 1


def epoch_length(plan: FleetPlan, island: TrainConfig, inner_steps: int) -> EpochLength:
    """--epochs (island.epochs) of the plan's fleet as rounds of `inner_steps`, from the data read here as its
    islands will read it (`island`: an island's flags as launch passes them)."""
    from yeto.island.data import read_data
    from yeto.island.shard import blocks_per_step, counting_tokenizer, epoch_steps

    epochs = island.epochs
    assert epochs is not None
    if is_object_store(plan.data):
        raise YetoError(f"--epochs {epochs:g} counts the islands' steps in the data on this machine, and --data "
                        f"{plan.data} is in an object store: give --outer-steps instead, or a local --data")
    tokenizer = counting_tokenizer(plan.model, plan.model_revision, island.seq_len, island.trust_remote_code)
    source = read_data(plan.data, tokenizer, island.seq_len, island.eval_fraction, island.seed, plan.data_revision,
                       island.data_split, island.data_config, island.columns)
    shards = plan.num_islands
    sized = []
    for i in range(shards):
        blocks = len(source.shard(i, shards).train)
        per_step = blocks_per_step(island, island_ranks(plan, i))
        sized.append((epoch_steps(epochs, blocks, per_step), i, blocks, per_step))
    steps, i, blocks, per_step = max(sized, key=lambda s: s[0])
    return EpochLength(epochs, inner_steps, steps, i, shards, blocks, per_step)
