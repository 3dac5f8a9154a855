"""The simulated nodes around the real cores: the syncer (`SyncerCore` over a simulated disk, killed, frozen and
restarted, possibly in the middle of an action list) and the islands (each a `IslandCore` driven by a simulated
training loop over a fake island whose steps add known vectors; one of them may be hostile: it claims more tokens
than it trained and steps further than an honest island)."""

from __future__ import annotations

import copy
import dataclasses
import json
import math
import random
from typing import Any, Callable, Optional, Union

import numpy as np

from yeto.sync.core.actions import (ClearGivenUp, DropDeltas, Durable, Exit, Log, Out, Reconnect, Record,
                                    SaveCheckpoint, SaveDelta, Send)
from yeto.sync.core.island import Done, IslandCore, RoundCounts, Train, StepVerdict, Wait
from yeto.sync.core.island.work import Carry, RoundSteps
from yeto.sync.core.deltas import MAX_INNER_STEPS_PER_DELTA
from yeto.sync.core.delivery import GLOBAL_TYPES, Delivery, Outgoing, Undeliverable
from yeto.sync.core.syncer import SyncerCore
from yeto.sync.wire.protocol import (array_digest, decode, decode_fragments, digest_bytes, encode, encode_fragments_ef,
                                     is_bulk)
from yeto.sync.wire.quant import ErrorFeedback, QuantError
from yeto.sync.sim.oracle import Violation
from yeto.sync.sim.sleep import Sleep
from yeto.sync.sim.faults import (ADAPTER_CONFIG, DIE_DURING_WITHIN_S, LINK, POISON, POISON_WEIGHT, TICK_S,
                                    Hostile)

# (each node holds the World of yeto.sync.sim.world as `w`, typed Any: that module imports this one)


class SimSyncer:
    def __init__(self, world: Any):
        self.w = world
        self.disk = world.disk
        self.core: Optional[SyncerCore] = None
        self.delivery: Optional[Delivery] = None  # the send rules of this life (a restart starts empty)
        self.up = False
        self.exited = False
        self.exited_at = math.inf
        self.exit_code: Optional[int] = None
        self.outer_steps = 0  # restarts may raise --outer-steps, never lower it
        self.last_merge: Optional[dict[str, Any]] = None
        self.life = 0
        self.sleep = Sleep(world)
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
        self.delivery = Delivery(self._hand_over, lambda event, fields: self.disk.append(event, fields, w.now))
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
        self.w.at(self.w.now + TICK_S, lambda: self.guarded(life, lambda: self._tick(), then=lambda: self.schedule_tick(
            life)))

    def _tick(self) -> None:
        self.execute(self.core.tick(self.w.now))
        if self.up and not self.exited:
            self.delivery.retry(self.w.now)

    def guarded(self, life: int, fn: Callable[[], None], then: Optional[Callable[[], None]] = None) -> None:
        """Run fn unless this life is over; a frozen syncer runs it when it wakes up."""
        if life != self.life or not self.up or self.exited:
            return
        if self.sleep.hold(lambda: self.guarded(life, fn, then)):
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
                w.oracle.keep_payload(digest_bytes(msg.frames), msg.header["fragments"], msg.frames)
            else:
                flat = decode_fragments(w.layout, msg)
                w.oracle.init_payloads[array_digest(flat)] = flat
        w.log(f"syncer <- {peer}: {msg_type}")
        self.execute(self.core.receive(peer, parts, w.now, w.s.principal(int(peer.split("-")[1]))))

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
                self._send(a)
            elif isinstance(a, Record):
                self._record(a)
            elif isinstance(a, (SaveCheckpoint, SaveDelta, DropDeltas)):
                self._save(a)
            elif isinstance(a, ClearGivenUp):
                self.disk.given_up.pop(a.island, None)  # (the controller's folder: removed at once, as the shell does)
            elif isinstance(a, Exit):
                self.disk.sync()
                self.exited, self.exited_at, self.exit_code = True, w.now, a.code
                w.log(f"syncer: exit {a.code}")
                return
            elif isinstance(a, Log):
                w.log(f"syncer {a.level}: {a.text}")

    def _send(self, a: Send) -> None:
        """Through the syncer's own send rules (core.delivery): one adapter at a time per island connection."""
        w = self.w
        w.log(f"syncer -> {a.peer}: {a.type} {_brief(a.header)}")
        version = a.header.get("version", -1) if a.type in GLOBAL_TYPES else -1
        self.delivery.send(Outgoing((a.peer, "bulk" if is_bulk(a.type) else "control"),
                                    encode(a.type, a.header, a.frames), w.now, a.type, version))

    def _hand_over(self, p: Outgoing) -> Optional[Callable[[], bool]]:
        """Onto the simulated link; an adapter is released once it arrived or its connection broke."""
        w, (peer, channel) = self.w, p.dest
        node = w.node_for(peer)
        if node is None:  # (a process that is gone: ZeroMQ has no pipe for it)
            raise Undeliverable("not connected")
        arrived, epoch, life = [False], w.link_epoch(node, channel), self.life

        def deliver() -> None:
            arrived[0] = True
            node.deliver(peer, p.parts)
            w.at(w.now, lambda: self.guarded(life, lambda: self.delivery.retry(w.now)))  # (the next one may go)

        w.transmit(node, channel, False, p.parts, deliver)
        return lambda: arrived[0] or w.link_epoch(node, channel) != epoch or not node.alive

    def _record(self, a: Record) -> None:
        self.disk.append(a.event, a.fields, self.w.now)
        if a.event == "merge":
            self.last_merge = a.fields
        if a.event in ("merge", "rollback", "discard", "resume", "refuse_delta", "finish"):
            self.w.log(f"tape: {a.event} {_brief(a.fields)}")

    def _save(self, a: Union[SaveCheckpoint, SaveDelta, DropDeltas]) -> None:
        """A durable write: the tape is fsynced first, then the file lands (and the oracle learns what is durable)."""
        self.disk.sync()
        if isinstance(a, SaveCheckpoint):
            self.disk.checkpoint = copy.deepcopy(a.checkpoint)
            self.w.oracle.note_durable(a.checkpoint)
            m = self.last_merge
            if m is not None and m["version"] == a.checkpoint.version:
                self.w.oracle.merged.update((lid, m["round"] - 1 - lag, d) for lid, d, lag in zip(
                    m["responders"], m["deltas"], m["lags"]))
        elif isinstance(a, SaveDelta):
            d = copy.copy(a.delta)
            self.disk.deltas[(d.round, d.island)] = d
        else:
            for key in list(self.disk.deltas):
                if key[0] <= a.through_round or key == (a.round, a.island):
                    del self.disk.deltas[key]

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
        self.sleep.freeze(dur)


