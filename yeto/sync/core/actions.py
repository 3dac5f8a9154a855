"""What the coordination cores ask their shells to do, and what survives on the syncer's disk.

The syncer core returns `Send`, `Record` (append to the tape), `SaveCheckpoint`,
`SaveDelta`, `DropDeltas`, `Log` and `Exit`; an island core returns `Out`,
`Reconnect` and `Log`. A shell executes them in order. `Checkpoint`,
`AcceptedDelta` and `Durable` are the syncer's durable state, written by
`SaveCheckpoint`/`SaveDelta` and handed back to `SyncerCore.start` after a restart.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Optional, Union

import numpy as np

from yeto.sync.wire.layout import Layout


@dataclass(frozen=True)
class Send:
    peer: str  # the island's control-connection id; the shell routes adapter-carrying types to its bulk one
    type: str
    header: dict[str, Any]
    frames: tuple[bytes, ...] = ()


@dataclass(frozen=True)
class Record:
    """Append one event to the tape."""

    event: str
    fields: dict[str, Any]


@dataclass(frozen=True)
class SaveCheckpoint:
    checkpoint: "Checkpoint"


@dataclass(frozen=True)
class SaveDelta:
    delta: "AcceptedDelta"


@dataclass(frozen=True)
class DropDeltas:
    """Delete saved deltas: those of rounds up to `through_round`, or the one of (`round`, `island`)."""

    through_round: int = -1
    round: int = -1
    island: int = -1


@dataclass(frozen=True)
class ClearGivenUp:
    """Remove the fleet controller's given-up mark of an island that is back (`given-up/<island>` in the --out), so a
    restarted syncer counts on it too."""

    island: int


@dataclass(frozen=True)
class Log:
    level: str  # "info" | "warning" | "error"
    text: str


@dataclass(frozen=True)
class Exit:
    code: int


@dataclass(frozen=True)
class Out:
    """Send a message to the syncer (the shell picks the control or bulk connection by type)."""

    type: str
    header: dict[str, Any]
    frames: tuple[bytes, ...] = ()


@dataclass(frozen=True)
class Reconnect:
    """Drop both connections (and what they queued); connect again after `delay_s`."""

    delay_s: float


Action = Union[Send, Record, SaveCheckpoint, SaveDelta, DropDeltas, ClearGivenUp, Log, Exit]  # the syncer core's
IslandAction = Union[Out, Reconnect, Log]  # from an island core


# ---------------------------------------------------------------------------------------------- durable state


@dataclass
class Checkpoint:
    """Everything a restart needs, written after every merge (arrays are never mutated once in here)."""

    version: int
    layout: Layout
    adapter_config: dict[str, Any]
    provenance: dict[str, Any]
    global_: np.ndarray
    momentum: np.ndarray
    residual: np.ndarray
    digest: str
    config: dict[str, Any]
    members: list[int]  # island ids that ever joined: after a restart the round waits a while for them
    merged: dict[int, list]  # island id -> [[round, delta digest], ...] of its latest merged deltas
    retired: dict[int, list[str]] = field(default_factory=dict)  # island -> sessions a newer one took over
    contract: dict[str, Any] = field(default_factory=dict)  # what every island of the run agrees on
    owners: dict[int, str] = field(default_factory=dict)  # island id -> proof of the identity holding it


@dataclass
class AcceptedDelta:
    island: int
    session: str
    round: int
    base_version: int
    tokens: int
    loss_tokens: int
    inner_steps: int
    loss: float
    digest: str
    descs: list[dict[str, int]]
    frames: tuple[bytes, ...]
    peak: float = 0.0  # largest |value|: the first suspect when a merge fails
    norm: float = 0.0  # its L2 norm (robust merge); peak and norm are measured again after a restart
    carried_steps: int = 0  # of its inner steps, those trained in an earlier round's window and carried onto this one
    tier: str = "bounded"  # its island's tier when it came (yeto.sync.merge.rules.Tier): what its claims buy

    @property
    def round_steps(self) -> int:
        """Its steps taken in its round's window: step normalization takes the most of them as the round's length."""
        return self.inner_steps - self.carried_steps

    @property
    def lag(self) -> int:
        """Versions the global moved on between the delta's base and the round it is merged in (`round` is that
        round; the island trained round `base_version + 1`)."""
        return self.round - 1 - self.base_version

    def ref(self) -> list:
        """How its island names it: [the round it trained, its base version, digest]."""
        return [self.base_version + 1, self.base_version, self.digest]

    def saved_fields(self) -> dict[str, Any]:
        return {k: v for k, v in asdict(self).items() if k not in ("frames", "peak", "norm")}


@dataclass
class Durable:
    """What survived on disk, handed to `start`."""

    checkpoint: Optional[Checkpoint] = None
    deltas: list[AcceptedDelta] = field(default_factory=list)
    tape: list[dict[str, Any]] = field(default_factory=list)
    notes: list[Record] = field(default_factory=list)  # e.g. a repaired tape, a fallback checkpoint
