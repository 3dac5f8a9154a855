"""A learner's side of the round protocol, as a deterministic state machine.

The core holds what the learner knows of the run (the global adapter and its
version, the open round, the delta it pushed and whether it was acked) and
decides, from messages, timer ticks and training progress, what to send and
what to train. The training loop (`yeto.island.diloco.run_island`) and the I/O thread
(`yeto.sync.shell.client.SyncerLink`) only carry its decisions out; the simulator
drives the same core with a simulated clock and network.

What the training loop holds of a round is the core's phase (joining, waiting,
training, holding, carrying, finishing, done: `learner_phases`), with the data
only that phase needs; every move goes through `_enter`, checked against the
one table. The syncer's messages are handled in `learner_messages`, the loop's
tasks and verdicts are `learner_loop`'s.

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
  learner_pipeline): a round done while the previous delta is unsettled is held
  (raw, not yet quantized) until that one is merged or refused.
- Notice every lost message. Messages are lost only where a connection breaks,
  so: welcome, pong and round headers say where the syncer is, and a learner
  behind asks for the missing broadcast (or the whole state), with backoff; a
  delta not acked when a connection broke, or that a welcome says the syncer
  lacks, is sent again; a finish missed is repeated on the next ping.
- The error-feedback residual follows what really counted: a pushed delta that
  was not merged (stale, refused, lost) gives its residual back.
"""

from __future__ import annotations

import math
import random
from typing import Any, Callable, Optional, Union

import numpy as np

from yeto.sync.core.actions import LearnerAction, Log, Out, Reconnect
from yeto.sync.core.contract import learner_contract, tokens_per_step
from yeto.sync.core.learner.loop import Done, RoundCounts, Task, Train, StepVerdict, Wait
from yeto.sync.core.learner.messages import SyncerMessages
from yeto.sync.core.learner.pipeline import PipelinedDeltas
from yeto.sync.core.learner.timing import (FINISH_CATCHUP_DEAD_AFTERS, HELLO_RETRY_HEARTBEATS,
                                           WINDOW_NEAREST_BOUNDARY, LinkTimeouts)
from yeto.sync.core.learner.pushed import Pushed
from yeto.sync.core.learner.phases import DATA, Held, Phase, PhaseData, Place, Training, check_transition
from yeto.sync.wire.layout import Layout, round_part
from yeto.sync.wire.protocol import (CLOCK_JUMP_S, Code, Message, ProtocolError, digest_bytes, encode_fragments_ef,
                                     session_id)
from yeto.sync.wire.quant import ErrorFeedback, QuantError

