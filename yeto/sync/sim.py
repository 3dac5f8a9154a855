"""Deterministic simulation of a whole run: the real coordination cores under seeded faults.

One seed is one schedule: a fleet (learners, quorum, round policy, wire bits)
and a list of faults drawn from the seed: messages lost with their connection,
duplicated and delayed (so the control and bulk connections reorder), links cut
for seconds, learners killed and restarted (some for good), the syncer killed
at any point (also in the middle of an action list) and restarted from its
simulated disk (where only fsynced writes survive), nodes frozen (a laptop
asleep: their clock jumps), and slow inner steps. Nothing else varies: no
threads, no wall clock, no sockets, so a failing seed reproduces exactly.

The syncer is `SyncerCore`, every learner is a `LearnerCore` driven by a
simulated training loop over a fake island whose steps add known vectors.
After every schedule, and along the way:
- the tape passes `yeto.sync.shell.audit.audit`;
- every delta was computed against the exact global adapter of its base version;
- a durable version is never redefined;
- the run finishes (every merge) once faults stop: nobody waits forever;
- every learner that finished holds the syncer's final global adapter, bit for bit;
- replaying the merges on the tape from the captured payloads gives that adapter.

    python -m yeto.sync.sim --seeds 1000 [--first 0] [--workers 2]
    python -m yeto.sync.sim --seed 17 --trace      # one schedule, every event
"""

from __future__ import annotations

import argparse
import copy
import heapq
import json
import math
import random
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import numpy as np

from yeto.sync.shell.audit import TapeFold, audit
from yeto.sync.core.actions import (Checkpoint, DropDeltas, Durable, Exit, Log, Out, Reconnect, Record, SaveCheckpoint,
                                    SaveDelta, Send)
from yeto.sync.core.learner import Done, LearnerCore, LinkTimeouts, RoundCounts, Train, Verdict, Wait
from yeto.sync.core.syncer import SyncerConfig, SyncerCore
from yeto.sync.wire.layout import build_layout
from yeto.sync.merge.rules import DeltaCounts, merge_terms
from yeto.sync.merge.aggregate import RoundSum, clipped_merge, effective_weight
from yeto.sync.merge.outer import nesterov_step
from yeto.sync.wire.protocol import (Code, Message, array_digest, decode, decode_fragments, digest_bytes, encode,
                                     encode_fragments_ef, is_bulk)
from yeto.sync.wire.quant import ErrorFeedback, QuantError

TICK_S = 0.25  # how often each node's timers run (the real shells tick faster)
START_S = 2.0  # learners boot in [0, this)
ROUND_OVERHEAD_S = 1.0  # messages and merge per round, roughly
HORIZON_STRETCH = 1.5  # faults are drawn over this many times a fault-free run's length
HEAL_BUDGET_S = 900.0  # once healed, the run must finish within this (simulated) time
ADAPTER_SHAPES = {"m.layers.0.q.lora_A.default.weight": (2, 8), "m.layers.0.q.lora_B.default.weight": (8, 2),
                  "m.layers.1.q.lora_A.default.weight": (2, 8), "m.layers.1.q.lora_B.default.weight": (8, 2)}
FRAGMENT_NUMEL = 24  # small fragments, so payloads span several frames
POISON = -6e4  # fits the learners' fp16 block minimums, but not once the outer step scaled it: the merge fails
SIM_OUTER_LR, SIM_OUTER_MOMENTUM = 0.7, 0.9  # DiLoCo's: the outer step scales the poison past fp16 (not the default)
HOSTILE_P = 0.2  # the share of schedules (of 2 or more learners) with a hostile learner
POISON_WEIGHT = 1000  # ... provided it weighs enough in the merge: the poisoned step claims this many more tokens
ADAPTER_CONFIG = {"peft_type": "LORA", "r": 2, "lora_alpha": 4, "target_modules": ["q"], "task_type": "CAUSAL_LM"}
ZOMBIE_SLEEPS_LONGER_S = 20.0  # a zombie wakes up at most this long after its replacement started
DIE_DURING_WITHIN_S = 20.0  # a syncer to be killed inside a durable write dies at the latest this long after
LINK = LinkTimeouts(heartbeat_s=1.0, dead_after_s=4.0, give_up_s=600.0, backoff_base_s=0.2, backoff_max_s=2.0)
PROGRESS_CHUNK = 50  # schedules per work unit (and per progress line)


class Violation(Exception):
    pass


# ---------------------------------------------------------------------------------------------- the schedule


@dataclass(frozen=True)
class Hostile:
    """A learner that claims `claims` x the tokens it trained and steps `outlier` x as far as an honest one."""

    learner: int
    claims: int
    outlier: float


