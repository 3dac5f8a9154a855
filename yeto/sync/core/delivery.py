"""The syncer's send rules, per island connection: what goes now, what waits, what a newer global replaces.

A slow reader (a home line taking minutes for one adapter) must never hold the syncer's memory or delay anyone else,
so an adapter-carrying message (broadcast, state) is handed to the transport one at a time per connection: the next
waits here until the transport has released the previous one (`InFlight.done`). At most one global waits per
connection: a newer one replaces an older one still waiting, the same one asked for again is not queued twice, and a
broadcast whose base that island will not hold (the one before it was replaced) is not sent at all (its catch-up
asks for a state of the latest global). A message the transport cannot take now (its pipe full, the island not
connected) waits and is retried for SEND_RETRY_S, then dropped; beyond MAX_BACKLOG_PER_PEER messages or
MAX_BACKLOG_BYTES_PER_PEER bytes the oldest go. Islands notice every dropped message from versions and ask again.

Pure: the transport is a callback (`hand_over`), time comes in as arguments and what happened goes out through `note`
(the tape's `send_superseded` and `send_dropped`), so the syncer's shell (ZeroMQ) and the simulator (a link of
limited bandwidth) run the same rules.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Any, Callable, Hashable, Optional

from yeto.sync.wire.protocol import is_bulk

SEND_RETRY_S = 15.0  # a message that cannot be delivered is retried this long, then dropped (on the tape)
MAX_BACKLOG_PER_PEER = 256  # messages waiting for one connection; beyond, its oldest are dropped (it asks again)
MAX_BACKLOG_BYTES_PER_PEER = 512 << 20  # beyond this, the oldest messages waiting for one connection are dropped
GLOBAL_TYPES = frozenset({"broadcast", "state"})  # they carry the global adapter: a newer one makes an older one moot


class Undeliverable(Exception):
    """The transport cannot take the message now; `reason` goes on the tape if it is dropped in the end."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


@dataclass
class Outgoing:
    """One message for one connection (`dest`), encoded."""

    dest: Hashable
    parts: list[bytes]
    since: float  # when it was first offered (a retry is measured from then)
    type: str
    version: int = -1  # of the global a broadcast or state carries

    @property
    def nbytes(self) -> int:
        return sum(len(p) for p in self.parts)


@dataclass
class InFlight:
    """The adapter-carrying message the transport holds for one connection, until `done()` says it let go."""

    done: Callable[[], bool]
    type: str
    version: int
    nbytes: int


# hand_over(message) sends it now and returns, for an adapter-carrying one, its "released yet?" probe (else None);
# it raises Undeliverable when the transport cannot take it now
HandOver = Callable[[Outgoing], Optional[Callable[[], bool]]]
Note = Callable[[str, dict[str, Any]], None]


class Delivery:
    def __init__(self, hand_over: HandOver, note: Note):
        self.hand_over, self.note = hand_over, note
        self.backlog: dict[Hashable, deque[Outgoing]] = {}  # per destination, in order
        self.inflight: dict[Hashable, InFlight] = {}  # per bulk destination: the adapter the transport still holds
        self.last_global: dict[Hashable, int] = {}  # per bulk destination: the newest global sent or waiting

    def send(self, p: Outgoing) -> bool:
        """Send now, or keep it waiting behind what waits for its connection (or drop it under the rules above);
        True if it went now."""
        if p.type in GLOBAL_TYPES and not self._keep_global(self.backlog.get(p.dest, deque()), p):
            return False
        if self.backlog.get(p.dest) or self.busy(p.dest):  # keep per-connection order: behind what waits
            self._park(p)
            return False
        try:
            self._hand_over(p)
            return True
        except Undeliverable:
            self._park(p)
            return False

    def retry(self, now: float) -> None:
        """Hand over what waits where its connection is free; drop what waited past SEND_RETRY_S."""
        for dest in list(self.backlog):
            q = self.backlog[dest]
            while q:
                p = q[0]
                if self.busy(dest):  # waiting behind an adapter on its way is not a failure to deliver
                    p.since = now
                    break
                try:
                    self._hand_over(p)
                    q.popleft()
                except Undeliverable as e:
                    if now - p.since < SEND_RETRY_S:
                        break
                    q.popleft()
                    self._dropped(p, e.reason)
            if not q:
                del self.backlog[dest]
        for dest in list(self.inflight):
            self.busy(dest)  # (forgets what has left)

    def busy(self, dest: Hashable) -> bool:
        """The transport still holds an adapter for this connection: the next one waits here."""
        f = self.inflight.get(dest)
        if f is not None and f.done():
            del self.inflight[dest]
            return False
        return f is not None

    def held_bytes(self, matches: Callable[[Hashable], bool]) -> int:
        """Bytes waiting here or held by the transport for the connections `matches` picks."""
        held = sum(p.nbytes for dest, q in list(self.backlog.items()) if matches(dest) for p in list(q))
        return held + sum(f.nbytes for dest, f in list(self.inflight.items()) if matches(dest) and not f.done())

    def _hand_over(self, p: Outgoing) -> None:
        done = self.hand_over(p)
        if is_bulk(p.type) and done is not None:
            self.inflight[p.dest] = InFlight(done, p.type, p.version, p.nbytes)

    def _park(self, p: Outgoing) -> None:
        q = self.backlog.setdefault(p.dest, deque())
        q.append(p)
        while len(q) > MAX_BACKLOG_PER_PEER or (len(q) > 1 and sum(x.nbytes for x in q) > MAX_BACKLOG_BYTES_PER_PEER):
            self._dropped(q.popleft(), "too much waiting for this island")

    def _keep_global(self, q: deque[Outgoing], p: Outgoing) -> bool:
        """At most one global waits per connection, and none that its island cannot use. False: `p` is not sent."""
        f = self.inflight.get(p.dest) if self.busy(p.dest) else None
        if f is not None and (f.type, f.version) == (p.type, p.version):
            self._superseded(p, "the same global is on its way")
            return False
        if any((x.type, x.version) == (p.type, p.version) for x in q):
            self._superseded(p, "the same global is waiting")
            return False
        older = [x for x in q if x.type in GLOBAL_TYPES]
        for x in older:
            q.remove(x)
            self._superseded(x, f"version {p.version} came while it waited")
        if older and f is not None:
            self.last_global[p.dest] = f.version
        elif older:
            self.last_global.pop(p.dest, None)  # (not known what the island holds)
        base = self.last_global.get(p.dest)
        if p.type == "broadcast" and base is not None and base < p.version - 1:  # (>=: a catch-up's answer again)
            self._superseded(p, "its base did not reach the island (its catch-up gets a state of the latest global)")
            return False
        self.last_global[p.dest] = p.version
        return True

    def _superseded(self, p: Outgoing, reason: str) -> None:
        self.note("send_superseded", {"peer": _peer(p.dest), "type": p.type, "version": p.version, "reason": reason})

    def _dropped(self, p: Outgoing, reason: str) -> None:
        self.note("send_dropped", {"peer": _peer(p.dest), "type": p.type, "reason": reason})


def _peer(dest: Hashable) -> str:
    return (dest.decode(errors="replace") if isinstance(dest, bytes) else str(dest))[:80]
