"""An island's side of the round protocol, as a deterministic state machine.

The core holds what the island knows of the run (the global adapter and its
version, the open round, the delta it pushed and whether it was acked) and
decides, from messages, timer ticks and training progress, what to send and
what to train. The training loop (`yeto.island.diloco.run_island`) and the I/O thread
(`yeto.sync.shell.client.SyncerLink`) only carry its decisions out; the simulator
drives the same core with a simulated clock and network.

The core owns its state and hands each concern a narrow part of it: what it
knows of the run and of its link (`knowledge`), its phase (`phases.Phases`: joining,
waiting, training, holding, carrying, finishing, done, each with the data only
it needs, every move checked against the one table), the deltas in the syncer's
hands with their error-feedback residual (`pipeline.DeltasInFlight`), and what
one event says (`outbox`). The syncer's messages are `messages.SyncerMessages`'
(one table from message type to handler); the loop's tasks and verdicts are
`loop`'s.

Rules it keeps:
- Train round r only from the global adapter of the round's base version, and
  push `local - that adapter` with that version, so a delta is always computed
  against the adapter it trained from. Broadcasts, welcomes and states are
  applied before training, never during it. If the global moves on while a
  round trains (the round closed without us), the round goes on and its delta
  is pushed as a stale one, as long as its base is at most the syncer's
  `max_base_lag` versions back and still the run's (a syncer rollback undoes
  it); otherwise the round is abandoned. At most one delta is in the syncer's
  hands (a streamed run's --pipeline D: up to D, each of its own part; see
  pipeline): a round done while the previous delta is unsettled is held
  (raw, not yet quantized) until that one is merged or refused.
- Notice every lost message. Messages are lost only where a connection breaks,
  so: welcome, pong and round headers say where the syncer is, and an island
  behind asks for the missing broadcast (or the whole state), with backoff; a
  delta not acked when a connection broke, or that a welcome says the syncer
  lacks, is sent again; a finish missed is repeated on the next ping.
- The error-feedback residual follows what really counted: a pushed delta that
  was not merged (stale, refused, lost) gives its residual back.
"""

from __future__ import annotations

import math
import random
from typing import Any, Optional, Union

import numpy as np

from yeto.sync.core.actions import IslandAction, Out, Reconnect
from yeto.sync.core.contract import island_contract, tokens_per_step
from yeto.sync.core.island.knowledge import LinkState, RunKnowledge
from yeto.sync.core.island.loop import Done, RoundCounts, StepVerdict, Task, Train, Wait
from yeto.sync.core.island.messages import SyncerMessages
from yeto.sync.core.island.outbox import IslandOutbox
from yeto.sync.core.island.phases import Held, Phase, Phases, Place, Training
from yeto.sync.core.island.pipeline import DeltasInFlight
from yeto.sync.core.policy import RoundPolicy
from yeto.sync.core.island.pushed import Pushed
from yeto.sync.core.island.timing import FINISH_CATCHUP_DEAD_AFTERS, HELLO_RETRY_HEARTBEATS, LinkTimeouts, heartbeat_s
from yeto.sync.core.rounds import WINDOW_NEAREST_BOUNDARY
from yeto.sync.wire.layout import Layout
from yeto.sync.wire.protocol import (CLOCK_JUMP_S, Code, Message, ProtocolError, digest_bytes, encode_fragments_ef,
                                     session_id)
from yeto.sync.wire.quant import ErrorFeedback, QuantError


