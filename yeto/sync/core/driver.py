"""The open round's driver: it opens rounds, closes them by `rounds.close_decision`, and ends the run.

`RoundDriver` applies the pure rules of `rounds` to the run's state: a round opens once the run is founded (round 1
once its gate passed: --islands, or quorum plus --straggler-timeout) and is sent to every live member without a
delta in; it closes into the merge transaction (`merging.Merging.close_round`), keeps waiting, or gives the run up
short of quorum; the finish tells every island and lingers until each had its chance to fetch the final adapter.
The concerns that may open or close a round (a join, a delta, a merge, a start) call it through the core.
"""

from __future__ import annotations

import math
from typing import Optional

from yeto.sync.core.actions import ClearGivenUp, Exit
from yeto.sync.core.deltas import Deltas
from yeto.sync.core.merging import Merging
from yeto.sync.core.rounds import (ClosePolicy, OpenRound, Pace, RoundMembers, RoundPhase, Verdict, close_decision,
                                   round_header)
from yeto.sync.core.state import SyncerOutbox, SyncerState

QUORUM_WAIT_LOG_S = 15.0  # how often a round short of quorum says whom it waits for
PROGRESS_LOG_S = 60.0  # how often a slow round says whom it waits for
FINISH_LINGER_TIMEOUTS = 10  # after the finish, serve stragglers at most this many --island-timeouts
# ... and longer, up to this many, while an island that still answers has not got the final adapter (a slow reader:
# a 70B-class adapter down a home line takes most of an hour)
FINISH_MAX_LINGER_TIMEOUTS = 60
FINISH_GRACE_TIMEOUTS = 3  # ... and wait for an island gone silent (asleep?) until it is silent this many


