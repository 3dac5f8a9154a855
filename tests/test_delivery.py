"""The syncer's send rules (yeto.sync.core.delivery) over a scripted transport: one adapter in flight per connection,
at most one global waiting, the newest global wins, and a message the transport cannot take is retried, then dropped.
The real server runs the same class over ZeroMQ (tests/test_slow_links.py), the simulator over its slow links."""

from __future__ import annotations

import pytest

from yeto.sync.core.delivery import SEND_RETRY_S, Delivery, Outgoing, Undeliverable

BULK, CTL = b"island-1-s/bulk", b"island-1-s"


class Transport:
    """Takes messages while `up`; each adapter stays on the wire until `finish` releases it."""

    def __init__(self):
        self.sent: list[tuple[str, int]] = []
        self.on_wire: list[list[bool]] = []
        self.up = True

    def hand_over(self, p: Outgoing):
        if not self.up:
            raise Undeliverable("not connected")
        self.sent.append((p.type, p.version))
        if p.type not in ("broadcast", "state"):
            return None
        flag = [False]
        self.on_wire.append(flag)
        return lambda: flag[0]

    def finish(self) -> None:
        self.on_wire.pop(0)[0] = True


def msg(kind: str, version: int = -1, dest: bytes = BULK, at: float = 0.0) -> Outgoing:
    return Outgoing(dest, [b"x" * 100], at, kind, version)


@pytest.fixture
def rig():
    t, notes = Transport(), []
    return t, notes, Delivery(t.hand_over, lambda event, fields: notes.append((event, fields)))


def test_a_slow_reader_gets_one_adapter_at_a_time_and_then_only_the_newest(rig):
    t, notes, d = rig
    assert d.send(msg("broadcast", 1))
    assert not d.send(msg("broadcast", 2))  # waits behind the one on the wire
    assert not d.send(msg("broadcast", 3))  # replaces it; and, its base (2) never to arrive, is not sent either
    assert not d.send(msg("state", 1))  # the catch-up's answer waits its turn
    assert d.send(msg("pong", dest=CTL))  # control messages never wait behind an adapter
    assert d.held_bytes(lambda dest: dest == BULK) == 200  # one on the wire, one waiting: bounded
    t.finish()
    d.retry(1.0)
    assert t.sent == [("broadcast", 1), ("pong", -1), ("state", 1)]
    reasons = [f["reason"] for e, f in notes if e == "send_superseded"]
    assert reasons[0] == "version 3 came while it waited" and "its base did not reach" in reasons[1]
    t.finish()
    d.retry(2.0)
    assert d.held_bytes(lambda dest: True) == 0
    assert d.send(msg("state", 1))  # (asked for again once delivered: sent again)


def test_the_same_global_on_its_way_is_not_sent_again(rig):
    t, notes, d = rig
    d.send(msg("state", 4))
    assert not d.send(msg("state", 4))
    assert notes == [("send_superseded", {"peer": BULK.decode(), "type": "state", "version": 4,
                                          "reason": "the same global is on its way"})]


def test_a_message_the_transport_cannot_take_is_retried_then_dropped_on_the_tape(rig):
    t, notes, d = rig
    t.up = False
    assert not d.send(msg("finish", dest=CTL, at=0.0))
    d.retry(SEND_RETRY_S / 2)
    assert t.sent == [] and not notes  # still waiting
    t.up = True
    d.retry(SEND_RETRY_S / 2 + 1)
    assert t.sent == [("finish", -1)]
    t.up = False
    d.send(msg("finish", dest=CTL, at=100.0))
    d.retry(100.0 + SEND_RETRY_S + 1)
    assert notes == [("send_dropped", {"peer": CTL.decode(), "type": "finish", "reason": "not connected"})]
