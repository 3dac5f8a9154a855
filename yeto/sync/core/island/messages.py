"""What the syncer's messages mean to an island: `SyncerMessages`, the message handlers of a `IslandCore`.

Each `_on_<type>` (the table `_handlers` names them, written once; `handle` dispatches through it) takes one message
from the syncer and updates what the island knows: the run (welcome, state, broadcast, finish), the open round
(round, pong), and where its own delta stands (ack, error, pong, welcome). They notice lost messages by what the
syncer says it holds (see `yeto.sync.core.island.core`'s rules) and ask, with backoff, for what an island behind is
missing (`maybe_sync`), and settle a delta that will never count by giving its error-feedback residual back. The state
they read and change is handed to them by the core that owns it: what it knows of the run and of its link, its phase,
its deltas in flight and its outbox, and the one thing they ask of the core itself, to say hello.
"""

from __future__ import annotations

import math
from typing import Any, Callable

import numpy as np

from yeto.sync.core.island.knowledge import LinkState, RunKnowledge
from yeto.sync.core.island.outbox import IslandOutbox
from yeto.sync.core.island.phases import Phase, Phases, Place
from yeto.sync.core.island.pipeline import DeltasInFlight
from yeto.sync.core.policy import RoundPolicy
from yeto.sync.core.island.timing import LinkTimeouts, heartbeat_s
from yeto.sync.wire.layout import Layout
from yeto.sync.wire.protocol import (FINAL_CODES, Code, Message, ProtocolError, array_digest, decode, decode_fragments,
                                     encode, encode_fragments)
from yeto.sync.wire.quant import dequantize

Handler = Callable[[Message, float], None]


