"""The seeded fault schedule: one seed draws a fleet (islands, quorum, round policy, wire bits) and the faults it
meets (lost, duplicated and delayed messages, cut links, killed, frozen and given-up islands, killed and stopped
syncers, a poisoned step, a hostile island), and the simulation's constants."""

from __future__ import annotations

import dataclasses
import random
from dataclasses import dataclass, field
from typing import Any, Optional

from yeto.sync.core.island import LinkTimeouts
from yeto.sync.core.syncer import SyncerConfig
from yeto.sync.merge.rules import merge_rules
from yeto.sync.wire.protocol import JOIN_PRINCIPAL, ISLAND_PRINCIPAL

TICK_S = 0.25  # how often each node's timers run (the real shells tick faster)
START_S = 2.0  # islands boot in [0, this)
ROUND_OVERHEAD_S = 1.0  # messages and merge per round, roughly
HORIZON_STRETCH = 1.5  # faults are drawn over this many times a fault-free run's length
HEAL_BUDGET_S = 900.0  # once healed, the run must finish within this (simulated) time
ADAPTER_SHAPES = {"m.layers.0.q.lora_A.default.weight": (2, 8), "m.layers.0.q.lora_B.default.weight": (8, 2),
                  "m.layers.1.q.lora_A.default.weight": (2, 8), "m.layers.1.q.lora_B.default.weight": (8, 2)}
FRAGMENT_NUMEL = 24  # small fragments, so payloads span several frames
POISON = -6e4  # fits the islands' fp16 block minimums, but not once the outer step scaled it: the merge fails
SIM_OUTER_LR, SIM_OUTER_MOMENTUM = 0.7, 0.9  # DiLoCo's: the outer step scales the poison past fp16 (not the default)
SLOW_LINK_P = 0.2  # the share of schedules with islands behind a slow bulk link
# a delta message of the simulator's adapter is ~1-2 kB (its JSON header, mostly): 10 to 90 s a message, against a
# 6 s island timeout (a 70B-class delta up a 2 Mbit/s line takes about an hour: the same, scaled)
SLOW_LINK_BYTES_PER_S = (20.0, 50.0, 100.0)
STREAMED_P = 0.25  # the share of schedules whose syncer streams the adapter in parts
PIPELINED_P = 0.6  # ... and of those (fixed-step), whose islands push up to --pipeline parts ahead of the merges
HOSTILE_P = 0.2  # the share of schedules (of 2 or more islands) with a hostile island
EXTRA_IDS_P = 0.15  # the share of schedules with ids beyond --islands on the join key (extra: no quorum of theirs)
# its stream: one under which every seed pinned before extra ids keeps the schedule it was found on (tests/test_sim.py)
EXTRA_IDS_STREAM = 187
EXTRA_STEP_S = (0.005, 0.03)  # an extra id answers faster than any honest island trains (which buys it nothing)
EXTRA_OUTLIERS = (0.0, 1.0, 1000.0)  # its steps: nothing (zero deltas, deflating the clip), honest, outliers
# a hostile island in time-window rounds claims this many times its steps (step normalization: a longer round),
# now and then; from a stream under which every pinned seed keeps its schedule (tests/test_sim.py)
STEP_CLAIMS_P = 0.7
STEP_CLAIMS = (10, 1000, 10**6)
STEP_CLAIMS_STREAM = 198
POISON_WEIGHT = 1000  # ... provided it weighs enough in the merge: the poisoned step claims this many more tokens
ADAPTER_CONFIG = {"peft_type": "LORA", "r": 2, "lora_alpha": 4, "target_modules": ["q"], "task_type": "CAUSAL_LM"}
ZOMBIE_SLEEPS_LONGER_S = 20.0  # a zombie wakes up at most this long after its replacement started
DIE_DURING_WITHIN_S = 20.0  # a syncer to be killed inside a durable write dies at the latest this long after
LINK = LinkTimeouts(heartbeat_s=1.0, dead_after_s=4.0, give_up_s=600.0, backoff_base_s=0.2, backoff_max_s=2.0)
PROGRESS_CHUNK = 50  # schedules per work unit (and per progress line)