# ---------------------------------------------------------------------------------------------- an island


class SimTrainer:
    """A fake backend (what an island trains with): each step adds a known pseudo-random vector to the adapter
    (`hostile`: how it lies)."""

    def __init__(self, lid: int, numel: int, seed: int, hostile: Optional[Hostile] = None):
        self.lid, self.seed, self.hostile = lid, seed, hostile or Hostile(lid, 1, 1.0)
        self.flat = np.random.default_rng([seed, lid, 99]).standard_normal(numel).astype(np.float32) * 0.1
        self.steps = 0

    def step(self) -> dict[str, Any]:
        self.steps += 1
        rng = np.random.default_rng([self.seed, self.lid, self.steps])
        self.flat = self.flat + (rng.standard_normal(self.flat.size) * 0.01 * self.hostile.outlier).astype(np.float32)
        k = self.hostile.claims
        return {"tokens": (40 + 2 * self.lid) * k, "loss_tokens": (20 + self.lid) * k, "loss": 1.0 / self.steps}

    def claimed(self, a: Out) -> Out:
        """A delta as this island sends it: a hostile one may claim more steps (within what a time-window round
        takes)."""
        k, h = self.hostile.steps, a.header
        steps = min(h["inner_steps"] * k, MAX_INNER_STEPS_PER_DELTA)
        return a if k == 1 else dataclasses.replace(a, header=dict(h, inner_steps=steps, carried_steps=min(
            h.get("carried_steps", 0) * k, steps - 1)))


