"""The torch backend as `yeto.island.training.train` runs it (`yeto train --backend torch`): one process, or one
torchrun group whose rank 0 trains and talks while the other ranks follow it.

Nothing loads here until training starts (torch included), so `yeto launch` checks a torch island's flags on a
machine without torch.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, Callable, Iterator, Optional

from yeto.island.train_config import TrainConfig, check_config

if TYPE_CHECKING:
    from yeto.backends.torch.torchrun import RankGroup
    from yeto.island.interface import Island


class TorchBackend:
    """torch + peft: `TorchIsland`, relayed across a torchrun group's ranks (a `yeto.island.interface.Backend`)."""

    name = "torch"

    def __init__(self) -> None:
        self.group: Optional[RankGroup] = None  # this process's torchrun group, joined by `follow`

    def check_flags(self, cfg: TrainConfig) -> None:
        """The checks every backend makes (the device is checked as the island starts: that needs torch)."""
        check_config(cfg)

    def follow(self, cfg: TrainConfig) -> Optional[dict[str, Any]]:
        """Join the torchrun group if there is one; a rank other than 0 builds the same island and makes the calls
        rank 0 relays (standalone or with --syncer) until it says exit. Rank 0 alone logs, saves and talks."""
        from yeto.backends.torch.island import TorchIsland
        from yeto.backends.torch.torchrun import RankGroup, follow

        self.group = group = RankGroup.from_env()
        if group is None or group.leader:
            return None
        island = None
        try:
            island = TorchIsland(cfg, log=lambda s: None, group=group)
            follow(island, group)
        finally:
            group.close()
        return {"rank": group.rank, "steps": island.step_count}

    @contextmanager
    def island(self, cfg: TrainConfig, log: Callable[[str], None]) -> Iterator[Island]:
        """The island; in a torchrun group, rank 0's island behind a `RelayedIsland` (every call that changes it
        goes to the other ranks first: a sharded forward is collective), which lets them go at the end."""
        from yeto.backends.torch.island import TorchIsland
        from yeto.backends.torch.torchrun import RelayedIsland

        group = self.group
        if group is None:
            yield TorchIsland(cfg, log)
            return
        try:
            relayed = RelayedIsland(TorchIsland(cfg, log, group), group)
            try:
                yield relayed
            finally:
                relayed.finish()  # the other ranks stop following (they would otherwise wait for a collective)
        finally:
            group.close()
