"""The MLX backend as `yeto.island.training.train` runs it (`yeto train --backend mlx`): one process is one island.

MLX itself loads only when the island starts, so `yeto launch` checks an MLX island's flags anywhere.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, Callable, Iterator, Optional

from yeto.island.train_config import TrainConfig

if TYPE_CHECKING:
    from yeto.island.interface import Island


class MLXBackend:
    """MLX (Apple silicon; MLX's CPU backend on Linux): `MLXIsland` (a `yeto.island.interface.Backend`)."""

    name = "mlx"

    def check_flags(self, cfg: TrainConfig) -> None:
        """The flags an MLX island cannot honour, refused before anything loads."""
        from yeto.backends.mlx.island import check_flags

        check_flags(cfg)

    def follow(self, cfg: TrainConfig) -> Optional[dict[str, Any]]:
        """Never: an MLX island is one process."""
        return None

    @contextmanager
    def island(self, cfg: TrainConfig, log: Callable[[str], None]) -> Iterator[Island]:
        from yeto.backends.mlx.island import MLXIsland

        yield MLXIsland(cfg, log)