class SimIsland:
    """An island process of the simulated world: the real island core driving a SimTrainer, over simulated links,
    booted, killed and relaunched as the schedule says."""

    def __init__(self, world: Any, lid: int):
        self.w = world
        self.lid = lid
        world.net_ids += 1
        self.net_id = world.net_ids
        self.core: Optional[IslandCore] = None
        self.trainer: Optional[SimTrainer] = None
        self.alive = False
        self.ended = False  # exited (or killed for good)
        self.life = 0
        self.sleep = Sleep(world)
        self.stepping = False
        self.booted_at = 0.0
        self.dead_for_good = False
        self.poison_next_step = False
        self.pushes: list[tuple[tuple[int, int, str], np.ndarray, tuple[int, ...]]] = []  # sent deltas (oracle)
        self.raw: dict[tuple[int, int], np.ndarray] = {}  # (round, base version) -> the delta it finished with
        self.train_started = 0.0
        self.count = RoundSteps(0)  # the steps held toward the round being trained
        self.stats: dict[str, float] = {}
        self.results: list[tuple[Done, tuple[int, np.ndarray]]] = []

    @property
    def peer(self) -> str:
        return f"island-{self.lid}-{self.core.session}"

    def status(self) -> dict[str, Any]:
        c = self.core
        return {"lid": self.lid, "alive": self.alive, "ended": self.ended,
                "version": c.version if c else None, "joined": c.link.joined if c else None,
                "training": c.training.round if c and c.training else None,
                "pushed": c.deltas.pushed_ref() if c else None, "finish": bool(c and c.finish)}

    def boot(self) -> None:
        w = self.w
        if self.ended:
            return
        self.life += 1
        self.alive = True
        self.booted_at = w.now
        self.stepping = False
        hostile = w.s.hostile if w.s.hostile is not None and w.s.hostile.island == self.lid else None
        if self.lid >= w.s.islands:  # an extra id
            hostile = Hostile(self.lid, 1, w.s.extra_outlier)
        self.trainer = SimTrainer(self.lid, w.layout.numel, w.s.seed, hostile)
        self.core = IslandCore(self.lid, "sim", w.layout, self.trainer.flat.copy(), ADAPTER_CONFIG, {"sim": w.s.seed},
                                random.Random(w.rng.getrandbits(64)), LINK, w.s.max_inner_steps[self.lid],
                                started_at_us=int(w.now * 1e6), identity=f"sim-identity-{w.s.seed}-{self.lid}")
        w.oracle.watch_phases(self.lid, self.core)
        self.pushes = []
        self.sent: set[tuple[int, int, str]] = set()  # (round, base version, digest) of every delta sent (oracle)
        self.raw = {}
        self.carry: Optional[Carry[RoundSteps]] = None  # a carried round's work: it goes on top of the next global
        w.log(f"island {self.lid}: boot (life {self.life}, session {self.core.session})")
        self.execute(self.core.connected_now(w.now))
        self.schedule_tick(self.life)

    def guarded(self, life: int, fn: Callable[[], None]) -> None:
        """Run fn (every event of this island's goes through here) unless this life is over, then check the moves
        of its phase; a frozen island runs it when it wakes up."""
        if life != self.life or not self.alive:
            return
        if self.sleep.hold(lambda: self.guarded(life, fn)):
            return
        fn()
        self.w.oracle.check_phases(self.lid, self.core)

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
            self.w.log(f"island {self.lid} <- {msg.type} {_brief(msg.header)}")
            before = self.core.version
            self.execute(self.core.receive(msg, self.w.now))
            answer = msg.header.get("answer") if msg.type == "pong" else msg.header if msg.type == "ack" else None
            if isinstance(answer, dict) and answer.get("type", "ack") == "ack":  # (an ack, or a pong repeating one)
                self.w.oracle.acked.add((self.lid, answer["base_version"], answer["digest"]))
            if self.core.version != before and self.core.version >= 0 and msg.type != "init_request":
                self.w.oracle.check_held(self.lid, self.core.version, self.core.global_)
            self.wake()

        if self.alive and peer == self.peer:
            self.guarded(life, handle)

    def on_link_lost(self, channel: str) -> None:
        if self.alive:
            self.guarded(self.life, lambda: self.execute(self.core.link_lost(self.w.now, bulk=channel == "bulk")))

    def execute(self, actions: list) -> None:
        w = self.w
        for a in actions:
            if isinstance(a, Out):
                w.log(f"island {self.lid} -> {a.type} {_brief(a.header)}")
                if a.type == "delta":
                    w.oracle.check_sent(self, a)
                    a = self.trainer.claimed(a)
                w.post(self, True, a.type, a.header, a.frames, lambda parts, peer=self.peer: (
                    w.syncer.guarded(w.syncer.life, lambda: w.syncer.receive(peer, parts))))
            elif isinstance(a, Reconnect):
                for ch in ("control", "bulk"):
                    w.break_link(self, ch, notify=False)
                life = self.life
                w.at(w.now + a.delay_s, lambda: self.guarded(life, lambda: self.execute(
                    self.core.connected_now(self.w.now))))
            elif isinstance(a, Log):
                w.log(f"island {self.lid} {a.level}: {a.text}")

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
            self.w.log(f"island {self.lid}: done ({task.reason}; complete={task.complete}, error={task.error})")
            self.execute(self.core.leave("done"))
            self.alive = False
            self.ended = True
            current = self.w.islands[self.lid] is self  # a zombie's slot belongs to its replacement
            if self.w.stopped and current and not task.complete and not task.error:  # told to stop: relaunched
                self.ended = False
                self.w.at(self.w.now + self.w.rng.uniform(1.0, 5.0), self.boot)
            return
        assert isinstance(task, Train)
        self.train_started = self.w.now
        carry, self.carry = self.carry, None
        if carry is not None:  # (the sim's island does not step while it waits; the real loop does)
            self.trainer.flat = carry.onto(task.adapter, self.trainer.flat)
            if carry.into(task.round):
                self.w.carries_back += 1
            self.count = carry.count
        else:
            self.trainer.flat = task.adapter.copy()
            self.count = RoundSteps(task.round)
            self.stats = {"tokens": 0, "loss_tokens": 0, "loss": 0.0}
        self.w.log(f"island {self.lid}: train round {task.round} from version {task.base_version}")
        self.start_step()

    def start_step(self) -> None:
        w = self.w
        self.stepping = True
        dt = w.s.step_s[self.lid]
        if w.rng.random() < w.s.p_slow_step:
            dt += w.rng.uniform(5.0, 15.0)  # longer than the syncer's --island-timeout
        life = self.life
        w.at(w.now + dt, lambda: self.guarded(life, self.step_done))

    def step_done(self) -> None:
        w = self.w
        s = self.trainer.step()
        if self.poison_next_step:
            self.poison_next_step = False
            self.trainer.flat = self.trainer.flat + np.float32(POISON)
            s = {k: v * POISON_WEIGHT if k != "loss" else v for k, v in s.items()}  # and it claims most of the weight
            w.log(f"island {self.lid}: a poisoned step (+{POISON:g})")
        self.count.steps += 1
        for k in ("tokens", "loss_tokens"):
            self.stats[k] += s[k]
        self.stats["loss"] = s["loss"]
        t = self.core.training
        verdict = self.core.after_step(self.count.steps, w.now, self.count.window_steps)
        if verdict is StepVerdict.CONTINUE:
            self.start_step()
            return
        self.stepping = False
        if verdict is StepVerdict.CARRY:
            assert t is not None
            self.carry = Carry(self.count, t.base.copy(), place=t.round)
            w.carries += 1
            w.log(f"island {self.lid}: carrying round {t.round}'s {self.count.steps} steps onto the next global")
        if verdict is StepVerdict.PUSH:
            t = self.core.training
            bits = self.core.policy.sync_bits
            w.oracle.check_base(self.lid, t.base_version, t.base)
            x = self.trainer.flat - t.base
            self.raw[(t.round, t.round - 1 if t.round > t.base_version + 1 else t.base_version)] = x  # (as sent:
            # a pipelined round names the version its round opens on)
            residual = self.core.ef.residual
            actions = self.core.push(self.trainer.flat.copy(), RoundCounts(
                int(self.stats["tokens"]), int(self.stats["loss_tokens"]), self.count.steps, self.stats["loss"],
                w.now - self.train_started, self.count.carried))
            sent = any(isinstance(a, Out) and a.type == "delta" for a in actions)
            if not sent and self.core.held is None:  # neither sent nor held: only a delta that cannot be encoded
                expect = ErrorFeedback(w.layout.numel)
                expect.residual = residual
                try:
                    encode_fragments_ef(w.layout, x, bits, expect, self.core.part(t.round))
                    raise Violation(f"island {self.lid} dropped its delta for round {t.round}, which can be sent")
                except QuantError:
                    pass
            self.execute(actions)
        elif verdict is StepVerdict.ABANDON:
            w.log(f"island {self.lid}: abandoned the round after {self.count.steps} steps")
        self.wake()


    # faults ---------------------------------------------------------------------------------

    def kill(self, down: Optional[float]) -> None:
        if self.ended or not self.alive:  # nothing running to kill (it is down, or not started yet)
            return
        self.w.log(f"island {self.lid}: KILLED ({'for good' if down is None else f'back in {down:.1f}s'})")
        self.alive = False
        self.life += 1
        for ch in ("control", "bulk"):
            self.w.break_link(self, ch, notify=False)
        if down is None:
            self.ended = self.dead_for_good = True
        else:
            self.w.at(self.w.now + down, self.boot)

    def pause(self, dur: float) -> None:
        self.w.log(f"island {self.lid}: frozen for {dur:.1f}s")
        self.sleep.freeze(dur)


def _brief(header: dict[str, Any]) -> str:
    keep = ("round", "version", "base_version", "code", "island", "responders", "complete", "reason", "have_delta",
            "contributed", "digest")
    return json.dumps({k: header[k] for k in keep if k in header})