class RoundDriver:
    """Opens, closes and ends the run's rounds (`SyncerCore` calls it after each event that may change them)."""

    def __init__(self, state: SyncerState, outbox: SyncerOutbox, deltas: Deltas, merging: Merging):
        self.state = state
        self.outbox = outbox
        self.deltas = deltas  # the pipelined deltas a round takes as it opens
        self.merging = merging  # the merge transaction a round closes into

    def maybe_open(self, now: float) -> None:
        """Open the next round (or finish, after the last): once the run is founded, and round 1 once its gate passed;
        every live member without a delta in is sent the round."""
        s = self.state
        run = s.run
        if run is None or s.round is not None or s.finished_at is not None:
            return
        if run.version >= s.cfg.outer_steps:
            self.finish("outer steps done", now, code=0, complete=True)
            return
        if not s.started and not self._gate_passed(now):
            return
        s.started = True
        self.take_back_give_ups()
        s.round = OpenRound(run.version + 1, run.version, now,
                            ends_at=now + s.cfg.round_seconds if s.cfg.round_seconds else math.inf)
        header = round_header(s.cfg, s.round, now)
        members = []
        for m in s.live():
            if m.island not in s.pending:
                self.outbox.send(m.peer, "round", header)
                members.append(m.island)
        self.outbox.record("round_open", round=s.round.number, version=run.version, members=sorted(members),
                           restored=sorted(s.pending))
        self.outbox.log("info", f"round {s.round.number} open with islands {sorted(members)}")
        self.deltas.take_ahead(now)
        self.maybe_close(now)

    def take_back_give_ups(self) -> None:
        """Given-up islands that are back (its fleet extended, or started by hand) and still live are counted on
        again from the round about to open, the quorum raised by the same rule. The mark goes first, so that a
        restart never reads the record with the mark still there."""
        s = self.state
        live = {m.island for m in s.live()}
        for lid in sorted(s.returning & live & s.given_up.keys()):
            del s.given_up[lid]
            self.outbox.add(ClearGivenUp(lid))
            self.outbox.record("given_up_cleared", island=lid, quorum=s.quorum())
            self.outbox.log("info", f"island {lid}, given up, is back; quorum now {s.quorum()}")
        s.returning.clear()

    def _gate_passed(self, now: float) -> bool:
        """Round 1 waits for --islands (less those given up), or for quorum plus --straggler-timeout."""
        s = self.state
        live = len(s.live())
        if live < s.quorum():
            s.gate_since = None
            return False
        if s.gate_since is None:
            s.gate_since = now
        return live >= s.cfg.islands - s.given_up_count() or now - s.gate_since >= s.cfg.straggler_timeout

    def round_members(self, now: float) -> RoundMembers:
        """The open round's responders, and whom it expects: the live members that have not answered, and (for a
        --island-timeout after a restart) the members known before it that may still come back."""
        s = self.state
        live = s.live()
        waiting = {m.island: Pace(m.since, m.round_s, m.step_s)
                   for m in sorted(live, key=lambda m: m.island) if m.island not in s.pending}
        absent: tuple[int, ...] = ()
        if now < s.absent_until:
            here = {m.island for m in live}
            absent = tuple(sorted(lid for lid in s.seen if lid not in here and lid not in s.pending))
        counting = s.counting()
        return RoundMembers(tuple(sorted(s.pending)), sum(1 for d in counting if d.lag == 0), waiting, absent,
                            len(counting))

    def _close_policy(self) -> ClosePolicy:
        s = self.state
        cfg = s.cfg
        return ClosePolicy(s.quorum(), cfg.grace_cap_s, cfg.straggler_timeout, cfg.quorum_timeout,
                           cfg.round_seconds, s.merge_s)

    def maybe_close(self, now: float) -> None:
        """Apply the round's `close_decision`: merge it, keep waiting, or give the run up short of quorum."""
        r = self.state.round
        if r is None:
            return
        members = self.round_members(now)
        d = close_decision(r, members, now, self._close_policy())
        r.quorum_at, r.fresh_at = d.quorum_at, d.fresh_at
        r.enter(RoundPhase.OPEN if d.verdict in (Verdict.SHORT, Verdict.QUORUM_TIMEOUT) else RoundPhase.GRACE)
        if d.verdict is Verdict.CLOSE:
            if self.merging.close_round(now, stragglers=list(d.waiting_for)):
                self.maybe_open(now)
        elif d.verdict is Verdict.QUORUM_TIMEOUT:
            self._give_up_round(r, members, now)
        elif d.verdict is Verdict.SHORT:
            self._log_wait(r, members, now)

    def _give_up_round(self, r: OpenRound, members: RoundMembers, now: float) -> None:
        s = self.state
        q = s.quorum()
        responders = list(members.responders)
        self.outbox.record("quorum_timeout", round=r.number, responders=responders, quorum=q)
        self.outbox.log("error", f"round {r.number} did not reach quorum {q} within {s.cfg.quorum_timeout:g}s "
                                 f"({len(responders)} responded): giving up")
        self.finish(f"round {r.number} did not reach quorum {q}", now, code=3, complete=False)

    def _log_wait(self, r: OpenRound, members: RoundMembers, now: float) -> None:
        """Say, now and then, whom a round short of quorum waits for; on the tape too when those present cannot
        reach it (the run is stuck until someone (re)joins)."""
        s = self.state
        q = s.quorum()
        responders, waiting = list(members.responders), list(members.waiting)
        short = len(responders) + len(members.expected) < q
        if now - max(r.opened_at, r.last_wait_log) < (QUORUM_WAIT_LOG_S if short else PROGRESS_LOG_S):
            return
        r.last_wait_log = now
        if not short:
            self.outbox.log("info", f"round {r.number}: {len(responders)}/{q} responders so far, waiting for {waiting}")
            return
        gone = sorted(lid for lid in s.seen if lid not in {m.island for m in s.live()}
                      and lid not in s.pending)
        self.outbox.record("quorum_wait", round=r.number, responders=responders, waiting=waiting, gone=gone,
                           quorum=q, short=short)
        self.outbox.log("warning", f"round {r.number} cannot reach quorum {q} with the islands present "
                                   f"({len(responders)} responded {responders}, training {waiting}, gone {gone}); "
                                   f"waiting up to {s.cfg.quorum_timeout - (now - r.opened_at):.0f}s more for "
                                   "islands to (re)join")

    # ------------------------------------------------------ the finish

    def finish(self, reason: str, now: float, code: int, complete: bool, linger_s: Optional[float] = None) -> None:
        s = self.state
        s.finished_at = now
        s.linger_until = now + (FINISH_LINGER_TIMEOUTS * s.cfg.island_timeout if linger_s is None else linger_s)
        s.linger_for_fetchers = linger_s is None
        if s.round is not None:
            s.round.advance(RoundPhase.ABANDONED)
        s.round = None
        s.ahead = {}
        s.finish_header = {"version": s.version, "reason": reason, "complete": complete, "code": code}
        for m in s.active():
            self.outbox.send(m.peer, "finish", s.finish_header_for_wire())
        self.outbox.record("finish", version=s.version, reason=reason, code=code, complete=complete,
                           outstanding=sorted(s.pending))
        if self._all_gone(now):
            self.exit()

    def _fetching_final(self, now: float) -> bool:
        """A live island (heard within --island-timeout) still says it holds an older version than the final one."""
        s = self.state
        return any(m.held_version < s.version and now - m.last_seen <= s.cfg.island_timeout
                   for m in s.active())

    def _all_gone(self, now: float) -> bool:
        """After the finish: has every island had its chance to get it (and the final adapter)? Each one left, or
        has been silent for a while (an island asleep when the run ended comes back for it), and right after a
        restart the islands known before it had their grace to say hello."""
        s = self.state
        grace = FINISH_GRACE_TIMEOUTS * s.cfg.island_timeout
        not_back = [lid for lid in s.seen if lid not in s.members]
        return (not not_back or now >= s.absent_until) and all(
            m.left or now - m.last_seen >= grace for m in s.members.values()) and all(
            now - t >= grace for t in s.knocking.values())

    def end_when_done(self, now: float) -> None:
        """After the finish: exit once every island had its chance to fetch the final adapter, or the linger is over
        (longer while an island that still answers fetches it, never past FINISH_MAX_LINGER_TIMEOUTS)."""
        s = self.state
        lingered = now >= s.linger_until and not (s.linger_for_fetchers and self._fetching_final(now))
        if self._all_gone(now) or lingered or now >= s.finished_at + FINISH_MAX_LINGER_TIMEOUTS * s.cfg.island_timeout:
            self.exit()

    def exit(self) -> None:
        s = self.state
        if s.exit_code is None:
            s.exit_code = int(s.finish_header.get("code", 0)) if s.finish_header else 0
            self.outbox.add(Exit(s.exit_code))
