"""A learner's connection to the syncer: one ZeroMQ DEALER socket with a stable identity.

ZeroMQ reconnects dropped TCP connections by itself (with its own exponential
reconnect interval); what it cannot know is that the syncer on the other end
restarted and forgot us, or that a peer went silent. `SyncerClient` adds that:
heartbeats while waiting, a dead-peer timeout, and a fresh socket after an
exponential backoff with full jitter, so a fleet does not reconnect in lockstep.
"""

from __future__ import annotations

import logging
import random
import time
from typing import Any, Sequence

import zmq

from yeto import YetoError
from yeto.sync.protocol import Message, ProtocolError, decode, encode, message_bytes

log = logging.getLogger("yeto.client")


def parse_address(address: str) -> str:
    """'host:port' (or 'tcp://host:port') -> a ZeroMQ endpoint."""
    a = address.removeprefix("tcp://")
    host, sep, port = a.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise YetoError(f"--syncer must be HOST:PORT, got {address!r}")
    return f"tcp://{host}:{int(port)}"


def backoff_delay(attempt: int, base: float, cap: float, rng: random.Random) -> float:
    """Exponential backoff with full jitter: uniform in [0, min(cap, base * 2**attempt)]."""
    return rng.uniform(0.0, min(cap, base * (2 ** attempt)))


class SyncerClient:
    def __init__(self, address: str, learner_id: int, *, heartbeat_s: float = 5.0, dead_after_s: float = 30.0,
                 backoff_base_s: float = 0.5, backoff_max_s: float = 30.0, give_up_s: float = 1800.0, seed: int | None = None):
        self.endpoint = parse_address(address)
        self.learner_id = learner_id
        self.identity = f"learner-{learner_id}".encode()
        self.heartbeat_s = heartbeat_s
        self.dead_after_s = dead_after_s
        self.backoff_base_s = backoff_base_s
        self.backoff_max_s = backoff_max_s
        self.give_up_s = give_up_s
        self.rng = random.Random(seed if seed is not None else learner_id * 7919 + int(time.time()))
        self.ctx = zmq.Context.instance()
        self.sock: zmq.Socket | None = None
        self.attempt = 0
        self.bytes_sent = 0
        self.bytes_received = 0
        self.last_heard = time.monotonic()
        self.last_sent = 0.0
        self.connect()

    def connect(self) -> None:
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.ROUTING_ID, self.identity)
        self.sock.setsockopt(zmq.LINGER, 2000)
        self.sock.setsockopt(zmq.RECONNECT_IVL, 200)
        self.sock.setsockopt(zmq.RECONNECT_IVL_MAX, int(self.backoff_max_s * 1000))
        self.sock.connect(self.endpoint)
        self.last_heard = time.monotonic()

    def reconnect(self) -> None:
        """Drop the socket (and whatever it had queued), wait a jittered backoff, connect afresh."""
        silent = time.monotonic() - self.last_heard
        if silent > self.give_up_s:
            raise YetoError(f"the syncer at {self.endpoint} has been unreachable for {silent:.0f}s; giving up")
        delay = backoff_delay(self.attempt, self.backoff_base_s, self.backoff_max_s, self.rng)
        self.attempt += 1
        log.warning("syncer at %s silent; reconnecting in %.1fs (attempt %d)", self.endpoint, delay, self.attempt)
        heard = self.last_heard
        self.close(linger=0)
        time.sleep(delay)
        self.connect()
        self.last_heard = heard  # a new socket is not news from the syncer

    def close(self, linger: int = 2000) -> None:
        if self.sock is not None:
            self.sock.close(linger=linger)
            self.sock = None

    def send(self, msg_type: str, header: dict[str, Any] | None = None, frames: Sequence[bytes] = ()) -> int:
        parts = encode(msg_type, {"learner": self.learner_id, **(header or {})}, frames)
        self.sock.send_multipart(parts, copy=False)
        n = message_bytes(parts)
        self.bytes_sent += n
        self.last_sent = time.monotonic()
        return n

    def recv(self, timeout_s: float) -> Message | None:
        """The next valid message within `timeout_s`, or None; heartbeats keep the syncer aware of us."""
        deadline = time.monotonic() + timeout_s
        while True:
            now = time.monotonic()
            if now - self.last_sent > self.heartbeat_s:
                self.send("ping")
            wait = max(0.0, min(deadline - now, self.heartbeat_s))
            if self.sock.poll(int(wait * 1000), zmq.POLLIN):
                parts = self.sock.recv_multipart()
                self.bytes_received += message_bytes(parts)
                self.last_heard = time.monotonic()
                self.attempt = 0
                try:
                    return decode(parts)
                except ProtocolError as e:
                    log.warning("ignoring a malformed message from the syncer: %s", e)
                    continue
            if time.monotonic() >= deadline:
                return None

    @property
    def peer_dead(self) -> bool:
        return time.monotonic() - self.last_heard > self.dead_after_s
