"""A learner's side of the round protocol, as a deterministic state machine.

The core holds what the learner knows of the run (the global adapter and its
version, the open round, the delta it pushed and whether it was acked) and
decides, from messages, timer ticks and training progress, what to send and
what to train. The training loop (`yeto.island.diloco.run_island`) and the I/O thread
(`yeto.sync.shell.client.SyncerLink`) only carry its decisions out; the simulator
drives the same core with a simulated clock and network.

Rules it keeps:
- Train round r only from the global adapter of the round's base version, and
  push `local - that adapter` with that version, so a delta is always computed
  against the adapter it trained from. Broadcasts, welcomes and states are
  applied before training, never during it. If the global moves on while a
  round trains (the round closed without us), the round goes on and its delta
  is pushed as a stale one, as long as its base is at most the syncer's
  `max_base_lag` versions back and still the run's (a syncer rollback undoes
  it); otherwise the round is abandoned. At most one delta is in the syncer's
  hands: a round done while the previous delta is unsettled is held (raw, not
  yet quantized) until that one is merged or refused.
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
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Optional, Union

import numpy as np

from yeto.sync.core.actions import LearnerAction, Log, Out, Reconnect
from yeto.sync.core.contract import learner_contract, tokens_per_step
from yeto.sync.wire.layout import Layout
from yeto.sync.wire.protocol import (CLOCK_JUMP_S, FINAL_CODES, Code, Message, ProtocolError, array_digest,
                                     decode_fragments, digest_bytes, encode_fragments, encode_fragments_ef, session_id)
from yeto.sync.wire.quant import ErrorFeedback, QuantError, dequantize

HELLO_RETRY_HEARTBEATS = 2  # not welcomed after this many heartbeats: say hello again
FINISH_CATCHUP_DEAD_AFTERS = 3  # after a finish, try this many dead-peer timeouts to fetch the final adapter
# a time window ends at the step boundary nearest its end: stop once the next step (at this window's mean pace)
# would overrun the end by more than the time left. Islands' pushes then centre on the window's end instead of
# trailing it by up to a step, so a fast island is not the last in, missing a round a slow one's push closed
WINDOW_NEAREST_BOUNDARY = 0.5


@dataclass(frozen=True)
class LinkTimeouts:
    """How a learner judges the syncer's silence (seconds)."""

    heartbeat_s: float = 5.0  # ping at least this often (the syncer's policy may ask for more often)
    dead_after_s: float = 30.0  # silence after which the connection is presumed dead and remade
    give_up_s: float = 1800.0  # silence after which the learner gives up (saving its adapter)
    backoff_base_s: float = 0.5  # reconnect backoff: uniform in [0, min(max, base * 2**attempt)]
    backoff_max_s: float = 30.0


# ---------------------------------------------------------------------------------------------- tasks


@dataclass(frozen=True)
class Wait:
    pass


@dataclass(frozen=True)
class Train:
    round: int
    base_version: int
    adapter: np.ndarray  # the global adapter of base_version: load it, train, push local - it
    steps: int  # 0 in time-window rounds
    seconds: float


@dataclass(frozen=True)
class Done:
    reason: str
    complete: bool = False  # the syncer finished the run (not stopped early)
    error: bool = False  # refused, or gave up: the learner exits non-zero
    code: str = ""  # why it was refused (a protocol.Code), if it was


Task = Union[Wait, Train, Done]


class Verdict(Enum):
    CONTINUE = "continue"
    PUSH = "push"  # the round's work is done: push it
    ABANDON = "abandon"  # the round closed without us (or our adapter is unusable): drop the work
    STOP = "stop"  # the run is over for this learner
    # a time window is over, but our previous (late) delta holds this round's place in the syncer (one per learner
    # per round): keep the work and carry it onto the next global, so the next push lands fresh
    CARRY = "carry"


@dataclass(frozen=True)
class Place:
    """A round's place in the syncer (one delta per learner per round): the round and the global it opened on."""

    round: int
    version: int
    digest: str = ""  # that global's, where it matters (a carry: a rollback may make its version another adapter)

    def matches(self, rnd: int, version: int) -> bool:
        return (self.round, self.version) == (rnd, version)


