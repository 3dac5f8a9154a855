"""What an island's core shares with the parts it hands each concern to: what it knows of the run (`RunKnowledge`)
and of its link to the syncer (`LinkState`). Plain data with the few questions asked of it; `IslandCore` owns one of
each, and the message handlers (`messages`) and the deltas in flight (`pipeline`) read and change them through it."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Optional

import numpy as np

from yeto.sync.core.island.phases import Place
from yeto.sync.core.policy import RoundPolicy
from yeto.sync.core.island.pushed import Pushed
from yeto.sync.wire.layout import Layout, round_part


@dataclass
class RunKnowledge:
    """The run as this island knows it: the global adapter it holds, where the syncer is, and the open round."""

    layout: Layout
    policy: RoundPolicy = field(default_factory=RoundPolicy)  # the syncer's, from its welcome
    shard: Optional[tuple[int, int]] = None  # (index, count) of the data shard the syncer says we train on
    global_: Optional[np.ndarray] = None
    version: int = -1
    digest: str = ""
    syncer_version: int = -1
    need_state: bool = False
    lineage: dict[int, str] = field(default_factory=dict)  # recent versions held -> digest: a stale round's base
    # must be the run's
    open_round: Optional[dict[str, Any]] = None
    contributed: Optional[tuple[int, int]] = None  # (round, base) an earlier session of ours delivered
    place_held: Optional[Place] = None  # a round where the syncer holds a late delta of ours that is not the one
    # pushed (an earlier process's, told by the welcome, or a push refused as a duplicate said so)
    finish: Optional[dict[str, Any]] = None
    finish_at: float = 0.0

    def part(self, round_number: int) -> Optional[tuple[int, ...]]:
        """The fragments round `round_number` syncs (`round_part`), None: the whole adapter (unstreamed, last round)."""
        return round_part(self.layout, self.policy.fragments, round_number, self.policy.outer_steps)

    def may_land(self, p: Pushed, rnd: int, version: int) -> bool:
        """Could our pushed delta be merged in the round `rnd` open on `version`?"""
        return rnd == version + 1 and 0 <= version - p.base_version <= self.policy.max_base_lag


@dataclass
class LinkState:
    """The island's link to the syncer: joined or not, when it last heard it, how it catches up, why it ended."""

    connected: bool = False
    joined: bool = False
    incarnation: Optional[str] = None  # the syncer process that welcomed us
    last_heard: float = 0.0  # news from the syncer, or a fresh connection
    silent_since: Optional[float] = None  # last news from the syncer (a connection is not news)
    attempt: int = 0
    hello_at: float = -math.inf
    ping_at: float = -math.inf
    behind_since: Optional[float] = None  # catching up: since when we are behind the syncer
    sync_attempt: int = 0
    next_sync_at: float = -math.inf
    init_sent: Optional[tuple[dict[str, Any], tuple[bytes, ...]]] = None  # our founding upload
    init_copies: int = 0  # its copies sent since the bulk connection was made (an init_request says how many came)
    resend_init: bool = False
    refused: Optional[str] = None
    refused_code: str = ""
    busy: bool = False  # the syncer's last word: another, newer session holds our island id
    gave_up: Optional[str] = None
    last_tick: float = math.inf  # (no jump before the first tick)
