"""How an island times its link and its rounds: how it judges the syncer's silence (`LinkTimeouts`), when it says
hello again, how long a finished run's final adapter is waited for, and where a time window's last step falls."""

from __future__ import annotations

from dataclasses import dataclass

from yeto.sync.core.policy import RoundPolicy

HELLO_RETRY_HEARTBEATS = 2  # not welcomed after this many heartbeats: say hello again
FINISH_CATCHUP_DEAD_AFTERS = 3  # after a finish, try at least this many dead-peer timeouts to fetch the final adapter


@dataclass(frozen=True)
class LinkTimeouts:
    """How an island judges the syncer's silence (seconds)."""

    heartbeat_s: float = 5.0  # ping at least this often (the syncer's policy may ask for more often)
    dead_after_s: float = 30.0  # silence after which the connection is presumed dead and remade
    give_up_s: float = 1800.0  # silence after which the island gives up (saving its adapter)
    backoff_base_s: float = 0.5  # reconnect backoff: uniform in [0, min(max, base * 2**attempt)]
    backoff_max_s: float = 30.0


def heartbeat_s(timeouts: LinkTimeouts, policy: RoundPolicy) -> float:
    """How often an island pings: its own heartbeat, or the syncer's policy's where that asks for more often."""
    return min(timeouts.heartbeat_s, policy.heartbeat_s)