@dataclass
class Training:
    round: int
    base_version: int
    base: np.ndarray
    started_at: float
    steps: int
    seconds: float  # time windows: what is left of the round's window when training starts (0: one step)
    base_digest: str = ""
    windowed: bool = False  # a time-window round
    place_taken: bool = False  # our previous delta, late, holds (or will hold) this round's place in the syncer


@dataclass(frozen=True)
class RoundCounts:
    """What a round's training took, as its delta reports it (the merge weighs by these; the syncer checks them)."""

    tokens: int
    loss_tokens: int
    steps: int
    loss: float
    compute_s: float
    # of `steps`, those trained in an earlier round's window and carried onto this one (Verdict.CARRY): step
    # normalization leaves them out of the round's length
    carried_steps: int = 0

    def header(self) -> dict[str, Any]:
        h = {"tokens": self.tokens, "loss_tokens": self.loss_tokens, "inner_steps": self.steps, "loss": self.loss,
             "compute_s": round(self.compute_s, 4)}
        if self.carried_steps:
            h["carried_steps"] = self.carried_steps
        return h


@dataclass
class Held:
    """A finished round's work waiting for the previous delta to settle (raw: quantized once it goes)."""

    training: Training
    local: np.ndarray = field(repr=False)
    counts: RoundCounts


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