@dataclass(frozen=True)
class Hostile:
    """An island that claims `claims` x the tokens it trained and `steps` x the steps it took (its window steps
    too), and steps `outlier` x as far as an honest one."""

    island: int
    claims: int
    outlier: float
    steps: int = 1


@dataclass
class Schedule:
    seed: int
    islands: int
    quorum: int
    outer_steps: int
    inner_steps: int
    round_seconds: float
    sync_bits: int
    step_s: list[float]
    latency_s: tuple[float, float]
    p_drop: float
    p_dup: float
    p_slow_step: float
    # (at, island, down for (None: for good), a zombie: the old process only sleeps and wakes up later)
    island_kills: list[tuple[float, int, Optional[float], bool]]
    syncer_kills: list[tuple[float, float, bool]]  # (at, down for, during the next event's actions)
    cuts: list[tuple[float, int, float]]  # (at, island, for)
    pauses: list[tuple[float, int, float]]  # (at, node (-1: syncer), for)
    stops: list[tuple[float, float]]  # (at, down for): SIGTERM the syncer, then relaunch the whole fleet
    poison: Optional[tuple[float, int]]  # (at, island): its next step jumps by POISON (a delta too big to merge)
    max_inner_steps: list[int]  # per island: 0, or a cap on its steps per round (a weaker island)
    give_ups: list[tuple[float, int]] = field(default_factory=list)  # (at, island): the fleet controller gave it up
    max_base_lag: int = 0  # the syncer's staleness policy and grace (drawn from a stream of their own)
    staleness_exponent: float = 0.0
    grace_ms: float = 3000.0
    merge: str = "rda"
    broadcast_bits: int = 0  # 0: sync_bits
    fragments: int = 1  # the syncer streams the adapter in this many parts (--fragments)
    pipeline: int = 1  # deltas a streamed island may have in flight (--pipeline)
    # island -> bytes per second of its bulk connection, both ways (a home uplink carrying a big adapter): each
    # message that carries an adapter takes longer than the island timeout, while its control connection is fast
    slow_links: dict[int, float] = field(default_factory=dict)
    hostile: Optional["Hostile"] = None  # a join-key holder steering the merge with its claims and outliers
    # per island, the key its connections prove: "own" (an island key: trusted) or "join" (the shared key: bounded)
    keys: list[str] = field(default_factory=list)
    # ids beyond --islands (islands, islands + 1, ...) on the join key; their entries follow the fleet's in
    # step_s, max_inner_steps and keys; `extra_outlier` scales their steps (0: every delta they send is zero)
    extra_ids: int = 0
    extra_outlier: float = 1.0

    @staticmethod
    def draw(seed: int) -> "Schedule":
        """The fleet first, then faults spread over about the time that fleet needs to finish (faults after the end
        test nothing), with downtimes that often outlast it."""
        rng = random.Random(seed)
        n = rng.randint(1, 4)
        quorum = rng.randint(1, n)
        outer_steps, inner_steps = rng.randint(2, 6), rng.randint(1, 4)
        round_seconds = rng.choice([0.0, 0.0, 0.0, 1.5])
        step_s = [rng.uniform(0.05, 0.8) for _ in range(n)]
        round_s = round_seconds or inner_steps * max(step_s)
        horizon = START_S + outer_steps * (round_s + ROUND_OVERHEAD_S) * HORIZON_STRETCH
        lossy = rng.random() < 0.7
        permanent_budget = n - quorum
        kills = []
        for _ in range(rng.choice([0, 0, 1, 2, 3, 5])):
            lid = rng.randrange(n)
            forever = permanent_budget > 0 and rng.random() < 0.2
            permanent_budget -= forever
            kills.append((rng.uniform(0, horizon), lid, None if forever else rng.uniform(0.5, 20.0),
                          rng.random() < 0.2))
        syncer_kills = [(rng.uniform(0, horizon), rng.uniform(0.2, 25.0), rng.random() < 0.5)
                        for _ in range(rng.choice([0, 0, 1, 1, 2, 4]))]
        cuts = [(rng.uniform(0, horizon), rng.randrange(n), rng.uniform(0.5, 15.0))
                for _ in range(rng.choice([0, 1, 2, 4]))]
        pauses = [(rng.uniform(0, horizon), rng.randrange(-1, n), rng.uniform(0.5, 12.0))
                  for _ in range(rng.choice([0, 0, 1, 3]))]
        stops = [(rng.uniform(0, horizon), rng.uniform(0.5, 10.0))] if rng.random() < 0.1 else []
        poison = (rng.uniform(0, horizon), rng.randrange(n)) if rng.random() < 0.15 else None
        return Schedule(
            seed=seed, islands=n, quorum=quorum, outer_steps=outer_steps, inner_steps=inner_steps,
            round_seconds=round_seconds, sync_bits=rng.choice([4, 4, 8, 32]), step_s=step_s,
            latency_s=(rng.uniform(0.001, 0.05), rng.uniform(0.05, 0.6)),
            p_drop=rng.uniform(0.0, 0.08) if lossy else 0.0, p_dup=rng.uniform(0.0, 0.05) if lossy else 0.0,
            p_slow_step=rng.choice([0.0, 0.0, 0.02]), island_kills=sorted(kills), syncer_kills=sorted(syncer_kills),
            cuts=sorted(cuts), pauses=sorted(pauses), stops=stops, poison=poison,
            max_inner_steps=[rng.choice([0, 0, 0, 1]) for _ in range(n)], give_ups=Schedule.draw_give_ups(seed, kills),
            hostile=Schedule.draw_hostile(seed, n), **Schedule.draw_policy(seed)
        ).with_bits_drawn().with_streaming_drawn().with_slow_links_drawn().with_keys_drawn().with_extra_ids_drawn(
        ).with_step_claims_drawn()

    def with_bits_drawn(self) -> "Schedule":
        """Now and then 2-bit deltas, and broadcasts at their own precision (a stream of their own: older seeds keep
        their fleets and faults)."""
        rng = random.Random(self.seed * 31 + 41)
        if rng.random() < 0.2:
            self.sync_bits = 2
        self.broadcast_bits = rng.choice([0, 0, 2, 4, 8])
        return self

    def with_streaming_drawn(self) -> "Schedule":
        """Now and then a run streamed in parts (--fragments: fresh deltas only), from a stream of its own."""
        rng = random.Random(self.seed * 31 + 53)
        if rng.random() < STREAMED_P:
            self.fragments, self.max_base_lag = rng.choice([2, 3, 4]), 0
            pipelined = random.Random(self.seed * 31 + 61)  # (a stream of its own: older seeds keep their schedules)
            if not self.round_seconds and pipelined.random() < PIPELINED_P:
                self.pipeline = pipelined.randint(2, self.fragments)
        return self

    def with_slow_links_drawn(self) -> "Schedule":
        """Now and then one or two islands behind a slow bulk link (a stream of its own)."""
        rng = random.Random(self.seed * 31 + 59)
        if rng.random() < SLOW_LINK_P:
            for lid in rng.sample(range(self.islands), min(self.islands, rng.choice([1, 1, 2]))):
                self.slow_links[lid] = rng.choice(SLOW_LINK_BYTES_PER_S)
        return self

    def with_keys_drawn(self) -> "Schedule":
        """Whose claims the syncer believes: a fleet on island keys (what `yeto launch` sets up), on the shared join
        key, or a mix; a hostile island always holds the join key (a stream of its own)."""
        rng = random.Random(self.seed * 31 + 67)
        fleet = rng.choice(["own", "join", "mixed"])
        self.keys = [rng.choice(["own", "join"]) if fleet == "mixed" else fleet for _ in range(self.islands)]
        if self.hostile is not None:
            self.keys[self.hostile.island] = "join"
        return self

    def with_extra_ids_drawn(self) -> "Schedule":
        """Now and then a join-key holder's extra ids: fast, pushing nothing, honest steps or outliers (a stream of
        its own; they come after the fleet, so its faults and draws stay as they were)."""
        rng = random.Random(self.seed * 31 + EXTRA_IDS_STREAM)
        if rng.random() < EXTRA_IDS_P:
            self.extra_ids = rng.choice([1, 1, 2])
            self.extra_outlier = rng.choice(EXTRA_OUTLIERS)
            for _ in range(self.extra_ids):
                self.step_s.append(rng.uniform(*EXTRA_STEP_S))
                self.max_inner_steps.append(rng.choice([0, 1]))
                self.keys.append("join")
        return self

    def with_step_claims_drawn(self) -> "Schedule":
        """Now and then a hostile island in time-window rounds lies about its steps too (a stream of its own)."""
        rng = random.Random(self.seed * 31 + STEP_CLAIMS_STREAM)
        if self.hostile is not None and self.round_seconds and rng.random() < STEP_CLAIMS_P:
            self.hostile = dataclasses.replace(self.hostile, steps=rng.choice(STEP_CLAIMS))
        return self

    def principal(self, lid: int) -> str:
        """The ZAP User-Id island `lid`'s connections authenticate as."""
        return JOIN_PRINCIPAL if lid >= len(self.keys) or self.keys[lid] == "join" else f"{ISLAND_PRINCIPAL}{lid}"

    @staticmethod
    def draw_hostile(seed: int, n: int) -> Optional["Hostile"]:
        """Now and then one island lies about its work and pushes outliers (a stream of its own, so older seeds
        keep their faults)."""
        rng = random.Random(seed * 31 + 41)
        if n < 2 or rng.random() >= HOSTILE_P:
            return None
        return Hostile(rng.randrange(n), rng.choice([1, 10**3, 10**6]), rng.choice([1.0, 10.0, 1000.0]))

    @staticmethod
    def draw_policy(seed: int) -> dict[str, Any]:
        """Stale deltas and the adaptive grace: drawn from a stream of their own (older seeds keep their faults)."""
        rng = random.Random(seed * 31 + 29)
        return {"max_base_lag": rng.choice([0, 1, 2, 4]), "staleness_exponent": rng.choice([0.0, 0.5]),
                "grace_ms": rng.choice([0.0, 500.0, 3000.0]), "merge": rng.choice(tuple(merge_rules()))}

    @staticmethod
    def draw_give_ups(seed: int, kills: list) -> list[tuple[float, int]]:
        """The fleet controller (`yeto launch`) giving up a killed island after a while: mostly one killed for
        good, sometimes one that comes back anyway. Drawn from a stream of their own, so every older seed keeps its
        schedule."""
        rng = random.Random(seed * 31 + 17)
        return sorted((at + rng.uniform(1.0, 30.0), lid) for at, lid, down, _ in kills
                      if rng.random() < (0.6 if down is None else 0.15))

    def syncer_config(self) -> SyncerConfig:
        return SyncerConfig(islands=self.islands, quorum=self.quorum, outer_steps=self.outer_steps,
                            inner_steps=self.inner_steps, round_seconds=self.round_seconds, sync_bits=self.sync_bits,
                            broadcast_bits=self.broadcast_bits or None,
                            straggler_timeout=3.0, quorum_timeout=1e6, island_timeout=6.0, out="(simulated)",
                            outer_lr=SIM_OUTER_LR, outer_momentum=SIM_OUTER_MOMENTUM,
                            max_base_lag=self.max_base_lag, staleness_exponent=self.staleness_exponent,
                            grace_s=self.grace_ms / 1000, merge=self.merge, fragments=self.fragments,
                            pipeline=self.pipeline)


# ---------------------------------------------------------------------------------------------- the world