class LearnerCore(PipelinedDeltas, SyncerMessages):
    def __init__(self, learner_id: int, backend: str, layout: Layout, init_flat: np.ndarray,
                 adapter_config: dict[str, Any], provenance: dict[str, Any], rng: random.Random,
                 timeouts: LinkTimeouts = LinkTimeouts(), max_inner_steps: int = 0, started_at_us: int = 0,
                 identity: str = "", contract: Optional[dict[str, Any]] = None):
        """`started_at_us`: wall-clock start of this process (microseconds); it orders two sessions of one learner
        id, so that a delayed hello from a process that died never takes the id from the one that replaced it.
        `identity`: this learner's secret (kept across its restarts): while it holds its id, only a hello that
        carries the same secret may take the id over. `contract`: what it declares it trains (see core/contract)."""
        self.learner_id = learner_id
        self.backend = backend
        self.layout = layout
        self.init_flat = init_flat
        self.adapter_config = adapter_config
        self.provenance = provenance
        self.rng = rng
        self.t = timeouts
        self.max_inner_steps = max_inner_steps
        self.session = session_id(started_at_us, rng)
        self.identity = identity or f"{rng.getrandbits(128):032x}"
        self.contract = contract if contract is not None else learner_contract(adapter_config, provenance, layout,
                                                                                tokens_per_step(provenance))
        self.ef = ErrorFeedback(layout.numel)
        # the link
        self.connected = False
        self.joined = False
        self.incarnation: Optional[str] = None
        self.policy: dict[str, Any] = {}
        self.shard: Optional[tuple[int, int]] = None  # (index, count) of the data shard the syncer says we train on
        self.last_heard = 0.0  # news from the syncer, or a fresh connection
        self.silent_since: Optional[float] = None  # last news from the syncer (a connection is not news)
        self.attempt = 0
        self.hello_at = -math.inf
        self.ping_at = -math.inf
        # the run as this learner knows it
        self.global_: Optional[np.ndarray] = None
        self.version = -1
        self.digest = ""
        self.syncer_version = -1
        self.need_state = False
        self.behind_since: Optional[float] = None
        self.sync_attempt = 0
        self.next_sync_at = -math.inf
        self.open_round: Optional[dict[str, Any]] = None
        # the phase, and the data only it holds (see learner_phases; changed by _enter alone)
        self._phase = Phase.JOINING
        self._phase_data: PhaseData = None
        self.on_move: Optional[Callable[[Phase, Phase, str], None]] = None  # told every move (the simulator's oracle)
        self.pushed: Optional[Pushed] = None  # the delta in the syncer's hands, until it is merged or refused
        self.ahead: list[Pushed] = []  # later rounds' deltas pushed before `pushed` settled (learner_pipeline)
        self.given_back: set[int] = set()  # fragments whose latest push never counted (the loop's streamed start)
        self.lineage: dict[int, str] = {}  # recent versions held -> digest: a stale round's base must be the run's
        self.contributed: Optional[tuple[int, int]] = None  # (round, base) an earlier session of ours delivered
        self.place_held: Optional[Place] = None  # a round where the syncer holds a late delta of ours that is not
        # `pushed` (an earlier process's, told by the welcome, or a push refused as a duplicate said so)
        self.init_sent: Optional[tuple[dict[str, Any], tuple[bytes, ...]]] = None  # our founding upload
        self.init_copies, self.resend_init = 0, False  # its copies sent (an init_request says how many came)
        self.finish: Optional[dict[str, Any]] = None
        self.finish_at = 0.0
        self.refused: Optional[str] = None
        self.refused_code = ""
        self.busy = False  # the syncer's last word: another, newer session holds our learner id
        self.gave_up: Optional[str] = None
        self.last_tick = math.inf  # (no jump before the first tick)
        self.out: list[LearnerAction] = []

    # ------------------------------------------------------------------ phases

    def _enter(self, phase: Phase, event: str, data: PhaseData = None) -> None:
        """The one way a learner changes phase: the move must be in the table (learner_phases.TRANSITIONS), and the
        new phase gets its own data, dropping the old phase's."""
        old = self._phase
        check_transition(old, phase, event)
        assert isinstance(data, DATA[phase]), f"learner core: {phase.value} holds {DATA[phase].__name__}, not {data!r}"
        self._phase, self._phase_data = phase, data
        if self.on_move is not None:
            self.on_move(old, phase, event)

    @property
    def phase(self) -> Phase:
        """Read only: `_enter` is the one way to change it."""
        return self._phase

    @property
    def training(self) -> Optional[Training]:
        """The round being trained, while training."""
        return self._phase_data if isinstance(self._phase_data, Training) else None

    @property
    def held(self) -> Optional[Held]:
        """A finished round's work waiting for the previous delta to settle, while holding."""
        return self._phase_data if isinstance(self._phase_data, Held) else None

    @property
    def carried(self) -> Optional[Place]:
        """The round whose work the training loop carries onto the next global, while carrying."""
        return self._phase_data if isinstance(self._phase_data, Place) else None

    # ------------------------------------------------------------------ link events

    @property
    def max_lag(self) -> int:
        return int(self.policy.get("max_base_lag", 0))

    def _base_ok(self, base_version: int, base_digest: str, rnd: int = 0) -> bool:
        """May round `rnd`, trained from this base, still be pushed?"""
        if rnd > base_version + 1:
            return self._pipelined_ok(rnd, base_version, base_digest)
        if not self.max_lag:
            return base_version == self.version and not self.need_state
        return 0 <= self.version - base_version <= self.max_lag and self.lineage.get(base_version) == base_digest

    def _may_land(self, p: Pushed, rnd: int, version: int) -> bool:
        """Could our pushed delta be merged in the round `rnd` open on `version`?"""
        return rnd == version + 1 and 0 <= version - p.base_version <= self.max_lag

    def part(self, round_number: int) -> Optional[tuple[int, ...]]:
        """The fragments round `round_number` syncs (`round_part`), None: the whole adapter (unstreamed, last round)."""
        return round_part(self.layout, self.fragments, round_number, int(self.policy.get("outer_steps", 0)))

    @property
    def fragments(self) -> int:  # the parts the run streams its adapter in (1: the whole adapter every round)
        return int(self.policy.get("fragments", 1))

    @property
    def heartbeat_s(self) -> float:
        return min(self.t.heartbeat_s, float(self.policy.get("heartbeat_s", self.t.heartbeat_s)))

    def connected_now(self, now: float) -> list[LearnerAction]:
        """A fresh pair of connections is up: introduce ourselves."""
        self.out = []
        self.connected = True
        self.joined = False
        self.last_heard = now
        if self.silent_since is None:
            self.silent_since = now
        self._hello(now)
        return self._flush()

    def link_lost(self, now: float, bulk: bool = True) -> list[LearnerAction]:
        """A connection broke under us (ZeroMQ reconnects by itself, but what was in flight on it is gone). The bulk
        one: a delta not yet acked goes again once the syncer is heard from. The control one: only small messages
        were lost (a sync request, an ack or error, which pongs stand in for); a delta still flowing up the bulk
        connection is not sent again (over a slow link a second copy would queue behind the first)."""
        for p in self.in_flight() if bulk else []:
            p.on_its_way = False
            if not p.acked:
                p.resend = True
        if bulk:
            self.resend_init = self.init_sent is not None and not self.joined
        self.next_sync_at = -math.inf  # a sync request may be lost too
        return []

    def receive(self, msg: Message, now: float) -> list[LearnerAction]:
        self.out = []
        self.last_heard = self.silent_since = now
        self.attempt = 0
        p = self.pushed
        if p is not None and p.resend and not p.acked and self.joined and self.finish is None:
            p.resend = False
            self._resend_pushed()
        if self.resend_init and self.init_sent is not None and not self.joined:
            self.resend_init = False
            self._send_init()
        try:
            self._handlers().get(msg.type, self._on_other)(msg, now)
        except ProtocolError as e:  # a payload that does not fit our layout: ignore it, catch up from versions
            self._log("warning", f"ignoring a {msg.type} from the syncer: {e}")
        except (KeyError, TypeError, ValueError, IndexError) as e:  # a header we cannot use: same
            self._log("warning", f"ignoring a malformed {msg.type} from the syncer: {e!r}")
        self._release_held()
        return self._flush()

    def tick(self, now: float) -> list[LearnerAction]:
        self.out = []
        gap, self.last_tick = now - self.last_tick, now
        if gap > CLOCK_JUMP_S:  # we were not running (a laptop asleep): the syncer was not silent meanwhile
            self.last_heard += gap
        if self.refused or self.gave_up or not self.connected:
            return self._flush()
        if self.silent_since is not None and now - self.silent_since > self.t.give_up_s:
            self.gave_up = f"the syncer has been unreachable for {now - self.silent_since:.0f}s; giving up" + (
                f" (another process held learner id {self.learner_id})" if self.busy else "")
            self._log("error", self.gave_up)
            return self._flush()
        if now - self.last_heard > self.t.dead_after_s:
            delay = self.rng.uniform(0.0, min(self.t.backoff_max_s, self.t.backoff_base_s * (2 ** self.attempt)))
            self.attempt += 1
            self.connected = self.joined = False
            self.init_sent = None
            self._copies_lost()
            self._log("warning", f"syncer silent for {now - self.last_heard:.0f}s; reconnecting in {delay:.1f}s "
                                 f"(attempt {self.attempt})")
            self.out.append(Reconnect(delay))
            return self._flush()
        if not self.joined and now - self.hello_at >= HELLO_RETRY_HEARTBEATS * self.heartbeat_s:
            self._hello(now)  # the hello or its welcome was lost (a welcome carries no adapter: cheap to repeat)
        if now - self.ping_at >= self.heartbeat_s:
            self.ping_at = now
            self._send("ping", {"version": self.version, "pushed": self._pushed_ref()})
        self._maybe_sync(now)
        self._release_held()
        return self._flush()

    def link_refused(self, reason: str) -> None:
        """The connection itself was refused (the CURVE handshake failed): final, with what to do about it."""
        self.refused, self.refused_code = reason, str(Code.IDENTITY)

    def leave(self, reason: str) -> list[LearnerAction]:
        return [Out("leave", self._ids({"reason": reason}))]

    # ------------------------------------------------------------------ training events

    def next_task(self, now: float) -> Task:
        """What the training loop should do now."""
        if self.phase is Phase.DONE:
            assert isinstance(self._phase_data, Done)
            return self._phase_data
        ending = self._ending(now)
        if ending is not None:
            if isinstance(ending, Done):
                self._enter(Phase.DONE, "the run is over for this learner", ending)
            elif self.phase in (Phase.JOINING, Phase.WAITING, Phase.CARRYING):  # (a round in hand ends by itself)
                self._enter(Phase.FINISHING, "the syncer finished the run")
            return ending
        t = self.training
        if t is not None:
            return Train(t.round, t.base_version, t.base, t.steps, t.seconds)
        c = self.carried
        if c is not None and not self.carrying:  # (the global after its base came while the round trained)
            self._enter(Phase.WAITING, f"carry of round {c.round} ends: version {self.version} is here")
        if self.phase is not Phase.WAITING or not self.joined or self.need_state:
            return Wait()  # (holding: a finished round waits for the previous delta to settle; carrying: the loop
            # keeps training, and that work goes on top of the next global)
        if self._delta_unsettled() and not self._open_round_missed():
            return self._start_pipelined(now) or Wait()  # (a pipeline with room trains the next round's part)
        r = self.open_round
        if r is None or r["version"] != self.version:
            return Wait()
        return self._start_round(r, now)

    def _ending(self, now: float) -> Optional[Union[Done, Wait]]:
        """Done when refused, given up, or finished and holding the final adapter (or past hope of fetching it: the
        syncer stopped answering, or --give-up-after passed); Wait while a finished run's final adapter is on its
        way (a slow link may take minutes for it); None while the run goes on."""
        if self.refused:
            return Done(self.refused, error=True, code=self.refused_code)
        if self.gave_up:
            return Done(self.gave_up, error=True, code=Code.BUSY if self.busy else "")
        if self.finish is None:
            return None
        if self.version >= self.finish["version"] and not self.need_state:
            return Done(self.finish["reason"], complete=bool(self.finish["complete"]))
        waited = now - self.finish_at
        patience = FINISH_CATCHUP_DEAD_AFTERS * self.t.dead_after_s  # (a slow link's final adapter takes minutes, and
        # its control connection may drop meanwhile: a syncer silent that long is gone, not busy)
        answering = self.silent_since is not None and now - self.silent_since <= patience
        if waited >= patience and (not answering or waited >= self.t.give_up_s):
            return Done(f"{self.finish['reason']}; this learner could not fetch the final adapter (version "
                        f"{self.finish['version']}; it holds {self.version}): the syncer's adapter is the result")
        return Wait()

    def _delta_unsettled(self) -> bool:
        """Our delta awaits its merge (or, a stale one, its ack: one per round in the syncer), or an earlier
        session's delta counts in the round open on our version."""
        p = self.pushed
        if p is not None and (p.base_version == self.version or not p.acked):
            return True
        return self.contributed is not None and self.contributed[1] == self.version

    def _start_round(self, r: dict[str, Any], now: float) -> Task:
        """Train the round open on our version (unless our held delta already stands for it in a fixed-step round)."""
        assert self.global_ is not None
        windowed = bool(r["round_seconds"])
        held = self.place_held is not None and self.place_held.matches(r["round"], r["version"])
        if held and not windowed:
            return Wait()  # the round closes on its quorum, which our held delta is part of: train the next one
        steps = 0 if windowed else int(r["inner_steps"])
        if self.max_inner_steps:
            steps = min(steps, self.max_inner_steps) if steps else self.max_inner_steps
        seconds = max(0.0, r["ends_at"] - now) if windowed and "ends_at" in r else float(r["round_seconds"])
        # (one delta per learner per round: this round's work could only go a version late, like every later one)
        p = self.pushed
        place_taken = (p is not None and p.base_version < self.version) or held
        t = Training(r["round"], self.version, self.global_.copy(), now, steps, seconds, self.digest, windowed,
                     place_taken)
        self._enter(Phase.TRAINING, f"round {r['round']} open on version {self.version}", t)
        return Train(t.round, t.base_version, t.base, steps, seconds)

    def after_step(self, steps_done: int, now: float, window_steps: Optional[int] = None) -> StepVerdict:
        """Whether the round's training goes on. `steps_done` counts toward a round of inner steps; `window_steps`
        (default: the same) are the steps taken since this round's training started, which pace a time window
        (steps carried over from before it count toward the delta, not toward the window's pace)."""
        t = self.training
        if self.refused or self.gave_up or self.finish is not None:
            if t is not None:
                self._enter(Phase.WAITING, "stop: the run is over for this learner")
            return StepVerdict.STOP
        if t is None or not self._base_ok(t.base_version, t.base_digest, t.round):
            if t is not None:
                self._enter(Phase.WAITING, f"abandon round {t.round}: its base version {t.base_version} is gone")
            return StepVerdict.ABANDON
        elapsed = now - t.started_at
        paced = steps_done if window_steps is None else window_steps
        if (t.steps and steps_done >= t.steps) or (
                t.windowed and paced >= 1 and elapsed * (1 + WINDOW_NEAREST_BOUNDARY / paced) >= t.seconds):
            if t.windowed and t.place_taken:  # carried onto the next global, the work's next push lands fresh
                self._enter(Phase.CARRYING, f"carry round {t.round}: a late delta of ours holds its place",
                            Place(t.round, t.base_version, t.base_digest))
                return StepVerdict.CARRY
            return StepVerdict.PUSH
        return StepVerdict.CONTINUE

    @property
    def carrying(self) -> bool:
        """A round's work is being carried (after_step said CARRY) and the next global has not come yet."""
        c = self.carried
        return c is not None and (c.version, c.digest) == (self.version, self.digest) and self.finish is None and not (
            self.refused or self.gave_up)

    def push(self, local: np.ndarray, counts: RoundCounts) -> list[LearnerAction]:
        """Send the round's delta (local - the adapter it trained from), quantized with error feedback."""
        self.out = []
        t = self.training
        if t is None:
            return self._flush()
        if not self._base_ok(t.base_version, t.base_digest, t.round):
            self._enter(Phase.WAITING, f"push of round {t.round}: its base version {t.base_version} is gone")
            return self._flush()
        self._pushing(t)
        self._enter(Phase.HOLDING, f"push of round {t.round}", Held(t, local, counts))
        self._release_held()
        return self._flush()

    def _release_held(self) -> None:
        """Quantize and send the held round once no earlier delta is unsettled (its residual is then known), or at once
        if it is the next round of a pipeline with room (its part's residual is its own)."""
        h = self.held
        if h is None or not self._may_send_now(h.training):
            return
        t = h.training
        self._enter(Phase.WAITING, f"release of round {t.round}'s held work")
        if not self._base_ok(t.base_version, t.base_digest, t.round):
            self._log("warning", f"round {t.round}: its base version {t.base_version} is too old or was rolled back "
                                 "while it waited to be sent; dropping the round's work")
            return
        residual_before, part = self.ef.residual, self.part(t.round)
        try:
            descs, frames, _ = encode_fragments_ef(self.layout, h.local - t.base, int(self.policy["sync_bits"]),
                                                   self.ef, part)
        except QuantError as e:
            self.ef.residual = residual_before
            self._log("error", f"round {t.round}: the adapter cannot be sent ({e}); dropping the round's work")
            return
        header = self._wire_base(t, {"round": t.round, "base_version": t.base_version, "base_digest": t.base_digest,
                                     **h.counts.header(), "fragments": descs})
        p = Pushed(t.round, header["base_version"], digest_bytes(frames), header, tuple(frames), residual_before,
                   header["base_digest"], part=part)
        self._enqueue(p)
        self._send_delta(p)

    # ------------------------------------------------------------------ helpers

    def _flush(self) -> list[LearnerAction]:
        out, self.out = self.out, []
        return out

    def _log(self, level: str, text: str) -> None:
        self.out.append(Log(level, text))

    def _ids(self, header: dict[str, Any]) -> dict[str, Any]:
        return {"learner": self.learner_id, "session": self.session, **header}

    def _send(self, msg_type: str, header: dict[str, Any], frames: tuple[bytes, ...] = ()) -> None:
        self.out.append(Out(msg_type, self._ids(header), frames))

    def _hello(self, now: float) -> None:
        self.hello_at = now
        self._send("hello", {"backend": self.backend, "layout": self.layout.to_json(),
                             "adapter_config": self.adapter_config, "provenance": self.provenance,
                             "version": self.version, "digest": self.digest, "identity": self.identity,
                             "contract": self.contract})

    def _pushed_ref(self) -> Optional[list]:
        p = self.pushed
        return [p.round, p.base_version, p.digest] if p is not None else None

    def _resend_pushed(self) -> None:
        p = self.pushed
        if p is not None and p.frames:
            p.acked = False  # an ack from a syncer process that lost it says nothing about this copy (sim seed 5316)
            self._send_pushed()

    def _send_pushed(self) -> None:
        assert self.pushed is not None
        self._send_delta(self.pushed)

    def _send_delta(self, p: Pushed) -> None:
        p.copies += 1
        self._send("delta", {**p.header, "copy": p.copies}, p.frames)
        p.on_its_way = True

    def _adopt(self, version: int, flat: np.ndarray, digest: str, merged: list[list]) -> None:
        """Hold a new global adapter; settle the pushed delta by whether it was among the merged ones
        (`merged`: [round, digest] of this learner id's merged deltas the syncer told us about)."""
        self.global_, self.version, self.digest = flat, version, digest
        self.need_state = False
        if self.phase is Phase.JOINING:
            self._enter(Phase.WAITING, f"the run's version {version} adopted")
        self.lineage = {v: d for v, d in self.lineage.items() if version - self.versions_kept <= v < version}
        self.lineage[version] = digest
        self._settle_pushed(version, merged)
        if self.contributed is not None and self.contributed[1] != version:
            self.contributed = None
        c = self.carried
        if c is not None and (c.version, c.digest) != (version, digest):
            # the global it waited for came (or a rollback took the run elsewhere): carry it
            self._enter(Phase.WAITING, f"carry of round {c.round} ends: version {version} came")
        if self.open_round is not None and self.open_round["version"] < version:
            self.open_round = None
        self._maybe_sync_reset()

    def _settle_pushed(self, version: int, merged: list[list]) -> None:
        """A new global: our pushed delta counted if it is among the merged ones; if not, and it cannot land in a
        later round either, it never will, and its residual is ours again."""
        while True:  # (then the next delta in flight, which a state that jumps versions may settle too)
            p = self.pushed
            if p is None or p.base_version == version or (p.base_version > version and "trained_from" in p.header):
                return  # (a pipelined one waits for the version its round opens on)
            counted = [p.round, p.digest] in merged
            may_land = not counted and 0 < version - p.base_version <= self.max_lag and (
                self.lineage.get(p.base_version) == p.base_digest) and not (
                p.merge_round is not None and version >= p.merge_round)  # (acked into a round merged without it)
            if not counted and not may_land:
                self._give_back(p)  # it never counted: its quantization error is not ours to carry
            if may_land:
                return
            self.pushed = None
            self._promote()
