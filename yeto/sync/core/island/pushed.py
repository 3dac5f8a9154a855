"""The delta an island has pushed, as the island tracks it until the syncer merges or refuses it.

Its copies on the wire (`on_its_way`, counted by `copies`, which the syncer's answers name), whether a connection
break lost it (`resend`), whether the syncer acked it (and into which round), and the error-feedback residual from
before it, given back if it never counts.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

import numpy as np


@dataclass
class Pushed:
    round: int
    base_version: int
    digest: str
    header: dict[str, Any]
    frames: tuple[bytes, ...]
    residual_before: np.ndarray = field(repr=False)
    base_digest: str = ""
    acked: bool = False
    merge_round: Optional[int] = None  # the round the syncer acked it into
    resend: bool = False  # a connection broke before the ack: send again when the syncer is heard from
    stale: bool = False  # refused as stale while its round was not open: send again once a pong says it is
    # sent on the current connections and not answered yet: a round announcement does not send it again (the syncer
    # gets it, or the connection breaks: `link_lost`); over a slow link a second copy holds the uplink as long again
    on_its_way: bool = False
    copies: int = 0  # copies sent; the syncer's answers (and the pongs repeating them) name the copy they answer
    part: Optional[tuple[int, ...]] = None  # the fragments it carries (None: all): the residual it gives back