@dataclass
class Schedule:
    seed: int
    learners: int
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
    # (at, learner, down for (None: for good), a zombie: the old process only sleeps and wakes up later)
    learner_kills: list[tuple[float, int, Optional[float], bool]]
    syncer_kills: list[tuple[float, float, bool]]  # (at, down for, during the next event's actions)
    cuts: list[tuple[float, int, float]]  # (at, learner, for)
    pauses: list[tuple[float, int, float]]  # (at, node (-1: syncer), for)
    stops: list[tuple[float, float]]  # (at, down for): SIGTERM the syncer, then relaunch the whole fleet
    poison: Optional[tuple[float, int]]  # (at, learner): its next step jumps by POISON (a delta too big to merge)
    max_inner_steps: list[int]  # per learner: 0, or a cap on its steps per round (a weaker island)
    give_ups: list[tuple[float, int]] = field(default_factory=list)  # (at, learner): the fleet controller gave it up
    max_base_lag: int = 0  # the syncer's staleness policy and grace (drawn from a stream of their own)
    staleness_exponent: float = 0.0
    grace_ms: float = 3000.0
    merge: str = "rda"
    hostile: Optional["Hostile"] = None  # a join-key holder steering the merge with its claims and outliers

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
            seed=seed, learners=n, quorum=quorum, outer_steps=outer_steps, inner_steps=inner_steps,
            round_seconds=round_seconds, sync_bits=rng.choice([4, 4, 8, 32]), step_s=step_s,
            latency_s=(rng.uniform(0.001, 0.05), rng.uniform(0.05, 0.6)),
            p_drop=rng.uniform(0.0, 0.08) if lossy else 0.0, p_dup=rng.uniform(0.0, 0.05) if lossy else 0.0,
            p_slow_step=rng.choice([0.0, 0.0, 0.02]), learner_kills=sorted(kills), syncer_kills=sorted(syncer_kills),
            cuts=sorted(cuts), pauses=sorted(pauses), stops=stops, poison=poison,
            max_inner_steps=[rng.choice([0, 0, 0, 1]) for _ in range(n)], give_ups=Schedule.draw_give_ups(seed, kills),
            hostile=Schedule.draw_hostile(seed, n), **Schedule.draw_policy(seed))

    @staticmethod
    def draw_hostile(seed: int, n: int) -> Optional["Hostile"]:
        """Now and then one learner lies about its work and pushes outliers (a stream of its own, so older seeds
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
                "grace_ms": rng.choice([0.0, 500.0, 3000.0]), "merge": rng.choice(["mean", "rda"])}

    @staticmethod
    def draw_give_ups(seed: int, kills: list) -> list[tuple[float, int]]:
        """The fleet controller (`yeto launch`) giving up a killed learner after a while: mostly one killed for
        good, sometimes one that comes back anyway. Drawn from a stream of their own, so every older seed keeps its
        schedule."""
        rng = random.Random(seed * 31 + 17)
        return sorted((at + rng.uniform(1.0, 30.0), lid) for at, lid, down, _ in kills
                      if rng.random() < (0.6 if down is None else 0.15))

    def syncer_config(self) -> SyncerConfig:
        return SyncerConfig(learners=self.learners, quorum=self.quorum, outer_steps=self.outer_steps,
                            inner_steps=self.inner_steps, round_seconds=self.round_seconds, sync_bits=self.sync_bits,
                            straggler_timeout=3.0, quorum_timeout=1e6, learner_timeout=6.0, out="(simulated)",
                            outer_lr=SIM_OUTER_LR, outer_momentum=SIM_OUTER_MOMENTUM,
                            max_base_lag=self.max_base_lag, staleness_exponent=self.staleness_exponent,
                            grace_s=self.grace_ms / 1000, merge=self.merge)


# ---------------------------------------------------------------------------------------------- the world


class World:
    def __init__(self, sched: Schedule, trace: Optional[Callable[[str], None]] = None):
        self.s = sched
        self.rng = random.Random(sched.seed * 7919 + 1)
        self.now = 0.0
        self.queue: list[tuple[float, int, Callable[[], None]]] = []
        self.seq = 0
        self.trace = trace
        self.layout = build_layout({k: np.zeros(v, np.float32) for k, v in ADAPTER_SHAPES.items()}, FRAGMENT_NUMEL)
        self.epoch: dict[tuple[int, str], int] = {}  # (learner process, channel) -> connection epoch
        self.last_delivery: dict[tuple[int, str, str], float] = {}  # FIFO per connection and direction
        self.net_ids = 0
        self.cut_until: dict[int, float] = {}
        self.globals: dict[int, tuple[str, np.ndarray]] = {}  # durable version -> (digest, adapter)
        self.payloads: dict[str, tuple[list, list[bytes]]] = {}  # delta digest -> (descs, frames)
        self.init_payloads: dict[str, np.ndarray] = {}  # global digest -> initial adapter
        # deltas as (learner, base version, digest): two sessions of one learner may send equal bits on other bases
        self.acked: set[tuple[int, int, str]] = set()  # every ack a learner received
        self.merged: set[tuple[int, int, str]] = set()  # the deltas in durable merges
        self.parked: list[tuple] = []  # (process, channel, epoch, deliver) sent while the syncer was down
        self.relaunches = 0  # fleet relaunches scheduled
        self.stopped = False  # a fleet stop happened: learners told to stop are relaunched
        self.syncer = SimSyncer(self)
        self.learners = [SimLearner(self, i) for i in range(sched.learners)]
        self.zombies: list[SimLearner] = []  # replaced learner processes that are still running
        self.carries = 0  # rounds whose work a learner carried onto the next global (Verdict.CARRY)
        self.carries_back = 0  # ... and carries sent back to their own round (the late delta holding it was refused)
        # when the last fault is over (downtimes, cuts and freezes included), with room to reconnect
        ends = [at + (down or 0.0) + (ZOMBIE_SLEEPS_LONGER_S if zombie else 0.0)
                for at, _, down, zombie in sched.learner_kills]
        ends += [at + (DIE_DURING_WITHIN_S if during else 0.0) + d for at, d, during in sched.syncer_kills]
        ends += [at + d for at, _, d in sched.cuts] + [at + d for at, _, d in sched.pauses]
        ends += [at + d for at, d in sched.stops]
        self.healed_at = max(ends, default=0.0) + 5.0 + 2 * LINK.dead_after_s + LINK.backoff_max_s

    def log(self, text: str) -> None:
        if self.trace:
            self.trace(f"{self.now:9.3f} {text}")

    def at(self, t: float, fn: Callable[[], None]) -> None:
        self.seq += 1
        heapq.heappush(self.queue, (t, self.seq, fn))

    # the network --------------------------------------------------------------------------

    def link_epoch(self, node: "SimLearner", channel: str) -> int:
        return self.epoch.get((node.net_id, channel), 0)

    def break_link(self, node: "SimLearner", channel: str, notify: bool = True) -> None:
        """The connection of one learner process breaks: what is in flight on it is lost."""
        self.epoch[(node.net_id, channel)] = self.link_epoch(node, channel) + 1
        if notify:
            node.on_link_lost()

    def post(self, node: "SimLearner", to_syncer: bool, type_: str, header: dict[str, Any], frames: tuple[bytes, ...],
             deliver: Callable[[list[bytes]], None]) -> None:
        """Encode one message as the shells do and carry it on the connection its type travels on."""
        parts = encode(type_, header, frames)
        self.transmit(node, "bulk" if is_bulk(type_) else "control", to_syncer, parts, lambda: deliver(parts))

    def transmit(self, node: "SimLearner", channel: str, to_syncer: bool, parts: list[bytes],
                 deliver: Callable[[], None]) -> None:
        """Carry one message between the syncer and a learner process: lost with its connection, duplicated,
        delayed (FIFO per connection). To a syncer that is down, ZeroMQ queues it and delivers it to the restarted
        one, unless the learner reconnects first."""
        if to_syncer and not self.syncer.up and not self.syncer.exited:
            self.parked.append((node, channel, self.link_epoch(node, channel), deliver))
            return
        if self.now < self.cut_until.get(node.lid, -1.0):
            self.break_link(node, channel)
            return
        if self.rng.random() < self.s.p_drop:
            self.log(f"net: lost a message on learner {node.lid}'s {channel} connection")
            self.break_link(node, channel)
            return
        lo, hi = self.s.latency_s
        nbytes = sum(len(p) for p in parts)
        epoch = self.link_epoch(node, channel)
        copies = 2 if self.rng.random() < self.s.p_dup else 1
        for _ in range(copies):
            key = (node.net_id, channel, "up" if to_syncer else "down")
            t = max(self.now + self.rng.uniform(lo, hi) + nbytes / 2e6, self.last_delivery.get(key, 0.0))
            self.last_delivery[key] = t

            def arrive(epoch=epoch) -> None:
                if self.link_epoch(node, channel) == epoch and self.now >= self.cut_until.get(node.lid, -1.0):
                    deliver()

            self.at(t, arrive)

    # running --------------------------------------------------------------------------------

    def setup(self) -> None:
        s = self.s
        self.syncer.boot()
        for i, lrn in enumerate(self.learners):
            self.at(self.rng.uniform(0.0, 2.0), lrn.boot)
        for at, lid, down, zombie in s.learner_kills:
            if zombie and down is not None:
                self.at(at, lambda lid=lid, down=down: self.zombify(
                    lid, down, down + self.rng.uniform(2.0, ZOMBIE_SLEEPS_LONGER_S)))
            else:
                self.at(at, lambda lid=lid, down=down: self.learners[lid].kill(down))
        for at, down, during in s.syncer_kills:
            self.at(at, lambda down=down, during=during: self.syncer.kill(down, during))
        for at, lid, dur in s.cuts:
            self.at(at, lambda lid=lid, dur=dur: self.cut(lid, dur))
        for at, node, dur in s.pauses:
            self.at(at, lambda node=node, dur=dur: (self.syncer if node < 0 else self.learners[node]).pause(dur))
        for at, down in s.stops:
            self.at(at, lambda down=down: self.stop_fleet(down))
        for at, lid in s.give_ups:
            self.at(at, lambda lid=lid: self.syncer.give_up(lid))
        if s.poison is not None:
            at, lid = s.poison
            self.at(at, lambda: setattr(self.learners[lid], "poison_next_step", True))

    def processes(self) -> list["SimLearner"]:
        return self.learners + self.zombies

    def node_for(self, peer: str) -> Optional["SimLearner"]:
        """The learner process (current, or a zombie) holding the session a peer id names, if any is alive."""
        for lrn in self.processes():
            if lrn.alive and lrn.core is not None and lrn.peer == peer:
                return lrn
        return None

    def zombify(self, lid: int, down: float, frozen: float) -> None:
        """A learner "killed" that was only frozen (a VM paused, not gone): its replacement starts after `down`,
        and the old process wakes up after `frozen`, still holding its old session."""
        old = self.learners[lid]
        if old.ended or not old.alive:
            return
        self.log(f"learner {lid}: replaced (back in {down:.1f}s) while the old process sleeps {frozen:.1f}s")
        old.pause(frozen)
        new = SimLearner(self, lid)
        self.learners[lid] = new
        self.zombies.append(old)
        self.at(self.now + down, new.boot)

    def unpark(self) -> None:
        """The syncer is back: what learners queued for it (on connections they kept) goes through, first."""
        parked, self.parked = self.parked, []
        for node, channel, epoch, deliver in parked:
            if self.link_epoch(node, channel) == epoch:
                self.transmit(node, channel, True, [], deliver)

    def stop_fleet(self, down: float) -> None:
        """SIGTERM the syncer (it finishes every learner), then relaunch the syncer and the learners."""
        if not self.syncer.up or self.syncer.exited:
            return
        self.log("fleet: SIGTERM the syncer")
        self.syncer.execute(self.syncer.core.stop(self.now, "SIGTERM", 143))
        self.relaunches += 1
        self.stopped = True
        self.at(self.now + down, self.relaunch)

    def relaunch(self) -> None:
        self.log("fleet: relaunch")
        self.relaunches -= 1
        if self.syncer.up and not self.syncer.exited:
            self.syncer._die()
        self.syncer.exited, self.syncer.exited_at = False, math.inf
        self.syncer.boot()
        for lrn in self.learners:
            if lrn.ended and not lrn.dead_for_good and not lrn.alive:
                lrn.ended = False
                self.at(self.now + self.rng.uniform(0.0, 2.0), lrn.boot)

    def cut(self, lid: int, dur: float) -> None:
        self.log(f"net: learner {lid}'s link cut for {dur:.1f}s")
        self.cut_until[lid] = max(self.cut_until.get(lid, 0.0), self.now + dur)
        for node in self.processes():
            if node.lid == lid:
                for ch in ("control", "bulk"):
                    self.break_link(node, ch)

    def finished(self) -> bool:
        return self.syncer.exited and all(lrn.ended for lrn in self.processes()) and not self.relaunches

    def run(self) -> None:
        self.setup()
        deadline = self.healed_at + HEAL_BUDGET_S
        while self.queue and not self.finished():
            t, _, fn = heapq.heappop(self.queue)
            if t > deadline:
                break
            self.now = max(self.now, t)
            fn()
        if not self.finished():
            raise Violation(f"liveness: the run did not finish by t={deadline:.0f}s: {self.status()}")
        self.check_end()

    def status(self) -> str:
        c = self.syncer.core
        r = c.round if c else None
        return json.dumps({
            "syncer": {"up": self.syncer.up, "exited": self.syncer.exited, "version": c.version if c else None,
                       "round": r.number if r else None, "pending": sorted(c.pending) if c else None,
                       "live": sorted(m.learner for m in c._live()) if c else None},
            "learners": [lrn.status() for lrn in self.processes()]})

    # checks ---------------------------------------------------------------------------------

    def note_durable(self, ck: Checkpoint) -> None:
        had = self.globals.get(ck.version)
        if had is not None and had[0] != ck.digest:
            raise Violation(f"durable version {ck.version} redefined: {had[0]} then {ck.digest}")
        self.globals[ck.version] = (ck.digest, ck.global_.copy())

    def check_held(self, lid: int, version: int, flat: np.ndarray) -> None:
        want = self.globals.get(version)
        if want is None or not np.array_equal(want[1], flat):
            raise Violation(f"learner {lid} holds version {version} ({array_digest(flat)}), which the syncer's disk "
                            f"does not ({want[0] if want else 'no such durable version'})")

    def check_base(self, lid: int, version: int, base: np.ndarray) -> None:
        want = self.globals.get(version)
        if want is None or not np.array_equal(want[1], base):
            raise Violation(f"learner {lid} pushed a delta against version {version} but trained from another "
                            f"adapter ({array_digest(base)} vs {want[0] if want else 'unknown'})")

    def check_end(self) -> None:
        tape = self.syncer.disk.tape
        # (the audit's bound checks are the influence invariant: no learner's claim bought more than the round's low
        # median weight, no merged delta was above k x the clip's reference)
        report = audit(tape)
        if not report.ok:
            raise Violation(f"audit: {report.violation}")
        core = self.syncer.core
        final = core.run
        if self.syncer.exit_code != 0 or final is None or final.version < core.cfg.outer_steps:
            raise Violation(f"the syncer ended with code {self.syncer.exit_code} at version "
                            f"{final.version if final else None} of {core.cfg.outer_steps}")
        for lrn in self.processes():
            for done, holds, at, booted in lrn.results:
                if done.complete and not (holds[0] == final.version and np.array_equal(holds[1], final.global_)):
                    raise Violation(f"learner {lrn.lid} finished holding version {holds[0]}, not the final "
                                    f"version {final.version} bit for bit")
                # excused: it (re)started after the run was over, or the run ended while faults still cut it off
                # (a finished syncer waits for silent learners, but not forever)
                # or a zombie (its replacement holds the id; it may be told so, or give up)
                # or one kept out because a newer process holds its learner id
                excused = (booted > self.syncer.exited_at or self.syncer.exited_at < self.healed_at
                           or lrn in self.zombies or done.code == Code.BUSY)
                if done.error and not excused:
                    raise Violation(f"learner {lrn.lid} ended in error at t={at:.1f}s: {done.reason}")
                if not done.complete and not done.error and at > self.healed_at and lrn not in self.zombies:
                    raise Violation(f"learner {lrn.lid} ended at t={at:.1f}s, with the network healthy since "
                                    f"t={self.healed_at:.1f}s, without the final adapter: {done.reason}")
        fold = TapeFold()
        for e in tape:
            fold.feed(e)
        bases = {(e["round"], e["learner"], e["digest"]): e["base_version"] for e in tape if e["event"] == "delta"}
        settled = {(lid, bases.get((rnd, lid, d)), d) for rnd, lid, d in fold.settled}
        lost = sorted(a for a in self.acked if a not in settled)
        if lost:
            raise Violation(f"acked deltas (learner, base version, digest) never merged nor refused: {lost}")
        replayed = self.replay(tape)
        if not np.array_equal(replayed, final.global_):
            raise Violation("replaying the tape's merges does not give the final global adapter")

    def replay(self, tape: list[dict[str, Any]]) -> np.ndarray:
        fold = TapeFold()
        for e in tape:
            fold.feed(e)
        cfg = self.s.syncer_config()
        deltas_on_tape = {e["digest"]: e for e in tape if e["event"] == "delta"}
        g = self.init_payloads[fold.digests[0]].copy()
        m = np.zeros_like(g)
        ef = ErrorFeedback(self.layout.numel)
        for v in sorted(fold.merged):
            e = fold.merged[v]
            deltas = {lid: decode_fragments(self.layout, Message("delta", {"fragments": self.payloads[d][0]},
                                                                 self.payloads[d][1]))
                      for lid, d in zip(e["responders"], e["deltas"])}
            lags = e.get("lags") or [0] * len(e["responders"])
            normalize = bool(e.get("step_normalize"))
            mine = [deltas_on_tape[d] for d in e["deltas"]]
            terms = merge_terms([DeltaCounts(d["loss_tokens"], d["tokens"], d["inner_steps"]) for d in mine],
                                cfg.merge_weight, lags, cfg.staleness_exponent, normalize,
                                [d["round_steps"] for d in mine])
            weight = dict(zip(e["responders"], terms.counted))
            scale = dict(zip(e["responders"], terms.scales))
            s = RoundSum.for_rule(self.layout, e["merge"])
            for lid in e["summed"]:
                s.add(lid, deltas[lid], weight[lid], scale[lid])
            clip = {int(k): c for k, c in e["clip"].items()}
            weights = {lid: effective_weight(weight[lid], scale[lid]) for lid in weight}
            avg, fallbacks = clipped_merge(s, clip, weights, deltas.__getitem__)
            avg = avg * np.float32(terms.length)
            if fallbacks != e.get("rda_fallbacks"):
                raise Violation(f"replay of merge {v}: {fallbacks} RDA fallbacks, the tape says "
                                f"{e.get('rda_fallbacks')}")
            new, m = nesterov_step(g, avg, m, cfg.outer_lr, cfg.outer_momentum)
            _, _, sent = encode_fragments_ef(self.layout, new - g, cfg.sync_bits, ef)
            g = g + sent
            if array_digest(g) != e["digest"]:
                raise Violation(f"replay of merge {v} gives {array_digest(g)}, the tape says {e['digest']}")
        return g


# ---------------------------------------------------------------------------------------------- the syncer


class SimDisk:
    """Only what was fsynced survives a kill: the tape up to its last sync, saved files."""

    def __init__(self):
        self.tape: list[dict[str, Any]] = []  # durable lines
        self.buffer: list[dict[str, Any]] = []  # written, not yet fsynced
        self.checkpoint: Optional[Checkpoint] = None
        self.deltas: dict[tuple[int, int], Any] = {}
        self.torn = False
        self.given_up: dict[int, str] = {}  # the controller's given-up/ folder (survives restarts)

    def append(self, event: str, fields: dict[str, Any], now: float) -> None:
        rec = {"seq": len(self.tape) + len(self.buffer), "time": round(now, 4), "event": event, **fields}
        self.buffer.append(json.loads(json.dumps(rec)))  # what reading the JSON line back gives

    def sync(self) -> None:
        self.tape.extend(self.buffer)
        self.buffer = []

    def crash(self, rng: random.Random) -> None:
        self.torn = bool(self.buffer) and rng.random() < 0.5  # a half-written line, cut off at restart
        self.buffer = []


class SimSyncer:
    def __init__(self, world: World):
        self.w = world
        self.disk = SimDisk()
        self.core: Optional[SyncerCore] = None
        self.up = False
        self.exited = False
        self.exited_at = math.inf
        self.exit_code: Optional[int] = None
        self.outer_steps = 0  # restarts may raise --outer-steps, never lower it
        self.last_merge: Optional[dict[str, Any]] = None
        self.life = 0
        self.paused_until = 0.0
        self.cut_short: Optional[type] = None  # a kill waits for the next event with this durable action

    def boot(self) -> None:
        w = self.w
        if self.exited:
            return
        if self.up:  # a second restart scheduled while up: it is a crash and a restart
            self._die()
        self.life += 1
        self.up = True
        cfg = w.s.syncer_config()
        ck = self.disk.checkpoint
        if ck is not None and ck.version < cfg.outer_steps and w.rng.random() < 0.3:  # restarted with other flags
            cfg.quorum = w.rng.randint(1, cfg.quorum)
            cfg.outer_steps = self.outer_steps = max(self.outer_steps, cfg.outer_steps + w.rng.randint(0, 1))
        cfg.outer_steps = max(cfg.outer_steps, self.outer_steps)
        self.core = SyncerCore(cfg, incarnation=f"{w.rng.getrandbits(32):08x}")
        notes = [Record("tape_repair", {"dropped_bytes": 17})] if self.disk.torn else []
        self.disk.torn = False
        durable = Durable(copy.deepcopy(self.disk.checkpoint), [copy.copy(d) for d in self.disk.deltas.values()],
                          list(self.disk.tape), notes)
        w.log(f"syncer: boot (life {self.life}), checkpoint version "
              f"{durable.checkpoint.version if durable.checkpoint else None}")
        self.execute(self.core.start(w.now, durable))
        if self.disk.given_up:  # the shell rescans the folder at start
            self.execute(self.core.give_up(self.disk.given_up, w.now))
        self.schedule_tick(self.life)
        w.unpark()

    def give_up(self, lid: int) -> None:
        """The fleet controller writes given-up/<lid>; a running syncer picks it up at its next rescan."""
        self.disk.given_up[lid] = "not back within --recover-timeout"
        life = self.life
        self.w.at(self.w.now + self.w.rng.uniform(0.0, 2.0),
                  lambda: self.guarded(life, lambda: self.execute(self.core.give_up(self.disk.given_up, self.w.now))))

    def schedule_tick(self, life: int) -> None:
        self.w.at(self.w.now + TICK_S, lambda: self.guarded(life, lambda: self.execute(self.core.tick(self.w.now)),
                                                            then=lambda: self.schedule_tick(life)))

    def guarded(self, life: int, fn: Callable[[], None], then: Optional[Callable[[], None]] = None) -> None:
        """Run fn unless this life is over; a frozen syncer runs it when it wakes up."""
        if life != self.life or not self.up or self.exited:
            return
        if self.w.now < self.paused_until:
            self.w.at(self.paused_until, lambda: self.guarded(life, fn, then))
            return
        fn()
        if then is not None and life == self.life and self.up and not self.exited:
            then()

    def receive(self, peer: str, parts: list[bytes]) -> None:
        w = self.w
        msg_type = json.loads(parts[0])["type"]
        if msg_type in ("delta", "init"):
            msg = decode(parts)
            if msg_type == "delta":
                w.payloads[digest_bytes(msg.frames)] = (msg.header["fragments"], msg.frames)
            else:
                flat = decode_fragments(w.layout, msg)
                w.init_payloads[array_digest(flat)] = flat
        w.log(f"syncer <- {peer}: {msg_type}")
        self.execute(self.core.receive(peer, parts, w.now))

    def execute(self, actions: list) -> None:
        w = self.w
        target = [i for i, a in enumerate(actions) if isinstance(a, self.cut_short or ())]
        if target:  # die around a durable write of the kind aimed at: the interesting places
            self.cut_short = None
            keep = min(len(actions), target[0] + w.rng.choice([-1, 0, 0, 1]))
            self._run(actions[:max(0, keep)])
            inside = keep < len(actions) and isinstance(actions[keep], (SaveCheckpoint, SaveDelta, DropDeltas))
            if inside and w.rng.random() < 0.5:
                self.disk.sync()  # killed inside the durable write: after its tape fsync, before its file landed
            w.log(f"syncer: killed after {keep} of {len(actions)} actions{' (inside the next)' if inside else ''}")
            if not self.exited:
                self._die()
            return
        self._run(actions)

    def _run(self, actions: list) -> None:
        w = self.w
        for a in actions:
            if isinstance(a, Send):
                w.log(f"syncer -> {a.peer}: {a.type} {_brief(a.header)}")
                node = w.node_for(a.peer)
                if node is not None:  # (to a process that is gone: ZeroMQ has no pipe for it)
                    w.post(node, False, a.type, a.header, a.frames,
                           lambda parts, node=node, peer=a.peer: node.deliver(peer, parts))
            elif isinstance(a, Record):
                self.disk.append(a.event, a.fields, w.now)
                if a.event == "merge":
                    self.last_merge = a.fields
                if a.event in ("merge", "rollback", "discard", "resume", "refuse_delta", "finish"):
                    w.log(f"tape: {a.event} {_brief(a.fields)}")
            elif isinstance(a, SaveCheckpoint):
                self.disk.sync()
                self.disk.checkpoint = copy.deepcopy(a.checkpoint)
                w.note_durable(a.checkpoint)
                m = self.last_merge
                if m is not None and m["version"] == a.checkpoint.version:
                    w.merged.update((lid, m["round"] - 1 - lag, d) for lid, d, lag in zip(
                        m["responders"], m["deltas"], m["lags"]))
            elif isinstance(a, SaveDelta):
                self.disk.sync()
                d = copy.copy(a.delta)
                self.disk.deltas[(d.round, d.learner)] = d
            elif isinstance(a, DropDeltas):
                self.disk.sync()
                for key in list(self.disk.deltas):
                    if key[0] <= a.through_round or key == (a.round, a.learner):
                        del self.disk.deltas[key]
            elif isinstance(a, Exit):
                self.disk.sync()
                self.exited = True
                self.exited_at = w.now
                self.exit_code = a.code
                w.log(f"syncer: exit {a.code}")
                return
            elif isinstance(a, Log):
                w.log(f"syncer {a.level}: {a.text}")

    def kill(self, down: float, during: bool) -> None:
        if not self.up or self.exited:
            return
        if during:  # dies in the middle of the next event that saves a checkpoint (a merge) or a delta
            self.cut_short = self.w.rng.choice([SaveCheckpoint, SaveDelta])
            self.w.at(self.w.now + DIE_DURING_WITHIN_S, lambda life=self.life: self._die_late(life, down))
            return
        self._die()
        self.w.at(self.w.now + down, self.boot)

    def _die_late(self, life: int, down: float) -> None:
        if self.life == life and self.up:  # nothing happened for it to die during: die now
            self._die()
        if not self.exited:
            self.w.at(self.w.now + down, self.boot)

    def _die(self) -> None:
        w = self.w
        w.log("syncer: KILLED")
        self.up = False
        self.cut_short = None
        self.life += 1
        self.disk.crash(w.rng)
        for node in w.processes():
            for ch in ("control", "bulk"):
                w.break_link(node, ch)

    def pause(self, dur: float) -> None:
        self.w.log(f"syncer: frozen for {dur:.1f}s")
        self.paused_until = max(self.paused_until, self.w.now + dur)


# ---------------------------------------------------------------------------------------------- a learner


class SimIsland:
    """A fake island: each step adds a known pseudo-random vector to the adapter."""

    def __init__(self, lid: int, numel: int, seed: int, hostile: Optional[Hostile] = None):
        self.lid, self.seed = lid, seed
        self.flat = np.random.default_rng([seed, lid, 99]).standard_normal(numel).astype(np.float32) * 0.1
        self.steps = 0
        self.outlier, self.claims = (hostile.outlier, hostile.claims) if hostile is not None else (1.0, 1)

    def step(self) -> dict[str, Any]:
        self.steps += 1
        rng = np.random.default_rng([self.seed, self.lid, self.steps])
        self.flat = self.flat + (rng.standard_normal(self.flat.size) * 0.01 * self.outlier).astype(np.float32)
        return {"tokens": (40 + 2 * self.lid) * self.claims, "loss_tokens": (20 + self.lid) * self.claims,
                "loss": 1.0 / self.steps}


class SimLearner:
    def __init__(self, world: World, lid: int):
        self.w = world
        self.lid = lid
        world.net_ids += 1
        self.net_id = world.net_ids
        self.core: Optional[LearnerCore] = None
        self.island: Optional[SimIsland] = None
        self.alive = False
        self.ended = False  # exited (or killed for good)
        self.life = 0
        self.paused_until = 0.0
        self.stepping = False
        self.booted_at = 0.0
        self.dead_for_good = False
        self.poison_next_step = False
        self.pushes: list[tuple[tuple[int, int, str], np.ndarray]] = []  # this session's sent deltas (oracle)
        self.raw: dict[tuple[int, int], np.ndarray] = {}  # (round, base version) -> the delta it finished with
        self.train_started = 0.0
        self.steps = 0
        self.stats: dict[str, float] = {}
        self.results: list[tuple[Done, tuple[int, np.ndarray]]] = []

    @property
    def peer(self) -> str:
        return f"learner-{self.lid}-{self.core.session}"

    def status(self) -> dict[str, Any]:
        c = self.core
        return {"lid": self.lid, "alive": self.alive, "ended": self.ended,
                "version": c.version if c else None, "joined": c.joined if c else None,
                "training": c.training.round if c and c.training else None,
                "pushed": c._pushed_ref() if c else None, "finish": bool(c and c.finish)}

    def boot(self) -> None:
        w = self.w
        if self.ended:
            return
        self.life += 1
        self.alive = True
        self.booted_at = w.now
        self.stepping = False
        hostile = w.s.hostile if w.s.hostile is not None and w.s.hostile.learner == self.lid else None
        self.island = SimIsland(self.lid, w.layout.numel, w.s.seed, hostile)
        self.core = LearnerCore(self.lid, "sim", w.layout, self.island.flat.copy(), ADAPTER_CONFIG, {"sim": w.s.seed},
                                random.Random(w.rng.getrandbits(64)), LINK, w.s.max_inner_steps[self.lid],
                                started_at_us=int(w.now * 1e6), identity=f"sim-identity-{w.s.seed}-{self.lid}")
        self.pushes = []
        self.raw = {}
        self.carry_base: Optional[np.ndarray] = None  # a carried round's base: its work goes on top of the next global
        self.carry_round = 0  # ... and that round (a refusal of our late delta may send the work back to it)
        self.carried_steps = 0
        w.log(f"learner {self.lid}: boot (life {self.life}, session {self.core.session})")
        self.execute(self.core.connected_now(w.now))
        self.schedule_tick(self.life)

    def guarded(self, life: int, fn: Callable[[], None]) -> None:
        if life != self.life or not self.alive:
            return
        if self.w.now < self.paused_until:
            self.w.at(self.paused_until, lambda: self.guarded(life, fn))
            return
        fn()

    def schedule_tick(self, life: int) -> None:
        def tick() -> None:
            self.execute(self.core.tick(self.w.now))
            self.wake()
            if self.alive and life == self.life:
                self.schedule_tick(life)

        self.w.at(self.w.now + TICK_S, lambda: self.guarded(life, tick))

    def deliver(self, peer: str, parts: list[bytes]) -> None:
        life = self.life

        def handle() -> None:
            msg = decode(parts)
            self.w.log(f"learner {self.lid} <- {msg.type} {_brief(msg.header)}")
            before = self.core.version
            self.execute(self.core.receive(msg, self.w.now))
            if msg.type == "ack":
                self.w.acked.add((self.lid, msg.header["base_version"], msg.header["digest"]))
            if self.core.version != before and self.core.version >= 0 and msg.type != "init_request":
                self.w.check_held(self.lid, self.core.version, self.core.global_)
            self.wake()

        if self.alive and peer == self.peer:
            self.guarded(life, handle)

    def on_link_lost(self) -> None:
        if self.alive:
            self.guarded(self.life, lambda: self.execute(self.core.link_lost(self.w.now)))

    def execute(self, actions: list) -> None:
        w = self.w
        for a in actions:
            if isinstance(a, Out):
                w.log(f"learner {self.lid} -> {a.type} {_brief(a.header)}")
                if a.type == "delta":
                    self.check_sent(a)
                w.post(self, True, a.type, a.header, a.frames, lambda parts, peer=self.peer: (
                    w.syncer.guarded(w.syncer.life, lambda: w.syncer.receive(peer, parts))))
            elif isinstance(a, Reconnect):
                for ch in ("control", "bulk"):
                    w.break_link(self, ch, notify=False)
                life = self.life
                w.at(w.now + a.delay_s, lambda: self.guarded(life, lambda: self.execute(
                    self.core.connected_now(self.w.now))))
            elif isinstance(a, Log):
                w.log(f"learner {self.lid} {a.level}: {a.text}")

    # the training loop ----------------------------------------------------------------------

    def wake(self) -> None:
        if not self.alive or self.stepping:
            return
        task = self.core.next_task(self.w.now)
        if isinstance(task, Wait):
            return
        if isinstance(task, Done):
            self.results.append((task, (self.core.version, None if self.core.global_ is None else
                                        self.core.global_.copy()), self.w.now, self.booted_at))
            self.w.log(f"learner {self.lid}: done ({task.reason}; complete={task.complete}, error={task.error})")
            self.execute(self.core.leave("done"))
            self.alive = False
            self.ended = True
            current = self.w.learners[self.lid] is self  # a zombie's slot belongs to its replacement
            if self.w.stopped and current and not task.complete and not task.error:  # told to stop: relaunched
                self.ended = False
                self.w.at(self.w.now + self.w.rng.uniform(1.0, 5.0), self.boot)
            return
        assert isinstance(task, Train)
        self.train_started = self.w.now
        if self.carry_base is not None:  # (the sim's learner does not step while it waits; the real loop does)
            self.island.flat = task.adapter + (self.island.flat - self.carry_base)
            if task.round != self.carry_round:
                self.carried_steps = self.steps
            else:
                self.w.carries_back += 1
            self.carry_base = None
        else:
            self.island.flat = task.adapter.copy()
            self.steps = self.carried_steps = 0
            self.stats = {"tokens": 0, "loss_tokens": 0, "loss": 0.0}
        self.w.log(f"learner {self.lid}: train round {task.round} from version {task.base_version}")
        self.start_step()

    def start_step(self) -> None:
        w = self.w
        self.stepping = True
        dt = w.s.step_s[self.lid]
        if w.rng.random() < w.s.p_slow_step:
            dt += w.rng.uniform(5.0, 15.0)  # longer than the syncer's --learner-timeout
        life = self.life
        w.at(w.now + dt, lambda: self.guarded(life, self.step_done))

    def step_done(self) -> None:
        w = self.w
        s = self.island.step()
        if self.poison_next_step:
            self.poison_next_step = False
            self.island.flat = self.island.flat + np.float32(POISON)
            s = {k: v * POISON_WEIGHT if k != "loss" else v for k, v in s.items()}  # and it claims most of the weight
            w.log(f"learner {self.lid}: a poisoned step (+{POISON:g})")
        self.steps += 1
        for k in ("tokens", "loss_tokens"):
            self.stats[k] += s[k]
        self.stats["loss"] = s["loss"]
        t = self.core.training
        verdict = self.core.after_step(self.steps, w.now, self.steps - self.carried_steps)
        if verdict is Verdict.CONTINUE:
            self.start_step()
            return
        self.stepping = False
        if verdict is Verdict.CARRY:
            assert t is not None
            self.carry_base, self.carry_round = t.base.copy(), t.round
            w.carries += 1
            w.log(f"learner {self.lid}: carrying round {t.round}'s {self.steps} steps onto the next global")
        if verdict is Verdict.PUSH:
            t = self.core.training
            bits = int(self.core.policy["sync_bits"])
            w.check_base(self.lid, t.base_version, t.base)
            x = self.island.flat - t.base
            self.raw[(t.round, t.base_version)] = x
            residual = self.core.ef.residual
            actions = self.core.push(self.island.flat.copy(), RoundCounts(
                int(self.stats["tokens"]), int(self.stats["loss_tokens"]), self.steps, self.stats["loss"],
                w.now - self.train_started, self.carried_steps))
            sent = any(isinstance(a, Out) and a.type == "delta" for a in actions)
            if not sent and self.core.held is None:  # neither sent nor held: only a delta that cannot be encoded
                expect = ErrorFeedback(w.layout.numel)
                expect.residual = residual
                try:
                    encode_fragments_ef(w.layout, x, bits, expect)
                    raise Violation(f"learner {self.lid} dropped its delta for round {t.round}, which can be sent")
                except QuantError:
                    pass
            self.execute(actions)
        elif verdict is Verdict.ABANDON:
            w.log(f"learner {self.lid}: abandoned the round after {self.steps} steps")
        self.wake()

    def check_sent(self, a: Out) -> None:
        """A delta leaving for the first time (at once, or held until the previous one settled): it is its adapter
        minus the version it trained from, quantized with exactly the quantization error of this session's merged
        deltas (an oracle that knows, from the syncer's disk, which of them were merged)."""
        h, p, digest = a.header, self.core.pushed, digest_bytes(a.frames)
        if any(key == (self.lid, h["base_version"], digest) for key, _ in self.pushes):
            return  # sent again
        if p is None or p.digest != digest:
            raise Violation(f"learner {self.lid} sent a delta for round {h['round']} that it does not hold as pushed")
        x = self.raw.pop((h["round"], h["base_version"]), None)
        if x is None:
            raise Violation(f"learner {self.lid} sent a delta for round {h['round']} on version {h['base_version']} "
                            "that it never trained")
        r = np.zeros(self.w.layout.numel, np.float32)
        pieces = [(f.start, f.numel) for f in self.w.layout.fragments]
        for key, y in self.pushes:
            if key in self.w.merged:
                ef = ErrorFeedback(self.w.layout.numel)
                ef.residual = r
                ef.encode(y, int(self.core.policy["sync_bits"]), pieces)
                r = ef.residual
        if not np.array_equal(r, p.residual_before):
            raise Violation(f"learner {self.lid}'s error-feedback residual does not follow what was merged "
                            f"(off by {float(np.abs(r - p.residual_before).max()):.3g})")
        expect = ErrorFeedback(self.w.layout.numel)
        expect.residual = p.residual_before
        _, frames, _ = encode_fragments_ef(self.w.layout, x, int(self.core.policy["sync_bits"]), expect)
        if list(frames) != list(a.frames):
            raise Violation(f"learner {self.lid}'s delta for round {h['round']} is not its adapter minus the "
                            f"version {h['base_version']} it trained from")
        self.pushes.append(((self.lid, p.base_version, p.digest), x))

    # faults ---------------------------------------------------------------------------------

    def kill(self, down: Optional[float]) -> None:
        if self.ended or not self.alive:  # nothing running to kill (it is down, or not started yet)
            return
        self.w.log(f"learner {self.lid}: KILLED ({'for good' if down is None else f'back in {down:.1f}s'})")
        self.alive = False
        self.life += 1
        for ch in ("control", "bulk"):
            self.w.break_link(self, ch, notify=False)
        if down is None:
            self.ended = self.dead_for_good = True
        else:
            self.w.at(self.w.now + down, self.boot)

    def pause(self, dur: float) -> None:
        self.w.log(f"learner {self.lid}: frozen for {dur:.1f}s")
        self.paused_until = max(self.paused_until, self.w.now + dur)


def _brief(header: dict[str, Any]) -> str:
    keep = ("round", "version", "base_version", "code", "learner", "responders", "complete", "reason", "have_delta",
            "contributed", "digest")
    return json.dumps({k: header[k] for k in keep if k in header})


# ---------------------------------------------------------------------------------------------- running


@dataclass
class Outcome:
    seed: int
    ok: bool
    error: str = ""
    sim_s: float = 0.0
    merges: int = 0
    restarts: int = 0
    exercised: frozenset[str] = frozenset()  # the fault paths this schedule took (see EXERCISED)


# tape events that mark a recovery path, counted per schedule so a sweep shows what it really exercised
EXERCISED = ("resume", "rollback", "discard", "recovered", "refuse_delta", "supersede", "tape_repair", "quorum_wait",
             "stop", "reject", "given_up", "stale")


def run_seed(seed: int, trace: Optional[Callable[[str], None]] = None) -> Outcome:
    w = World(Schedule.draw(seed), trace)
    try:
        w.run()
    except Violation as e:
        return Outcome(seed, False, str(e), w.now)
    except Exception as e:  # a crash in a core is a finding too
        import traceback

        return Outcome(seed, False, f"crash: {e!r}\n{traceback.format_exc()}", w.now)
    tape = w.syncer.disk.tape
    paths = {e["event"] for e in tape if e["event"] in EXERCISED}
    paths |= {"recovered" for e in tape if e["event"] == "delta" and e.get("recovered")}
    paths |= {"stale" for e in tape if e["event"] == "delta" and e.get("lag")}
    paths |= {"zombie"} if w.zombies else set()
    paths |= {"carry"} if w.carries else set()
    paths |= {"carry_back"} if w.carries_back else set()
    return Outcome(seed, True, "", w.now, sum(1 for e in tape if e["event"] == "merge"),
                   sum(1 for e in tape if e["event"] == "resume"), frozenset(paths))


def _run_range(args: tuple[int, int]) -> list[Outcome]:
    return [run_seed(s) for s in range(*args)]


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(description="Deterministic simulation of yeto's coordination under faults.")
    p.add_argument("--seeds", type=int, default=200, help="how many schedules to run")
    p.add_argument("--first", type=int, default=0, help="the first seed")
    p.add_argument("--seed", type=int, help="run this one seed")
    p.add_argument("--trace", action="store_true", help="with --seed: print every event")
    p.add_argument("--workers", type=int, default=1, help="processes to spread the seeds over")
    a = p.parse_args(argv)
    if a.seed is not None:
        out = run_seed(a.seed, print if a.trace else None)
        print(json.dumps(Schedule.draw(a.seed).__dict__, default=str))
        print("ok" if out.ok else f"VIOLATION seed {out.seed}: {out.error}")
        return 0 if out.ok else 1
    t0 = time.perf_counter()
    end = a.first + a.seeds
    ranges = [(s, min(s + PROGRESS_CHUNK, end)) for s in range(a.first, end, PROGRESS_CHUNK)]
    outcomes: list[Outcome] = []
    if a.workers > 1:
        from multiprocessing import Pool

        with Pool(a.workers) as pool:
            for res in pool.imap_unordered(_run_range, ranges):
                outcomes.extend(res)
                _progress(outcomes, a.seeds, t0)
    else:
        for r in ranges:
            outcomes.extend(_run_range(r))
            _progress(outcomes, a.seeds, t0)
    bad = sorted((o for o in outcomes if not o.ok), key=lambda o: o.seed)
    merges = sum(o.merges for o in outcomes)
    restarts = sum(o.restarts for o in outcomes)
    print(f"\n{len(outcomes)} schedules (seeds {a.first}..{a.first + a.seeds - 1}) in {time.perf_counter() - t0:.0f}s: "
          f"{len(bad)} violation(s); {merges} merges, {restarts} syncer restarts simulated")
    took = Counter(p for o in outcomes for p in o.exercised)
    paths = (*EXERCISED, "zombie", "carry", "carry_back")
    print("schedules that took each recovery path: " + ", ".join(f"{p} {took[p]}" for p in paths))
    for o in bad[:20]:
        print(f"seed {o.seed}: {o.error.splitlines()[0] if o.error else ''}")
    if bad:
        print(f"reproduce: python -m yeto.sync.sim --seed {bad[0].seed} --trace")
    return 1 if bad else 0


def _progress(outcomes: list[Outcome], total: int, t0: float) -> None:
    done, bad = len(outcomes), sum(not o.ok for o in outcomes)
    line = f"sim: {done}/{total} schedules, {bad} violation(s), {time.perf_counter() - t0:.0f}s"
    if sys.stderr.isatty():
        sys.stderr.write("\r" + line)
    elif done == total or done % max(1, total // 20) < PROGRESS_CHUNK:  # a line per ~5% in logs
        sys.stderr.write(line + "\n")
    sys.stderr.flush()


if __name__ == "__main__":
    sys.exit(main())