class LearnerCore:
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
        self.training: Optional[Training] = None
        self.pushed: Optional[Pushed] = None
        self.held: Optional[Held] = None
        self.lineage: dict[int, str] = {}  # recent versions held -> digest: a stale round's base must be the run's
        self.contributed: Optional[tuple[int, int]] = None  # (round, base) an earlier session of ours delivered
        self.carried: Optional[Place] = None  # the round whose work the training loop carries onto the next global
        self.place_held: Optional[Place] = None  # a round where the syncer holds a late delta of ours that is not
        # `pushed` (an earlier process's, told by the welcome, or a push refused as a duplicate said so)
        self.init_sent: Optional[tuple[dict[str, Any], tuple[bytes, ...]]] = None  # our founding upload
        self.resend_init = False
        self.finish: Optional[dict[str, Any]] = None
        self.finish_at = 0.0
        self.refused: Optional[str] = None
        self.refused_code = ""
        self.busy = False  # the syncer's last word: another, newer session holds our learner id
        self.gave_up: Optional[str] = None
        self.last_tick = math.inf  # (no jump before the first tick)
        self.out: list[LearnerAction] = []

    # ------------------------------------------------------------------ link events

    @property
    def max_lag(self) -> int:
        return int(self.policy.get("max_base_lag", 0))

    def _base_ok(self, base_version: int, base_digest: str) -> bool:
        """May a round trained from this base still be pushed?"""
        if not self.max_lag:
            return base_version == self.version and not self.need_state
        return 0 <= self.version - base_version <= self.max_lag and self.lineage.get(base_version) == base_digest

    def _may_land(self, p: Pushed, rnd: int, version: int) -> bool:
        """Could our pushed delta be merged in the round `rnd` open on `version`?"""
        return rnd == version + 1 and 0 <= version - p.base_version <= self.max_lag

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

    def link_lost(self, now: float) -> list[LearnerAction]:
        """A connection broke under us (ZeroMQ reconnects by itself, but what was in flight is gone):
        a delta not yet acked goes again once the syncer is heard from."""
        if self.pushed is not None and not self.pushed.acked:
            self.pushed.resend = True
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
            self._send("init", *self.init_sent)
        try:
            getattr(self, f"_on_{msg.type}", self._on_other)(msg, now)
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

    def leave(self, reason: str) -> list[LearnerAction]:
        return [Out("leave", self._ids({"reason": reason}))]

    # ------------------------------------------------------------------ training events

    def next_task(self, now: float) -> Task:
        """What the training loop should do now."""
        if self.refused:
            return Done(self.refused, error=True, code=self.refused_code)
        if self.gave_up:
            return Done(self.gave_up, error=True, code=Code.BUSY if self.busy else "")
        if self.finish is not None:
            caught_up = self.version >= self.finish["version"] and not self.need_state
            if caught_up:
                return Done(self.finish["reason"], complete=bool(self.finish["complete"]))
            if now - self.finish_at >= FINISH_CATCHUP_DEAD_AFTERS * self.t.dead_after_s:
                return Done(f"{self.finish['reason']}; this learner could not fetch the final adapter (version "
                            f"{self.finish['version']}; it holds {self.version}): the syncer's adapter is the result")
            return Wait()
        t = self.training
        if t is not None:
            return Train(t.round, t.base_version, t.base, t.steps, t.seconds)
        if not self.joined or self.global_ is None or self.need_state:
            return Wait()
        if self.held is not None:
            return Wait()  # a finished round waits for the previous delta to settle
        p = self.pushed
        if p is not None and (p.base_version == self.version or not p.acked):
            return Wait()  # our delta awaits its merge (or, a stale one, its ack: one per round in the syncer)
        if self.contributed is not None and self.contributed[1] == self.version:
            return Wait()
        if self.carrying:
            return Wait()  # (the loop keeps training; that work goes on top of the next global)
        r = self.open_round
        if r is None or r["version"] != self.version:
            return Wait()
        windowed = bool(r["round_seconds"])
        held = self.place_held is not None and self.place_held.matches(r["round"], r["version"])
        if held and not windowed:
            return Wait()  # the round closes on its quorum, which our held delta is part of: train the next one
        steps = 0 if windowed else int(r["inner_steps"])
        if self.max_inner_steps:
            steps = min(steps, self.max_inner_steps) if steps else self.max_inner_steps
        seconds = max(0.0, r["ends_at"] - now) if windowed and "ends_at" in r else float(r["round_seconds"])
        # (one delta per learner per round: this round's work could only go a version late, like every later one)
        place_taken = (p is not None and p.base_version < self.version) or held
        self.carried = None
        self.training = Training(r["round"], self.version, self.global_.copy(), now, steps, seconds, self.digest,
                                 windowed, place_taken)
        return Train(r["round"], self.version, self.training.base, steps, seconds)

    def after_step(self, steps_done: int, now: float, window_steps: Optional[int] = None) -> Verdict:
        """Whether the round's training goes on. `steps_done` counts toward a round of inner steps; `window_steps`
        (default: the same) are the steps taken since this round's training started, which pace a time window
        (steps carried over from before it count toward the delta, not toward the window's pace)."""
        if self.refused or self.gave_up or self.finish is not None:
            self.training = None
            return Verdict.STOP
        t = self.training
        if t is None or not self._base_ok(t.base_version, t.base_digest):
            self.training = None
            return Verdict.ABANDON
        elapsed = now - t.started_at
        paced = steps_done if window_steps is None else window_steps
        if (t.steps and steps_done >= t.steps) or (
                t.windowed and paced >= 1 and elapsed * (1 + WINDOW_NEAREST_BOUNDARY / paced) >= t.seconds):
            if t.windowed and t.place_taken:  # carried onto the next global, the work's next push lands fresh
                self.training = None
                self.carried = Place(t.round, t.base_version, t.base_digest)
                return Verdict.CARRY
            return Verdict.PUSH
        return Verdict.CONTINUE

    @property
    def carrying(self) -> bool:
        """A round's work is being carried (after_step said CARRY) and the next global has not come yet."""
        c = self.carried
        return c is not None and (c.version, c.digest) == (self.version, self.digest) and self.finish is None and not (
            self.refused or self.gave_up)

    def push(self, local: np.ndarray, counts: RoundCounts) -> list[LearnerAction]:
        """Send the round's delta (local - the adapter it trained from), quantized with error feedback."""
        self.out = []
        t, self.training = self.training, None
        if t is None or not self._base_ok(t.base_version, t.base_digest):
            return self._flush()
        self.held = Held(t, local, counts)
        self._release_held()
        return self._flush()

    def _release_held(self) -> None:
        """Quantize and send the held round once no earlier delta is unsettled (its residual is then known)."""
        h = self.held
        if h is None or self.pushed is not None:
            return
        self.held = None
        t = h.training
        if not self._base_ok(t.base_version, t.base_digest):
            self._log("warning", f"round {t.round}: its base version {t.base_version} is too old or was rolled back "
                                 "while it waited to be sent; dropping the round's work")
            return
        residual_before = self.ef.residual
        try:
            descs, frames, _ = encode_fragments_ef(self.layout, h.local - t.base, int(self.policy["sync_bits"]),
                                                   self.ef)
        except QuantError as e:
            self.ef.residual = residual_before
            self._log("error", f"round {t.round}: the adapter cannot be sent ({e}); dropping the round's work")
            return
        header = {"round": t.round, "base_version": t.base_version, "base_digest": t.base_digest,
                  **h.counts.header(), "fragments": descs}
        self.pushed = Pushed(t.round, t.base_version, digest_bytes(frames), header, tuple(frames), residual_before,
                             t.base_digest)
        self._send("delta", header, self.pushed.frames)

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
            self._send("delta", p.header, p.frames)

    def _maybe_sync(self, now: float) -> None:
        """Behind the syncer (a broadcast lost, or a welcome on another version): ask, with backoff."""
        target = max(self.syncer_version, self.finish["version"] if self.finish else -1)
        if not self.joined or not (self.need_state or target > self.version):
            self.behind_since = None
            self.sync_attempt = 0
            return
        if self.behind_since is None:
            self.behind_since = now
        grace = 0.0 if self.need_state else 2 * self.heartbeat_s  # a broadcast may still be on its way
        if now - self.behind_since < grace or now < self.next_sync_at:
            return
        self._send("sync", {"version": -1 if self.need_state else self.version, "pushed": self._pushed_ref()})
        self.next_sync_at = now + min(4 * self.t.dead_after_s, 2 * self.heartbeat_s * (2 ** self.sync_attempt))
        self.sync_attempt += 1

    def _adopt(self, version: int, flat: np.ndarray, digest: str, merged: list[list]) -> None:
        """Hold a new global adapter; settle the pushed delta by whether it was among the merged ones
        (`merged`: [round, digest] of this learner id's merged deltas the syncer told us about)."""
        self.global_, self.version, self.digest = flat, version, digest
        self.need_state = False
        self.lineage = {v: d for v, d in self.lineage.items() if version - self.max_lag <= v < version}
        self.lineage[version] = digest
        p = self.pushed
        if p is not None and p.base_version != version:
            counted = [p.round, p.digest] in merged
            may_land = not counted and 0 < version - p.base_version <= self.max_lag and (
                self.lineage.get(p.base_version) == p.base_digest) and not (
                p.merge_round is not None and version >= p.merge_round)  # (acked into a round merged without it)
            if not counted and not may_land:
                self.ef.residual = p.residual_before  # it never counted: its quantization error is not ours to carry
            if not may_land:
                self.pushed = None
        if self.contributed is not None and self.contributed[1] != version:
            self.contributed = None
        if self.carried is not None and (self.carried.version, self.carried.digest) != (version, digest):
            self.carried = None  # the global it waited for came (or a rollback took the run elsewhere): carry it
        if self.open_round is not None and self.open_round["version"] < version:
            self.open_round = None
        self._maybe_sync_reset()

    def _maybe_sync_reset(self) -> None:
        if self.version >= self.syncer_version:
            self.behind_since = None
            self.sync_attempt = 0
            self.next_sync_at = -math.inf

    def _settle_refused(self, code: str, h: dict[str, Any]) -> None:
        """Our delta for (round, base_version) did not count: give its residual back. But "stale" is final only
        when the syncer is behind its base (it rolled back): if it has merged the round since, the broadcast or
        state says whether ours was in; if the round is not open yet (a restarted syncer), it will be, and the
        delta goes again then (a copy sent meanwhile may even be accepted)."""
        where = [h.get("round"), h.get("base_version")]
        if code != Code.STALE and self.contributed is not None and list(self.contributed) == where:
            self.contributed = None  # an earlier session's delta was refused: this session trains the round itself
        p = self.pushed
        if p is None or [p.round, p.base_version] != where or h.get("digest", p.digest) != p.digest:
            return  # not about the delta we hold (e.g. an earlier push of this round)
        behind = h.get("version", -1) - p.base_version
        if code == Code.STALE and behind >= 0 and (not self.max_lag or behind <= self.max_lag):
            p.acked, p.stale = False, True
            return
        if code == Code.DUPLICATE and h.get("version") == self.version:  # another delta of ours holds the round
            self.place_held = Place(self.version + 1, self.version)
        self._drop_uncounted()

    def _drop_uncounted(self) -> None:
        """Our pushed delta will never count: its residual is ours again. (The place a late one held is freed by the
        next pong saying the round holds nothing of ours, not here: a merge that refused it may have gone on without
        it and closed the round, and this error comes before that broadcast, which travels on the bulk connection.)"""
        p = self.pushed
        assert p is not None
        self.ef.residual = p.residual_before
        self.pushed = None

    def _free_place(self, rnd: int, version: int) -> None:
        """The syncer holds no delta of ours in round `rnd` (open on `version`) after all: the late one that held its
        place was refused or lost. The work trained for that round, or carried since, goes to it, not on top of the
        next global (the syncer counts us as training it)."""
        if self.place_held is not None and self.place_held.matches(rnd, version):
            self.place_held = None
        t = self.training
        if t is not None and (t.round, t.base_version) == (rnd, version):
            t.place_taken = False
        if self.carried is not None and self.carried.matches(rnd, version):
            self.carried = None

    def _set_open_round(self, r: dict[str, Any], now: float) -> None:
        cur = self.open_round
        if cur is None or r["round"] > cur["round"]:
            self.open_round = _with_window_end(r, now)

    # ------------------------------------------------------------------ messages

    def _on_other(self, msg: Message, now: float) -> None:
        self._log("warning", f"ignoring an unexpected {msg.type} from the syncer")

    def _on_welcome(self, msg: Message, now: float) -> None:
        h = msg.header
        self.joined = True
        self.busy = False
        self.init_sent = None
        self.incarnation = h["incarnation"]
        self.policy = h["policy"]
        index, count = h["shard"]
        self.shard = (int(index), int(count))
        self.syncer_version = h["version"]
        if self.global_ is None or self.version != h["version"] or self.digest != h["digest"]:
            self.need_state = True
            self.next_sync_at = -math.inf
            # versions from here on may be redefined (a syncer that rolled back): no stale round trained from them
            self.lineage = {v: d for v, d in self.lineage.items() if v < h["version"] or (
                v == h["version"] and d == h["digest"])}
        self.open_round = _with_window_end(h["open_round"], now) if h["open_round"] else None
        self.contributed = self.place_held = None
        r = self.open_round
        p = self.pushed
        pending = h.get("pending")
        if r is not None and h["contributed"]:
            if p is not None and (pending == [p.round, p.base_version, p.digest] if pending is not None else
                                  [p.round, p.base_version] == [r["round"], r["version"]]):
                p.acked, p.merge_round = True, r["round"]
            elif pending is None or pending[1] == r["version"]:
                self.contributed = (r["round"], r["version"])
            else:  # an earlier process's late delta: this round's work goes on top of the next global
                self.place_held = Place(r["round"], r["version"])
                t = self.training
                if t is not None and self.place_held.matches(t.round, t.base_version):
                    t.place_taken = True
        elif r is not None and p is not None and self._may_land(p, r["round"], r["version"]):
            self._resend_pushed()  # the syncer lost it (it restarted before the delta was saved)
        elif r is not None and p is None:
            self._free_place(r["round"], r["version"])  # (a late delta we knew of is gone)
        self._log("info", f"joined the syncer at version {h['version']}; policy {self.policy}")
        self._maybe_sync(now)

    def _on_init_request(self, msg: Message, now: float) -> None:
        """Found the run: upload our initial adapter at the run's wire precision. Asked again (our hello was
        repeated while the upload is on its way), we do not start another one: a lost upload is sent again when a
        broken connection is noticed (`link_lost`)."""
        if self.joined or self.init_sent is not None:
            return
        bits = msg.header["bits"]
        descs, frames = encode_fragments(self.layout, self.init_flat, bits)
        self.init_sent = ({"fragments": descs}, tuple(frames))
        self._send("init", *self.init_sent)
        # what the syncer will decode: hold it too, so the welcome finds us current
        flat = np.concatenate([dequantize(fr, f.numel, bits) for fr, f in zip(frames, self.layout.fragments)])
        self.global_, self.version, self.digest = flat, 0, array_digest(flat)
        self.lineage = {0: self.digest}
        self._log("info", f"founding the run: sent the initial adapter at {bits} bits")

    def _on_round(self, msg: Message, now: float) -> None:
        h = msg.header
        if h["version"] < self.version:
            return
        self.syncer_version = max(self.syncer_version, h["version"])
        self._set_open_round(h, now)
        p = self.pushed
        if p is not None and self._may_land(p, h["round"], h["version"]):
            self._resend_pushed()  # the syncer announces a round only to those whose delta it lacks
        self._maybe_sync(now)

    def _on_broadcast(self, msg: Message, now: float) -> None:
        h = msg.header
        self.syncer_version = max(self.syncer_version, h["version"])
        if h["version"] != self.version + 1 or self.global_ is None or self.need_state:
            return  # a duplicate, or we are further behind: catch-up asks for what is missing
        flat = self.global_ + decode_fragments(self.layout, msg)
        digest = array_digest(flat)
        if digest != h["digest"]:
            self.need_state = True
            self._log("warning", f"broadcast {h['version']} does not reproduce the syncer's adapter "
                                 f"({digest} != {h['digest']}): asking for the full state")
            return
        lags = h.get("lags") or [0] * len(h["responders"])
        mine = [[h["round"] - lag, d] for lid, d, lag in zip(h["responders"], h["deltas"], lags)
                if lid == self.learner_id]
        self._adopt(h["version"], flat, digest, mine)

    def _on_state(self, msg: Message, now: float) -> None:
        h = msg.header
        if not (self.need_state or h["version"] > self.version):
            return
        flat = decode_fragments(self.layout, msg)
        if array_digest(flat) != h["digest"]:
            self._log("warning", f"state {h['version']} arrived damaged; asking again")
            return
        self.syncer_version = max(self.syncer_version, h["version"])
        self._adopt(h["version"], flat, h["digest"], [list(x) for x in h["merged"]])

    def _on_pong(self, msg: Message, now: float) -> None:
        h = msg.header
        if h["incarnation"] != self.incarnation:
            # from a syncer process that is gone, or from one whose welcome we lost (it restarted after the welcome
            # we hold): join it, or we would wait on a process that no longer exists
            if self.joined and now - self.hello_at >= self.heartbeat_s:
                self.joined = False
                if self.pushed is not None:
                    self.pushed.resend = True  # the welcome says whether it still has our delta
                self._hello(now)
            return
        self.syncer_version = max(self.syncer_version, h["version"])
        p = self.pushed
        c = self.contributed
        if c is not None and h["round_open"] and [h["round"], h["version"]] == list(c) and not h["contributed"]:
            self.contributed = None  # the earlier session's delta is gone (refused): this session trains the round
        if h["round_open"] and not h["contributed"] and p is None:
            self._free_place(h["round"], h["version"])  # the late delta that held it is gone (refused)
        if h["round_open"] and h["version"] >= self.version:  # (trained once we hold that version)
            mine = p is not None and p.round == h["round"]
            if not mine and not (self.contributed and self.contributed[0] == h["round"]) and (
                    self.training is None or self.training.round != h["round"]):
                self._set_open_round({"round": h["round"], "version": h["version"],
                                      "inner_steps": self.policy.get("inner_steps", 1),
                                      "round_seconds": self.policy.get("round_seconds", 0.0),
                                      "seconds_left": h.get("seconds_left")}, now)
            if p is not None and self._may_land(p, h["round"], h["version"]) and (
                    p.merge_round is None or p.merge_round == h["round"]):
                if h["have_delta"]:
                    p.acked, p.merge_round = True, h["round"]  # (a pong without it proves nothing: the delta may
                    # still be on its way ...)
                elif p.stale:  # (... unless the syncer told us it had no round for it: now it has)
                    p.stale = False
                    self._resend_pushed()
                elif p.acked and not h["contributed"]:  # it had it (acked: saved), and with the round still open it
                    # holds nothing from us any more: refused (the error saying so was lost). A pong sent after the
                    # ack is received after it (one connection, in order), so it is not news from before the delta.
                    self._drop_uncounted()
        self._maybe_sync(now)

    def _on_ack(self, msg: Message, now: float) -> None:
        h = msg.header
        p = self.pushed
        if p is not None and [p.round, p.base_version, p.digest] == [h["round"], h["base_version"], h["digest"]]:
            p.acked = True
            if h.get("merged"):  # sent again after its ack was lost, and merged meanwhile: it counted
                self.pushed = None
            elif isinstance(h.get("merge_round"), int):
                p.merge_round = h["merge_round"]

    def _on_error(self, msg: Message, now: float) -> None:
        h = msg.header
        code = h["code"]
        if code == Code.NOT_JOINED:
            self.init_sent = None  # a syncer that forgot us forgot any founding upload too: upload again if asked
            if self.pushed is not None:
                self.pushed.resend = True  # and maybe our delta: the welcome or the round says
            if self.joined or now - self.hello_at >= self.heartbeat_s:
                self.joined = False
                self._hello(now)
        elif code in FINAL_CODES:
            self.refused, self.refused_code = h["reason"], code
        elif code in (Code.BUSY, Code.ID_TAKEN):
            self.joined = False  # hello again later: the session holding our id may be a dead one
            self.busy = True
            self._log("warning", h["reason"])
        elif code in (Code.STALE, Code.REFUSED, Code.DUPLICATE):
            self._settle_refused(code, h)
            self._log("warning", f"delta not counted ({code}): {h['reason']}")
        else:
            self._log("warning", f"syncer error ({code}): {h['reason']}")

    def link_refused(self, reason: str) -> None:
        """The connection itself was refused (the CURVE handshake failed): final, with what to do about it."""
        self.refused, self.refused_code = reason, str(Code.IDENTITY)

    def _on_refuse(self, msg: Message, now: float) -> None:
        self.refused = f"the syncer refused this learner: {msg.header['reason']}"
        self.refused_code = msg.header["code"]
        self._log("error", self.refused)

    def _on_finish(self, msg: Message, now: float) -> None:
        if self.finish is None:
            self.finish = dict(msg.header)
            self.finish_at = now
            self.syncer_version = max(self.syncer_version, msg.header["version"])
            self._maybe_sync(now)


def _with_window_end(r: dict[str, Any], now: float) -> dict[str, Any]:
    """The open round as announced, with its time window's end on our clock (`ends_at`): the syncer says how much of
    the round's window was left when it wrote (relative: no clocks need agree). Missing or out of range (an older
    syncer), the window is a whole `round_seconds` from now."""
    out = dict(r)
    out.pop("ends_at", None)  # (ours to compute, never the sender's)
    window = r.get("round_seconds")
    left = r.get("seconds_left")
    if isinstance(window, (int, float)) and window > 0:
        ok = isinstance(left, (int, float)) and not isinstance(left, bool) and math.isfinite(left) and left >= 0
        out["ends_at"] = now + (min(float(left), float(window)) if ok else float(window))
    return out
