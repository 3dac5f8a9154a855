"""An island's data shard: the dataset read before joining, its shard taken when the syncer names it."""

from __future__ import annotations

import json
import math
from typing import TYPE_CHECKING, Any, Callable, Optional

from yeto import YetoError
from yeto.island.train_config import TrainConfig, check_seq_len
from yeto.island.schedule import BatchSampler

if TYPE_CHECKING:
    from yeto.island.data import Blocks, DataSource, PreparedData


EXACT_DIGITS = 9  # epochs x blocks / batch rounded to this many digits before its ceiling (1.1 x 10 is 11, not 12)


def epoch_steps(epochs: float, blocks: int, blocks_per_step: int) -> int:
    """The optimizer steps that pass `epochs` times over `blocks` training blocks, `blocks_per_step` a step (a
    partial last batch is a step: at least one)."""
    return max(1, math.ceil(round(epochs * blocks / blocks_per_step, EXACT_DIGITS)))


def blocks_per_step(cfg: TrainConfig, ranks: int = 1) -> int:
    """The training blocks one optimizer step of an island takes: --batch-size on each of its `ranks` (a torchrun
    island's ranks draw one global batch), --grad-accum batches a step."""
    return cfg.batch_size * ranks * cfg.grad_accum


def counting_tokenizer(model: str, revision: Optional[str], seq_len: int, trust_remote_code: bool = False) -> Any:
    """The tokenizer a run on `model` tokenizes and packs its data with, `seq_len` checked against the model's
    context as an island checks it: what reads a dataset before any island does (`yeto data inspect`, `yeto launch
    --epochs`) loads no weights."""
    from yeto.models.catalog import context_length
    from yeto.models.materialize import load_tokenizer, resolve_model

    artifact = resolve_model(model, revision)
    check_seq_len(seq_len, context_length(artifact.path), model)
    return load_tokenizer(artifact, trust_remote_code)


class ShardedData:
    """An island's data (every backend): the dataset read and checked before the island joins a run, and its
    shard of it taken once known: at start from --island-id of --islands (or the whole of it standalone),
    else from the syncer's welcome (`use_shard`), which cuts the data into the run's shard count."""

    source: "DataSource"
    data: Optional["PreparedData"] = None
    shard: Optional[tuple[int, int]] = None
    sampler: Optional[BatchSampler] = None
    ranks: int = 1

    def read_data(self, cfg: TrainConfig, tokenizer: Any, log: Callable[[str], None]) -> None:
        from yeto.island.data import read_data
        from yeto.models.catalog import context_length

        # (every island resolves its model before it reads the data: `Island.model_artifact`)
        check_seq_len(cfg.seq_len, context_length(self.model_artifact.path), cfg.model)  # type: ignore[attr-defined]
        self.source = read_data(cfg.data, tokenizer, cfg.seq_len, cfg.eval_fraction, cfg.seed, cfg.data_revision,
                                cfg.data_split, cfg.data_config, cfg.columns)
        self._log_data = log
        if cfg.num_islands or not cfg.syncer:
            self.use_shard(cfg.island_id if cfg.num_islands else 0, cfg.num_islands or 1)
        else:
            log(f"data: {json.dumps(self.source.stats)}; the syncer says which shard this island trains on")

    def use_shard(self, index: int, count: int) -> None:
        """Train on shard `index` of `count` from here on (a no-op if it is the shard held)."""
        if self.shard == (index, count):
            return
        cfg = self.cfg  # type: ignore[attr-defined]
        self.data = self.source.shard(index, count)
        self.shard = (index, count)
        self._log_data(f"data: {json.dumps(self.data.stats)}")
        # every rank of a torchrun island draws the same global batch (ranks x --batch-size) and takes its slice
        self.sampler = BatchSampler(len(self.data.train), cfg.batch_size * self.ranks, cfg.seed + 1000 * cfg.island_id)
        if cfg.epochs is not None:
            per_step = blocks_per_step(cfg, self.ranks)
            cfg.max_steps = epoch_steps(cfg.epochs, len(self.data.train), per_step)
            self._log_data(f"--epochs {cfg.epochs:g}: {cfg.max_steps} steps ({len(self.data.train)} training blocks "
                           f"in the shard, {per_step} a step: --batch-size {cfg.batch_size}"
                           f"{f' x {self.ranks} ranks' if self.ranks > 1 else ''} x --grad-accum {cfg.grad_accum})")

    def resume_data(self, meta: dict[str, Any]) -> None:
        """Take the shard and batch position a saved training state had (a restarted island goes on with them)."""
        if meta.get("shard"):
            self.use_shard(*meta["shard"])
        if meta.get("sampler") and self.sampler is not None:
            self.sampler.seek(meta["sampler"])

    def train_blocks(self) -> "Blocks":
        if self.data is None or self.sampler is None:
            raise YetoError("this island has no data shard yet: pass --islands, or join a syncer (it says "
                            "which shard)")
        return self.data.train

    def data_record(self) -> dict[str, Any]:
        return {"data": self.source.artifact.to_dict(),
                "data_stats": self.data.stats if self.data is not None else self.source.stats}