class SyncerMessages:
    """What each message from the syncer means to an island, over the state its core hands it."""

    def __init__(self, island_id: int, layout: Layout, init_flat: np.ndarray, timeouts: LinkTimeouts,
                 run: RunKnowledge, link: LinkState, phases: Phases, deltas: DeltasInFlight, outbox: IslandOutbox,
                 hello: Callable[[float], None]):
        """`init_flat`: the adapter this island founds the run with, if asked; `hello(now)`: introduce ourselves
        again (the core's, which knows what a hello says)."""
        self.island_id = island_id
        self.layout = layout
        self.init_flat = init_flat
        self.timeouts = timeouts
        self.run = run
        self.link = link
        self.phases = phases
        self.deltas = deltas
        self.outbox = outbox
        self.hello = hello
        self.table = self._handlers()

    def handle(self, msg: Message, now: float) -> None:
        """Take one message from the syncer to the handler the table names (an unexpected type: a warning)."""
        self.table.get(msg.type, self._on_other)(msg, now)

    @property
    def heartbeat_s(self) -> float:
        """How often the island pings (the syncer's policy may ask for more often)."""
        return heartbeat_s(self.timeouts, self.run.policy)

    def maybe_sync(self, now: float) -> None:
        """Behind the syncer (a broadcast lost, or a welcome on another version): ask, with backoff."""
        run, link = self.run, self.link
        target = max(run.syncer_version, run.finish["version"] if run.finish else -1)
        if not link.joined or not (run.need_state or target > run.version):
            link.behind_since = None
            link.sync_attempt = 0
            return
        if link.behind_since is None:
            link.behind_since = now
        grace = 0.0 if run.need_state else 2 * self.heartbeat_s  # a broadcast may still be on its way
        if now - link.behind_since < grace or now < link.next_sync_at:
            return
        self.outbox.send("sync", {"version": -1 if run.need_state else run.version, "pushed": self.deltas.pushed_ref()})
        link.next_sync_at = now + min(4 * self.timeouts.dead_after_s, 2 * self.heartbeat_s * (2 ** link.sync_attempt))
        link.sync_attempt += 1

    def _maybe_sync_reset(self) -> None:
        if self.run.version >= self.run.syncer_version:
            self.link.behind_since = None
            self.link.sync_attempt = 0
            self.link.next_sync_at = -math.inf

    def _settle_refused(self, code: str, h: dict[str, Any]) -> None:
        """Our delta for (round, base_version) did not count: give its residual back. But "stale" is final only
        when the syncer is behind its base (it rolled back): if it has merged the round since, the broadcast or
        state says whether ours was in; if the round is not open yet (a restarted syncer), it will be, and the
        delta goes again then (a copy sent meanwhile may even be accepted)."""
        where = [h.get("round"), h.get("base_version")]
        if code != Code.STALE and self.run.contributed is not None and list(self.run.contributed) == where:
            self.run.contributed = None  # an earlier session's delta was refused: this session trains the round
            # itself
        p = self.deltas.pushed
        if p is None or [p.round, p.base_version] != where or h.get("digest", p.digest) != p.digest:
            self.deltas.ahead_refused(h)
            return  # not about the delta we hold (e.g. an earlier push of this round), or about a pipelined one
        behind = h.get("version", -1) - p.base_version
        lag = self.run.policy.max_base_lag
        if code == Code.STALE and behind >= 0 and (not lag or behind <= lag):
            p.acked, p.stale, p.on_its_way = False, True, False
            return
        if code == Code.DUPLICATE and h.get("version") == self.run.version:  # another delta of ours holds the round
            self.run.place_held = Place(self.run.version + 1, self.run.version)
        self.deltas.drop_uncounted()

    def _free_place(self, rnd: int, version: int) -> None:
        """The syncer holds no delta of ours in round `rnd` (open on `version`) after all: the late one that held its
        place was refused or lost. The work trained for that round, or carried since, goes to it, not on top of the
        next global (the syncer counts us as training it)."""
        if self.run.place_held is not None and self.run.place_held.matches(rnd, version):
            self.run.place_held = None
        t = self.phases.training
        if t is not None and (t.round, t.base_version) == (rnd, version):
            t.place_taken = False
        if self.phases.carried is not None and self.phases.carried.matches(rnd, version):
            self.phases.enter(Phase.WAITING, f"carry goes back to round {rnd}: the place our late delta held is free")

    def _set_open_round(self, r: dict[str, Any], now: float) -> None:
        cur = self.run.open_round
        if cur is None or r["round"] > cur["round"]:
            self.run.open_round = _with_window_end(r, now)

    # ------------------------------------------------------------------ messages

    def _handlers(self) -> dict[str, Handler]:
        """Each message the syncer sends (protocol.SYNCER_TYPES) and the handler it goes to."""
        return {"welcome": self._on_welcome, "refuse": self._on_refuse, "init_request": self._on_init_request,
                "round": self._on_round, "ack": self._on_ack, "error": self._on_error, "pong": self._on_pong,
                "broadcast": self._on_broadcast, "state": self._on_state, "finish": self._on_finish}

    def _on_other(self, msg: Message, now: float) -> None:
        self.outbox.log("warning", f"ignoring an unexpected {msg.type} from the syncer")

    def _on_welcome(self, msg: Message, now: float) -> None:
        h = msg.header
        policy = RoundPolicy.from_wire(h["policy"])  # (first: a policy we cannot read changes nothing)
        self.link.joined = True
        self.link.busy = False
        self.link.init_sent = None
        self.link.incarnation = h["incarnation"]
        self.run.policy = policy
        index, count = h["shard"]
        self.run.shard = (int(index), int(count))
        self.run.syncer_version = h["version"]
        self._finish_superseded(h)
        for q in self.deltas.ahead:  # (a syncer that restarted lost them: each goes again when it is the oldest in
            # flight)
            q.resend, q.on_its_way = not q.acked, False
        if self.run.global_ is None or self.run.version != h["version"] or self.run.digest != h["digest"]:
            self.run.need_state = True
            self.link.next_sync_at = -math.inf
            # versions from here on may be redefined (a syncer that rolled back): no stale round trained from them
            self.run.lineage = {v: d for v, d in self.run.lineage.items() if v < h["version"] or (
                v == h["version"] and d == h["digest"])}
        self.run.open_round = _with_window_end(h["open_round"], now) if h["open_round"] else None
        self.run.contributed = self.run.place_held = None
        r = self.run.open_round
        p = self.deltas.pushed
        pending = h.get("pending")
        kept = next((q for q in self.deltas.ahead if pending == [q.round, q.base_version, q.digest]), None)
        if r is not None and h["contributed"] and kept is not None:  # (a pipelined delta of ours, taken at its round)
            kept.acked, kept.resend, kept.merge_round = True, False, r["round"]
        elif r is not None and h["contributed"]:
            if p is not None and (pending == [p.round, p.base_version, p.digest] if pending is not None else
                                  [p.round, p.base_version] == [r["round"], r["version"]]):
                p.acked, p.merge_round = True, r["round"]
            elif pending is None or pending[1] == r["version"]:
                self.run.contributed = (r["round"], r["version"])
            else:  # an earlier process's late delta: this round's work goes on top of the next global
                self.run.place_held = Place(r["round"], r["version"])
                t = self.phases.training
                if t is not None and self.run.place_held.matches(t.round, t.base_version):
                    t.place_taken = True
        elif r is not None and p is not None and self.run.may_land(p, r["round"], r["version"]):
            self.deltas.resend_pushed()  # the syncer lost it (it restarted before the delta was saved)
        elif r is not None and p is None:
            self._free_place(r["round"], r["version"])  # (a late delta we knew of is gone)
        self.outbox.log("info", f"joined the syncer at version {h['version']}; policy {self.run.policy.wire()}")
        self.maybe_sync(now)

    def _on_init_request(self, msg: Message, now: float) -> None:
        """Found the run: upload our initial adapter at the run's wire precision. Asked again (our hello was
        repeated while the upload is on its way), we do not start another one: a lost upload is sent again when a
        broken connection is noticed (`link_lost`), and one refused when the request says every copy we sent came
        (`heard`) without counting (the error that said so may have been lost: sim seed 3141721). A copy a broken
        connection took never comes, so only those sent since count (sim seed 913001457)."""
        link = self.link
        if link.joined or (link.init_sent is not None and msg.header.get("heard", 0) < link.init_copies):
            return
        bits = msg.header["bits"]
        descs, frames = encode_fragments(self.layout, self.init_flat, bits)
        self.link.init_sent = ({"fragments": descs}, tuple(frames))
        self.send_init()
        # what the syncer will decode: hold it too, so the welcome finds us current
        flat = np.concatenate([dequantize(fr, f.numel, bits) for fr, f in zip(frames, self.layout.fragments)])
        self.run.global_, self.run.version, self.run.digest = flat, 0, array_digest(flat)
        if self.phases.phase is Phase.JOINING:
            self.phases.enter(Phase.WAITING, "founding the run")
        self.run.lineage = {0: self.run.digest}
        self.outbox.log("info", f"founding the run: sent the initial adapter at {bits} bits")

    def send_init(self) -> None:
        assert self.link.init_sent is not None
        self.link.init_copies += 1
        self.outbox.send("init", *self.link.init_sent)

    def _on_round(self, msg: Message, now: float) -> None:
        h = msg.header
        if h["version"] < self.run.version:
            return
        self.run.syncer_version = max(self.run.syncer_version, h["version"])
        self._set_open_round(h, now)
        p = self.deltas.pushed
        taken = p is not None and p.acked and p.merge_round is not None and p.merge_round < h["round"]
        if p is not None and not p.on_its_way and not taken and self.run.may_land(p, h["round"], h["version"]):
            self.deltas.resend_pushed()  # the syncer announces a round only to those whose delta it lacks (yet; a
            # delta acked into an earlier round was taken there: its broadcast settles it, a copy more would only be a
            # duplicate, and over a slow link a long one)
        self.maybe_sync(now)

    def _on_broadcast(self, msg: Message, now: float) -> None:
        h = msg.header
        self.run.syncer_version = max(self.run.syncer_version, h["version"])
        if h["version"] != self.run.version + 1 or self.run.global_ is None or self.run.need_state:
            return  # a duplicate, or we are further behind: catch-up asks for what is missing
        flat = self.run.global_ + decode_fragments(self.layout, msg, self.run.part(h["round"]))
        digest = array_digest(flat)
        if digest != h["digest"]:
            self.run.need_state = True
            self.outbox.log("warning", f"broadcast {h['version']} does not reproduce the syncer's adapter "
                                       f"({digest} != {h['digest']}): asking for the full state")
            return
        lags = h.get("lags") or [0] * len(h["responders"])
        mine = [[h["round"] - lag, d] for lid, d, lag in zip(h["responders"], h["deltas"], lags)
                if lid == self.island_id]
        self._adopt(h["version"], flat, digest, mine)

    def _on_state(self, msg: Message, now: float) -> None:
        h = msg.header
        if not (self.run.need_state or h["version"] > self.run.version):
            return
        flat = decode_fragments(self.layout, msg)
        if array_digest(flat) != h["digest"]:
            self.outbox.log("warning", f"state {h['version']} arrived damaged; asking again")
            return
        self.run.syncer_version = max(self.run.syncer_version, h["version"])
        self._adopt(h["version"], flat, h["digest"], [list(x) for x in h["merged"]])

    def _adopt(self, version: int, flat: np.ndarray, digest: str, merged: list[list]) -> None:
        """Hold a new global adapter; settle the pushed delta by whether it was among the merged ones
        (`merged`: [round, digest] of this island id's merged deltas the syncer told us about)."""
        run = self.run
        run.global_, run.version, run.digest = flat, version, digest
        run.need_state = False
        if self.phases.phase is Phase.JOINING:
            self.phases.enter(Phase.WAITING, f"the run's version {version} adopted")
        run.lineage = {v: d for v, d in run.lineage.items() if version - run.policy.versions_kept <= v < version}
        run.lineage[version] = digest
        self.deltas.settle(version, merged)
        if run.contributed is not None and run.contributed[1] != version:
            run.contributed = None
        c = self.phases.carried
        if c is not None and (c.version, c.digest) != (version, digest):
            # the global it waited for came (or a rollback took the run elsewhere): carry it
            self.phases.enter(Phase.WAITING, f"carry of round {c.round} ends: version {version} came")
        if run.open_round is not None and run.open_round["version"] < version:
            run.open_round = None
        self._maybe_sync_reset()

    def _on_pong(self, msg: Message, now: float) -> None:
        h = msg.header
        if h["incarnation"] != self.link.incarnation:
            # from a syncer process that is gone, or from one whose welcome we lost (it restarted after the welcome
            # we hold): join it, or we would wait on a process that no longer exists
            if self.link.joined and now - self.link.hello_at >= self.heartbeat_s:
                self.link.joined = False
                if self.deltas.pushed is not None:
                    self.deltas.pushed.resend = True  # the welcome says whether it still has our delta
                self.hello(now)
            return
        self.run.syncer_version = max(self.run.syncer_version, h["version"])
        self._answer_repeated(h.get("answer"), now)
        p = self.deltas.pushed
        c = self.run.contributed
        if c is not None and h["round_open"] and [h["round"], h["version"]] == list(c) and not h["contributed"]:
            self.run.contributed = None  # the earlier session's delta is gone (refused): this session trains the round
        if h["round_open"] and not h["contributed"] and p is None:
            self._free_place(h["round"], h["version"])  # the late delta that held it is gone (refused)
        if h["round_open"] and h["version"] >= self.run.version:  # (trained once we hold that version)
            mine = p is not None and p.round == h["round"]
            if not mine and not (self.run.contributed and self.run.contributed[0] == h["round"]) and (
                    self.phases.training is None or self.phases.training.round != h["round"]):
                self._set_open_round({"round": h["round"], "version": h["version"],
                                      "inner_steps": self.run.policy.inner_steps,
                                      "round_seconds": self.run.policy.round_seconds,
                                      "seconds_left": h.get("seconds_left")}, now)
            if p is not None and self.run.may_land(p, h["round"], h["version"]) and (
                    p.merge_round is None or p.merge_round == h["round"]):
                self._pong_about_pushed(h)
        self.maybe_sync(now)

    def _answer_repeated(self, answer: Any, now: float) -> None:
        """A pong repeats the syncer's last answer about a delta of ours: taken as that ack or error if it answers the
        latest copy of the delta we hold and that copy is still on its way to us as far as we know (its answer, on
        the control connection, was lost). A delta still flowing up a slow link is so never sent twice."""
        p = self.deltas.pushed
        if p is None or not p.on_its_way or not isinstance(answer, dict) or answer.get("digest") != p.digest or \
                answer.get("copy") != p.copies or answer.get("type") not in ("ack", "error"):
            return
        fields = {k: v for k, v in answer.items() if k not in ("type", "copy")}
        try:
            decode(encode(answer["type"], fields))  # (checked against the schema as the message itself would be)
        except ProtocolError:
            return
        self.table[answer["type"]](Message(answer["type"], fields), now)

    def _pong_about_pushed(self, h: dict[str, Any]) -> None:
        """A pong of the round our pushed delta may land in: what it says of that delta."""
        p = self.deltas.pushed
        assert p is not None
        if h["have_delta"]:
            p.acked, p.merge_round = True, h["round"]  # (a pong without it proves nothing: the delta may still be on
            # its way ...)
        elif p.stale:  # (... unless the syncer told us it had no round for it: now it has)
            p.stale = False
            self.deltas.resend_pushed()
        elif p.acked and not h["contributed"]:  # it had it (acked: saved), and with the round still open it holds
            # nothing from us any more: refused (the error saying so was lost). A pong sent after the ack is received
            # after it (one connection, in order), so it is not news from before the delta.
            self.deltas.drop_uncounted()
        elif not p.acked and not p.resend and (not p.on_its_way or h.get("heard") == [p.digest, p.copies]):
            # the syncer lacks it and no copy is on its way (the announcement that would have asked for it was lost
            # with its connection), or the syncer heard our latest copy and holds nothing of ours with no answer
            # saying why (the answer was lost: sim seed 800680): the pong is the syncer's word on what it holds
            self.deltas.resend_pushed()

    def _on_ack(self, msg: Message, now: float) -> None:
        h = msg.header
        p = self.deltas.pushed
        q = self.deltas.ahead_matching(h)
        if q is not None:  # (a pipelined delta, acked once its round opened before the merge before it reached us)
            q.acked, q.on_its_way = True, False
            q.merge_round = h["merge_round"] if isinstance(h.get("merge_round"), int) else None
        if p is not None and [p.round, p.base_version, p.digest] == [h["round"], h["base_version"], h["digest"]]:
            p.acked, p.on_its_way = True, False
            if h.get("merged"):  # sent again after its ack was lost, and merged meanwhile: it counted
                self.deltas.pushed = None
                self.deltas.promote()
            elif isinstance(h.get("merge_round"), int):
                p.merge_round = h["merge_round"]

    def _on_error(self, msg: Message, now: float) -> None:
        h = msg.header
        code = h["code"]
        if code == Code.NOT_JOINED:
            self.link.init_sent = None  # a syncer that forgot us forgot any founding upload too: upload again if asked
            self.deltas.copies_lost()  # a copy that reaches a syncer that forgot us is not taken, a pipelined one's
            # neither (sim seed 506180938: the refusal named no delta, and a pipelined one it refused was waited on
            # forever)
            if self.deltas.pushed is not None:
                self.deltas.pushed.resend = True  # and maybe our delta: the welcome or the round says
            if self.link.joined or now - self.link.hello_at >= self.heartbeat_s:
                self.link.joined = False
                self.hello(now)
        elif code in FINAL_CODES:
            self.link.refused, self.link.refused_code = h["reason"], code
        elif code in (Code.BUSY, Code.ID_TAKEN):
            self.link.joined = False  # hello again later: the session holding our id may be a dead one
            self.link.busy = True
            self.outbox.log("warning", h["reason"])
        elif code in (Code.STALE, Code.REFUSED, Code.DUPLICATE):
            self._settle_refused(code, h)
            self.outbox.log("warning", f"delta not counted ({code}): {h['reason']}")
        else:
            self.outbox.log("warning", f"syncer error ({code}): {h['reason']}")

    def _on_refuse(self, msg: Message, now: float) -> None:
        self.link.refused = f"the syncer refused this island: {msg.header['reason']}"
        self.link.refused_code = msg.header["code"]
        self.outbox.log("error", self.link.refused)

    def _finish_superseded(self, h: dict[str, Any]) -> None:
        """A welcome from another syncer process whose run goes on: a finish we hold from an earlier one (a stop:
        SIGTERM, a full disk) no longer stands, or the island would end with the run still going (sim seed
        192934085: it joined a stopping syncer, then the relaunched one, and exited mid-run)."""
        f = self.run.finish
        if f is None or h["finished"] or f.get("incarnation") == h["incarnation"]:
            return
        self.run.finish = None
        if self.phases.phase is Phase.FINISHING:
            back = Phase.JOINING if self.run.global_ is None else Phase.WAITING
            self.phases.enter(back, f"the syncer's finish ({f['reason']}) was a stop: a restarted syncer goes on with "
                                    "the run")

    def _on_finish(self, msg: Message, now: float) -> None:
        if self.run.finish is None:
            self.run.finish = {**msg.header, "incarnation": self.link.incarnation}  # (whose finish it is)
            self.run.finish_at = now
            self.run.syncer_version = max(self.run.syncer_version, msg.header["version"])
            self.maybe_sync(now)


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
