"""The simulated world: one clock and event queue, the network between the syncer and each island process (two
connections each, FIFO, lossy, duplicating, cut and parked while the syncer is down), the syncer's disk (only what
was fsynced survives a kill), and the faults of a schedule set on the clock."""

from __future__ import annotations

import heapq
import json
import math
import random
from typing import Any, Callable, Optional

import numpy as np

from yeto.sync.core.actions import Checkpoint
from yeto.sync.wire.layout import build_layout
from yeto.sync.wire.protocol import encode, is_bulk
from yeto.sync.sim.nodes import SimIsland, SimSyncer
from yeto.sync.sim.oracle import Oracle, Violation
from yeto.sync.sim.faults import (ADAPTER_SHAPES, DIE_DURING_WITHIN_S, FRAGMENT_NUMEL, HEAL_BUDGET_S, LINK,
                                    ZOMBIE_SLEEPS_LONGER_S, Schedule)


class World:
    def __init__(self, sched: Schedule, trace: Optional[Callable[[str], None]] = None):
        self.s = sched
        self.rng = random.Random(sched.seed * 7919 + 1)
        self.now = 0.0
        self.queue: list[tuple[float, int, Callable[[], None]]] = []
        self.seq = 0
        self.trace = trace
        self.layout = build_layout({k: np.zeros(v, np.float32) for k, v in ADAPTER_SHAPES.items()}, FRAGMENT_NUMEL)
        self.epoch: dict[tuple[int, str], int] = {}  # (island process, channel) -> connection epoch
        self.last_delivery: dict[tuple[int, str, str], float] = {}  # FIFO per connection and direction
        self.net_ids = 0
        self.cut_until: dict[int, float] = {}
        self.oracle = Oracle(self)
        self.parked: list[tuple] = []  # (process, channel, epoch, deliver) sent while the syncer was down
        self.relaunches = 0  # fleet relaunches scheduled
        self.stopped = False  # a fleet stop happened: islands told to stop are relaunched
        self.stop_windows: list[tuple[float, float]] = []  # (SIGTERM, relaunch) of each fleet stop
        self.disk = SimDisk()  # the syncer's
        self.syncer = SimSyncer(self)
        self.islands = [SimIsland(self, i) for i in range(sched.islands + sched.extra_ids)]
        self.zombies: list[SimIsland] = []  # replaced island processes that are still running
        self.carries = 0  # rounds whose work an island carried onto the next global (StepVerdict.CARRY)
        self.carries_back = 0  # ... and carries sent back to their own round (the late delta holding it was refused)
        # when the last fault is over (downtimes, cuts and freezes included), with room to reconnect
        ends = [at + (down or 0.0) + (ZOMBIE_SLEEPS_LONGER_S if zombie else 0.0)
                for at, _, down, zombie in sched.island_kills]
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

    def link_epoch(self, node: SimIsland, channel: str) -> int:
        return self.epoch.get((node.net_id, channel), 0)

    def break_link(self, node: SimIsland, channel: str, notify: bool = True) -> None:
        """The connection of one island process breaks: what is in flight on it is lost."""
        self.epoch[(node.net_id, channel)] = self.link_epoch(node, channel) + 1
        if notify:
            node.on_link_lost(channel)

    def post(self, node: SimIsland, to_syncer: bool, type_: str, header: dict[str, Any], frames: tuple[bytes, ...],
             deliver: Callable[[list[bytes]], None]) -> None:
        """Encode one message as the shells do and carry it on the connection its type travels on."""
        parts = encode(type_, header, frames)
        self.transmit(node, "bulk" if is_bulk(type_) else "control", to_syncer, parts, lambda: deliver(parts))

    def transmit(self, node: SimIsland, channel: str, to_syncer: bool, parts: list[bytes],
                 deliver: Callable[[], None]) -> None:
        """Carry one message between the syncer and an island process: lost with its connection, duplicated,
        delayed (FIFO per connection). To a syncer that is down, ZeroMQ queues it and delivers it to the restarted
        one, unless the island reconnects first."""
        if to_syncer and not self.syncer.up and not self.syncer.exited:
            self.parked.append((node, channel, self.link_epoch(node, channel), deliver))
            return
        if self.now < self.cut_until.get(node.lid, -1.0):
            self.break_link(node, channel)
            return
        if self.rng.random() < self.s.p_drop:
            self.log(f"net: lost a message on island {node.lid}'s {channel} connection")
            self.break_link(node, channel)
            return
        lo, hi = self.s.latency_s
        nbytes = sum(len(p) for p in parts)
        epoch = self.link_epoch(node, channel)
        copies = 2 if self.rng.random() < self.s.p_dup else 1
        slow = self.s.slow_links.get(node.lid) if channel == "bulk" else None
        for _ in range(copies):
            key = (node.net_id, channel, "up" if to_syncer else "down")
            if slow:  # one message at a time through the bottleneck: each waits for the one before it to finish
                t = max(self.now, self.last_delivery.get(key, 0.0)) + nbytes / slow + self.rng.uniform(lo, hi)
            else:
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
        for i, lrn in enumerate(self.islands):
            self.at(self.rng.uniform(0.0, 2.0), lrn.boot)
        for at, lid, down, zombie in s.island_kills:
            if zombie and down is not None:
                self.at(at, lambda lid=lid, down=down: self.zombify(
                    lid, down, down + self.rng.uniform(2.0, ZOMBIE_SLEEPS_LONGER_S)))
            else:
                self.at(at, lambda lid=lid, down=down: self.islands[lid].kill(down))
        for at, down, during in s.syncer_kills:
            self.at(at, lambda down=down, during=during: self.syncer.kill(down, during))
        for at, lid, dur in s.cuts:
            self.at(at, lambda lid=lid, dur=dur: self.cut(lid, dur))
        for at, node, dur in s.pauses:
            self.at(at, lambda node=node, dur=dur: (self.syncer if node < 0 else self.islands[node]).pause(dur))
        for at, down in s.stops:
            self.at(at, lambda down=down: self.stop_fleet(down))
        for at, lid in s.give_ups:
            self.at(at, lambda lid=lid: self.syncer.give_up(lid))
        if s.poison is not None:
            at, lid = s.poison
            self.at(at, lambda: setattr(self.islands[lid], "poison_next_step", True))

    def processes(self) -> list[SimIsland]:
        return self.islands + self.zombies

    def node_for(self, peer: str) -> Optional[SimIsland]:
        """The island process (current, or a zombie) holding the session a peer id names, if any is alive."""
        for lrn in self.processes():
            if lrn.alive and lrn.core is not None and lrn.peer == peer:
                return lrn
        return None

    def zombify(self, lid: int, down: float, frozen: float) -> None:
        """An island "killed" that was only frozen (a VM paused, not gone): its replacement starts after `down`,
        and the old process wakes up after `frozen`, still holding its old session."""
        old = self.islands[lid]
        if old.ended or not old.alive:
            return
        self.log(f"island {lid}: replaced (back in {down:.1f}s) while the old process sleeps {frozen:.1f}s")
        old.pause(frozen)
        new = SimIsland(self, lid)
        self.islands[lid] = new
        self.zombies.append(old)
        self.at(self.now + down, new.boot)

    def unpark(self) -> None:
        """The syncer is back: what islands queued for it (on connections they kept) goes through, first."""
        parked, self.parked = self.parked, []
        for node, channel, epoch, deliver in parked:
            if self.link_epoch(node, channel) == epoch:
                self.transmit(node, channel, True, [], deliver)

    def stop_fleet(self, down: float) -> None:
        """SIGTERM the syncer (it finishes every island), then relaunch the syncer and the islands."""
        if not self.syncer.up or self.syncer.exited:
            return
        self.log("fleet: SIGTERM the syncer")
        self.syncer.execute(self.syncer.core.stop(self.now, "SIGTERM", 143))
        self.relaunches += 1
        self.stopped = True
        self.stop_windows.append((self.now, math.inf))
        self.at(self.now + down, self.relaunch)

    def relaunch(self) -> None:
        self.log("fleet: relaunch")
        self.relaunches -= 1
        self.stop_windows[-1] = (self.stop_windows[-1][0], self.now)
        if self.syncer.up and not self.syncer.exited:
            self.syncer._die()
        self.syncer.exited, self.syncer.exited_at = False, math.inf
        self.syncer.boot()
        for lrn in self.islands:
            if lrn.ended and not lrn.dead_for_good and not lrn.alive:
                lrn.ended = False
                self.at(self.now + self.rng.uniform(0.0, 2.0), lrn.boot)

    def cut(self, lid: int, dur: float) -> None:
        self.log(f"net: island {lid}'s link cut for {dur:.1f}s")
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
        self.oracle.check_end()

    def status(self) -> str:
        c = self.syncer.core
        s = c.state if c else None
        r = s.round if s else None
        return json.dumps({
            "syncer": {"up": self.syncer.up, "exited": self.syncer.exited, "version": c.version if c else None,
                       "round": r.number if r else None, "pending": sorted(s.pending) if s else None,
                       "live": sorted(m.island for m in s.live()) if s else None},
            "islands": [lrn.status() for lrn in self.processes()]})

    # checks ---------------------------------------------------------------------------------


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