class IslandCore:
    """An island's side of the round protocol: events in (messages, ticks, training progress), actions out. Why one
    class this size: it is the one owner of the island's state and the one entry point its shells call; each concern
    it hands on (messages, deltas in flight, phases, what it knows) lives in its own module."""

    # what it owns, and nothing else: a field set by mistake (one that moved to a part) fails instead of going unread
    __slots__ = ("island_id", "backend", "layout", "adapter_config", "provenance", "rng", "t", "max_inner_steps",
                 "session", "identity", "contract", "run", "link", "phases", "outbox", "deltas", "messages")

    def __init__(self, island_id: int, backend: str, layout: Layout, init_flat: np.ndarray,
                 adapter_config: dict[str, Any], provenance: dict[str, Any], rng: random.Random,
                 timeouts: LinkTimeouts = LinkTimeouts(), max_inner_steps: int = 0, started_at_us: int = 0,
                 identity: str = "", contract: Optional[dict[str, Any]] = None):
        """`started_at_us`: wall-clock start of this process (microseconds); it orders two sessions of one island
        id, so that a delayed hello from a process that died never takes the id from the one that replaced it.
        `identity`: this island's secret (kept across its restarts): while it holds its id, only a hello that
        carries the same secret may take the id over. `contract`: what it declares it trains (see core/contract)."""
        self.island_id = island_id
        self.backend = backend
        self.layout = layout
        self.adapter_config = adapter_config
        self.provenance = provenance
        self.rng = rng
        self.t = timeouts
        self.max_inner_steps = max_inner_steps
        self.session = session_id(started_at_us, rng)
        self.identity = identity or f"{rng.getrandbits(128):032x}"
        self.contract = contract if contract is not None else island_contract(adapter_config, provenance, layout,
                                                                                tokens_per_step(provenance))
        # what it owns, each part handed only what it works on
        self.run = RunKnowledge(layout)
        self.link = LinkState()
        self.phases = Phases()
        self.outbox = IslandOutbox(island_id, self.session)
        self.deltas = DeltasInFlight(layout, self.run, self.outbox)
        self.messages = SyncerMessages(island_id, layout, init_flat, timeouts, self.run, self.link, self.phases,
                                       self.deltas, self.outbox, self._hello)

    # ------------------------------------------------------------------ what the shells and the loop read

    @property
    def phase(self) -> Phase:
        """Read only: `Phases.enter` is the one way to change it."""
        return self.phases.phase

    @property
    def training(self) -> Optional[Training]:
        """The round being trained, while training."""
        return self.phases.training

    @property
    def held(self) -> Optional[Held]:
        """A finished round's work waiting for the previous delta to settle, while holding."""
        return self.phases.held

    @property
    def carried(self) -> Optional[Place]:
        """The round whose work the training loop carries onto the next global, while carrying."""
        return self.phases.carried

    @property
    def version(self) -> int:
        """The version of the global adapter held (-1: none yet)."""
        return self.run.version

    @property
    def global_(self) -> Optional[np.ndarray]:
        return self.run.global_

    @property
    def digest(self) -> str:
        return self.run.digest

    @property
    def policy(self) -> RoundPolicy:
        """The syncer's policy, from its welcome."""
        return self.run.policy

    @property
    def shard(self) -> Optional[tuple[int, int]]:
        """(index, count) of the data shard the syncer says we train on."""
        return self.run.shard

    @property
    def finish(self) -> Optional[dict[str, Any]]:
        """The syncer's finish, while it stands."""
        return self.run.finish

    @property
    def refused(self) -> Optional[str]:
        """Why the syncer refused this island (final), if it did."""
        return self.link.refused

    @property
    def connected(self) -> bool:
        return self.link.connected

    def part(self, round_number: int) -> Optional[tuple[int, ...]]:
        """The fragments round `round_number` syncs (`round_part`), None: the whole adapter (unstreamed, last round)."""
        return self.run.part(round_number)

    @property
    def ef(self) -> ErrorFeedback:
        """The error feedback of this island's pushes (its residual is what the quantization left out)."""
        return self.deltas.ef

    @property
    def pushed(self) -> Optional[Pushed]:
        """The oldest delta in the syncer's hands, until it is merged or refused."""
        return self.deltas.pushed

    def in_flight(self) -> list[Pushed]:
        """The deltas in the syncer's hands (or on their way), oldest first."""
        return self.deltas.in_flight()

    def counted_residual(self) -> np.ndarray:
        """The error-feedback residual of the deltas that count: each delta still in flight gives its part back."""
        return self.deltas.counted_residual()

    def take_given_back(self) -> set[int]:
        """The fragments whose latest push never counted, since the last call (the loop's streamed start)."""
        out, self.deltas.given_back = self.deltas.given_back, set()
        return out

    @property
    def heartbeat_s(self) -> float:
        return heartbeat_s(self.t, self.run.policy)

    # ------------------------------------------------------------------ link events

    def connected_now(self, now: float) -> list[IslandAction]:
        """A fresh pair of connections is up: introduce ourselves."""
        self.outbox.clear()
        link = self.link
        link.connected = True
        link.joined = False
        link.last_heard = now
        if link.silent_since is None:
            link.silent_since = now
        self._hello(now)
        return self.outbox.flush()

    def link_lost(self, now: float, bulk: bool = True) -> list[IslandAction]:
        """A connection broke under us (ZeroMQ reconnects by itself, but what was in flight on it is gone). The bulk
        one: a delta not yet acked goes again once the syncer is heard from. The control one: only small messages
        were lost (a sync request, an ack or error, which pongs stand in for); a delta still flowing up the bulk
        connection is not sent again (over a slow link a second copy would queue behind the first). A founding upload
        on its way went with the bulk one: it goes again, and its copies count afresh (sim seed 913001457)."""
        link = self.link
        for p in self.deltas.in_flight() if bulk else []:
            p.on_its_way = False
            if not p.acked:
                p.resend = True
        if bulk:
            link.resend_init = link.init_sent is not None and not link.joined
            link.init_copies = 0
        link.next_sync_at = -math.inf  # a sync request may be lost too
        return []

    def receive(self, msg: Message, now: float) -> list[IslandAction]:
        self.outbox.clear()
        link = self.link
        link.last_heard = link.silent_since = now
        link.attempt = 0
        p = self.deltas.pushed
        if p is not None and p.resend and not p.acked and link.joined and self.run.finish is None:
            p.resend = False
            self.deltas.resend_pushed()
        if link.resend_init and link.init_sent is not None and not link.joined:
            link.resend_init = False
            self.messages.send_init()
        try:
            self.messages.handle(msg, now)
        except ProtocolError as e:  # a payload that does not fit our layout: ignore it, catch up from versions
            self.outbox.log("warning", f"ignoring a {msg.type} from the syncer: {e}")
        except (KeyError, TypeError, ValueError, IndexError) as e:  # a header we cannot use: same
            self.outbox.log("warning", f"ignoring a malformed {msg.type} from the syncer: {e!r}")
        self._release_held()
        return self.outbox.flush()

    def tick(self, now: float) -> list[IslandAction]:
        self.outbox.clear()
        link = self.link
        gap, link.last_tick = now - link.last_tick, now
        if gap > CLOCK_JUMP_S:  # we were not running (a laptop asleep): the syncer was not silent meanwhile
            link.last_heard += gap
        if link.refused or link.gave_up or not link.connected:
            return self.outbox.flush()
        if link.silent_since is not None and now - link.silent_since > self.t.give_up_s:
            link.gave_up = f"the syncer has been unreachable for {now - link.silent_since:.0f}s; giving up" + (
                f" (another process held island id {self.island_id})" if link.busy else "")
            self.outbox.log("error", link.gave_up)
            return self.outbox.flush()
        if now - link.last_heard > self.t.dead_after_s:
            delay = self.rng.uniform(0.0, min(self.t.backoff_max_s, self.t.backoff_base_s * (2 ** link.attempt)))
            link.attempt += 1
            link.connected = link.joined = False
            link.init_sent, link.init_copies = None, 0
            self.deltas.copies_lost()
            self.outbox.log("warning", f"syncer silent for {now - link.last_heard:.0f}s; reconnecting in {delay:.1f}s "
                                       f"(attempt {link.attempt})")
            self.outbox.add(Reconnect(delay))
            return self.outbox.flush()
        if not link.joined and now - link.hello_at >= HELLO_RETRY_HEARTBEATS * self.heartbeat_s:
            self._hello(now)  # the hello or its welcome was lost (a welcome carries no adapter: cheap to repeat)
        if now - link.ping_at >= self.heartbeat_s:
            link.ping_at = now
            self.outbox.send("ping", {"version": self.run.version, "pushed": self.deltas.pushed_ref()})
        self.messages.maybe_sync(now)
        self._release_held()
        return self.outbox.flush()

    def link_refused(self, reason: str) -> None:
        """The connection itself was refused (the CURVE handshake failed): final, with what to do about it."""
        self.link.refused, self.link.refused_code = reason, str(Code.IDENTITY)

    def leave(self, reason: str) -> list[IslandAction]:
        return [Out("leave", self.outbox.ids({"reason": reason}))]

    def _hello(self, now: float) -> None:
        """Introduce ourselves (what we train, the version we hold, our secret); the welcome says where the run is."""
        self.link.hello_at = now
        self.outbox.send("hello", {"backend": self.backend, "layout": self.layout.to_json(),
                                   "adapter_config": self.adapter_config, "provenance": self.provenance,
                                   "version": self.run.version, "digest": self.run.digest, "identity": self.identity,
                                   "contract": self.contract})

    # ------------------------------------------------------------------ training events

    def next_task(self, now: float) -> Task:
        """What the training loop should do now."""
        if self.phase is Phase.DONE:
            done = self.phases.done
            assert done is not None
            return done
        ending = self._ending(now)
        if ending is not None:
            if isinstance(ending, Done):
                self.phases.enter(Phase.DONE, "the run is over for this island", ending)
            elif self.phase in (Phase.JOINING, Phase.WAITING, Phase.CARRYING):  # (a round in hand ends by itself)
                self.phases.enter(Phase.FINISHING, "the syncer finished the run")
            return ending
        t = self.training
        if t is not None:
            return Train(t.round, t.base_version, t.base, t.steps, t.seconds)
        c = self.carried
        if c is not None and not self.carrying:  # (the global after its base came while the round trained)
            self.phases.enter(Phase.WAITING, f"carry of round {c.round} ends: version {self.run.version} is here")
        if self.phase is not Phase.WAITING or not self.link.joined or self.run.need_state:
            return Wait()  # (holding: a finished round waits for the previous delta to settle; carrying: the loop
            # keeps training, and that work goes on top of the next global)
        if self.deltas.unsettled() and not self.deltas.open_round_missed():
            return self._start_pipelined(now) or Wait()  # (a pipeline with room trains the next round's part)
        r = self.run.open_round
        if r is None or r["version"] != self.run.version:
            return Wait()
        return self._start_round(r, now)

    def _ending(self, now: float) -> Optional[Union[Done, Wait]]:
        """Done when refused, given up, or finished and holding the final adapter (or past hope of fetching it: the
        syncer stopped answering, or --give-up-after passed); Wait while a finished run's final adapter is on its
        way (a slow link may take minutes for it); None while the run goes on."""
        link, finish = self.link, self.run.finish
        if link.refused:
            return Done(link.refused, error=True, code=link.refused_code)
        if link.gave_up:
            return Done(link.gave_up, error=True, code=Code.BUSY if link.busy else "")
        if finish is None:
            return None
        if self.run.version >= finish["version"] and not self.run.need_state:
            return Done(finish["reason"], complete=bool(finish["complete"]))
        waited = now - self.run.finish_at
        patience = FINISH_CATCHUP_DEAD_AFTERS * self.t.dead_after_s  # (a slow link's final adapter takes minutes, and
        # its control connection may drop meanwhile: a syncer silent that long is gone, not busy)
        answering = link.silent_since is not None and now - link.silent_since <= patience
        if waited >= patience and (not answering or waited >= self.t.give_up_s):
            return Done(f"{finish['reason']}; this island could not fetch the final adapter (version "
                        f"{finish['version']}; it holds {self.run.version}): the syncer's adapter is the result")
        return Wait()

    def _start_round(self, r: dict[str, Any], now: float) -> Task:
        """Train the round open on our version (unless our held delta already stands for it in a fixed-step round)."""
        run = self.run
        assert run.global_ is not None
        windowed = run.policy.windowed
        held = run.place_held is not None and run.place_held.matches(r["round"], r["version"])
        if held and not windowed:
            return Wait()  # the round closes on its quorum, which our held delta is part of: train the next one
        steps = run.policy.steps_for(self.max_inner_steps)
        seconds = max(0.0, r["ends_at"] - now) if windowed and "ends_at" in r else float(r["round_seconds"])
        # (one delta per island per round: this round's work could only go a version late, like every later one)
        p = self.deltas.pushed
        place_taken = (p is not None and p.base_version < run.version) or held
        t = Training(r["round"], run.version, run.global_.copy(), now, steps, seconds, run.digest, windowed,
                     place_taken)
        self.phases.enter(Phase.TRAINING, f"round {r['round']} open on version {run.version}", t)
        return Train(t.round, t.base_version, t.base, steps, seconds)

    def _start_pipelined(self, now: float) -> Optional[Train]:
        """Train the next round ahead of its opening, from the global held, while earlier deltas are in flight."""
        t = self.deltas.training_ahead(now, self.max_inner_steps)
        if t is None:
            return None
        self.phases.enter(Phase.TRAINING, f"round {t.round} pipelined on version {t.base_version}", t)
        return Train(t.round, t.base_version, t.base, t.steps, 0.0)

    def _base_ok(self, base_version: int, base_digest: str, rnd: int = 0) -> bool:
        """May round `rnd`, trained from this base, still be pushed?"""
        run = self.run
        if rnd > base_version + 1:
            return self.deltas.pipelined_ok(rnd, base_version, base_digest)
        lag = run.policy.max_base_lag
        if not lag:
            return base_version == run.version and not run.need_state
        return 0 <= run.version - base_version <= lag and run.lineage.get(base_version) == base_digest

    def after_step(self, steps_done: int, now: float, window_steps: Optional[int] = None) -> StepVerdict:
        """Whether the round's training goes on. `steps_done` counts toward a round of inner steps; `window_steps`
        (default: the same) are the steps taken since this round's training started, which pace a time window
        (steps carried over from before it count toward the delta, not toward the window's pace)."""
        t = self.training
        if self.link.refused or self.link.gave_up or self.run.finish is not None:
            if t is not None:
                self.phases.enter(Phase.WAITING, "stop: the run is over for this island")
            return StepVerdict.STOP
        if t is None or not self._base_ok(t.base_version, t.base_digest, t.round):
            if t is not None:
                self.phases.enter(Phase.WAITING, f"abandon round {t.round}: its base version {t.base_version} is gone")
            return StepVerdict.ABANDON
        elapsed = now - t.started_at
        paced = steps_done if window_steps is None else window_steps
        if (t.steps and steps_done >= t.steps) or (
                t.windowed and paced >= 1 and elapsed * (1 + WINDOW_NEAREST_BOUNDARY / paced) >= t.seconds):
            if t.windowed and t.place_taken:  # carried onto the next global, the work's next push lands fresh
                self.phases.enter(Phase.CARRYING, f"carry round {t.round}: a late delta of ours holds its place",
                                  Place(t.round, t.base_version, t.base_digest))
                return StepVerdict.CARRY
            return StepVerdict.PUSH
        return StepVerdict.CONTINUE

    @property
    def carrying(self) -> bool:
        """A round's work is being carried (after_step said CARRY) and the next global has not come yet."""
        c, run = self.carried, self.run
        return c is not None and (c.version, c.digest) == (run.version, run.digest) and run.finish is None and not (
            self.link.refused or self.link.gave_up)

    def push(self, local: np.ndarray, counts: RoundCounts) -> list[IslandAction]:
        """Send the round's delta (local - the adapter it trained from), quantized with error feedback."""
        self.outbox.clear()
        t = self.training
        if t is None:
            return self.outbox.flush()
        if not self._base_ok(t.base_version, t.base_digest, t.round):
            self.phases.enter(Phase.WAITING, f"push of round {t.round}: its base version {t.base_version} is gone")
            return self.outbox.flush()
        self.deltas.pushing(t)
        self.phases.enter(Phase.HOLDING, f"push of round {t.round}", Held(t, local, counts))
        self._release_held()
        return self.outbox.flush()

    def _release_held(self) -> None:
        """Quantize and send the held round once no earlier delta is unsettled (its residual is then known), or at once
        if it is the next round of a pipeline with room (its part's residual is its own)."""
        h = self.held
        if h is None or not self.deltas.may_send_now(h.training):
            return
        t = h.training
        self.phases.enter(Phase.WAITING, f"release of round {t.round}'s held work")
        if not self._base_ok(t.base_version, t.base_digest, t.round):
            self.outbox.log("warning", f"round {t.round}: its base version {t.base_version} is too old or was rolled "
                                       "back while it waited to be sent; dropping the round's work")
            return
        ef = self.deltas.ef
        residual_before, part = ef.residual, self.run.part(t.round)
        try:
            descs, frames, _ = encode_fragments_ef(self.layout, h.local - t.base, self.run.policy.sync_bits,
                                                   ef, part)
        except QuantError as e:
            ef.residual = residual_before
            self.outbox.log("error", f"round {t.round}: the adapter cannot be sent ({e}); dropping the round's work")
            return
        header = self.deltas.wire_base(t, {"round": t.round, "base_version": t.base_version,
                                           "base_digest": t.base_digest, **h.counts.header(), "fragments": descs})
        p = Pushed(t.round, header["base_version"], digest_bytes(frames), header, tuple(frames), residual_before,
                   header["base_digest"], part=part)
        self.deltas.enqueue(p)
        self.deltas.send(p)
