"""Who may talk to the syncer: CURVE on the sockets and the ZAP gatekeeper that answers each handshake.

Encryption and authentication are ZeroMQ's own CURVE (libzmq does the crypto); this module sets CURVE on the
sockets and answers ZAP requests (ZeroMQ RFC 27) from the run's keys (`yeto.sync.shell.keys`).

Why a ZAP handler of our own instead of pyzmq's `Authenticator`: the syncer
must record each refusal with the peer's address and reason, map a key to the
island id it is bound to (ZAP's User-Id, which the syncer sees on every
message), cap island connections and the sockets still in their handshake,
and run inside its own poll loop. pyzmq's credentials callback sees only the key. The handler is a few lines of frame
parsing; nothing cryptographic happens here.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from typing import Optional

import zmq
from zmq.utils import z85
from zmq.utils.monitor import recv_monitor_message

from yeto.sync.core.limits import RateLimit
from yeto.sync.shell.keys import JoinKey, Keyring

ZAP_ENDPOINT = "inproc://zeromq.zap.01"
ZAP_VERSION = b"1.0"
HANDSHAKE_IVL_MS = 10_000  # a connection that has not finished its handshake by then is closed (by libzmq)
HANDSHAKED_AFTER_S = HANDSHAKE_IVL_MS / 1000 + 2.0  # a socket still open this long after its accept has finished its
# handshake (libzmq would have closed it otherwise); the margin covers monitor events still on their way
PENDING_PER_ADDRESS = 16  # sockets waiting for their handshake from one source address; beyond, its oldest is cut
PENDING_TOTAL = 256  # ... and from all addresses together (a stranger with many addresses)
ZAP_OK = b"200"
ZAP_TEMPORARY = b"300"  # RFC 27: a temporary failure; CURVE then drops the client silently and it reconnects
ZAP_DENIED = b"400"  # RFC 27: an authentication failure; the client's monitor sees it (final for an island)
REFUSALS_RECORDED_PER_WINDOW = 20  # refusals of a kind written to the tape one by one per window; the rest counted
REFUSAL_WINDOW_S = 60.0  # that budget's window: a flood of one kind costs the tape at most 20 lines a minute

HANDSHAKE_FAILURES = {  # libzmq's ZMQ_PROTOCOL_ERROR_ZMTP_* codes a stranger's connection ends with
    0x11000001: "handshake failed: a message that does not decrypt with this syncer's key (another run's join key?)",
    0x11000002: "handshake failed: no CURVE (a peer without a join key, or plain TCP)",
}


def curve_server(sock: zmq.Socket, ring: Keyring) -> None:
    sock.curve_server = True
    sock.curve_publickey = ring.syncer_public
    sock.curve_secretkey = ring.syncer_secret
    sock.setsockopt(zmq.HANDSHAKE_IVL, HANDSHAKE_IVL_MS)


def curve_client(sock: zmq.Socket, key: JoinKey) -> None:
    sock.curve_serverkey = key.syncer_public
    sock.curve_publickey = key.public
    sock.curve_secretkey = key.secret


# ---------------------------------------------------------------------------------------------- the gatekeeper


@dataclass(frozen=True)
class ConnectionRefusal:
    address: str
    reason: str


@dataclass(frozen=True)
class Pending:
    """An accepted socket not yet known to have finished its CURVE handshake."""

    address: str  # the peer's IP address ("" if it could not be read)
    accepted_at: float


def peer_address(fd: int) -> str:
    """The IP address of the peer of libzmq's socket `fd` (read from a duplicate: libzmq's fd is left alone)."""
    try:
        with socket.socket(fileno=os.dup(fd)) as s:
            return str(s.getpeername()[0])
    except OSError:  # closed meanwhile, or the number no longer names a TCP socket
        return ""


def cut(fd: int) -> None:
    """End the TCP connection of libzmq's socket `fd`.

    libzmq offers no call to close one accepted connection of a ROUTER, so this shuts the connection down through
    a duplicate of its fd: the peer sees the connection end, libzmq's engine sees end-of-stream on its next read and
    closes its own fd (monitor: DISCONNECTED), so libzmq's bookkeeping stays whole. Closing libzmq's fd itself would
    let the number be reused under libzmq. If libzmq closed `fd` and reused its number since the event that named it
    (events not yet read), this may cut a newer connection: its peer reconnects, nothing else is lost.
    """
    try:
        with socket.socket(fileno=os.dup(fd)) as s:
            if s.type == socket.SOCK_STREAM:
                s.shutdown(socket.SHUT_RDWR)
    except OSError:  # already closed, or not a socket any more
        pass


class Gatekeeper:
    """Answers the ZAP requests of the syncer's socket (every CURVE handshake) and bounds its connections.

    A stranger without a key cannot finish a handshake, so it must not take anyone's place: only connections that
    proved a key count toward `max_connections` (and beyond it a key holder gets a temporary refusal, ZAP 300, which
    its island retries), while the sockets still waiting for their handshake are bounded on their own, per source
    address and in total, by cutting the oldest. libzmq's server-side monitor does not say which socket finished a
    handshake (HANDSHAKE_SUCCEEDED carries no fd, and ZAP names only the peer's IP), so a key approved by ZAP for an
    address marks that address's oldest waiting socket as handshaked, and any socket that outlives the handshake
    timeout has finished one (libzmq closes those that did not). A stranger sharing an island's address may so be
    taken for it for up to the handshake timeout; from other addresses it can only evict its own sockets, or, past
    the total cap, sockets older than the honest handshakes in flight (which take a few round trips).
    """

    def __init__(self, ctx: zmq.Context, ring: Keyring, max_connections: int):
        self.ring = ring
        self.max_connections = max_connections
        self.pending_per_address = PENDING_PER_ADDRESS
        self.pending_total = PENDING_TOTAL
        self.zap = ctx.socket(zmq.REP)
        self.zap.linger = 0
        self.zap.bind(ZAP_ENDPOINT)
        self.monitor: Optional[zmq.Socket] = None
        self.pending: dict[int, Pending] = {}  # fd -> the socket waiting for its handshake, oldest first
        self.handshaked: set[int] = set()  # fds of connections that proved a key (the island connections)
        self.refusals: list[ConnectionRefusal] = []  # for the tape, drained by the syncer
        self.recorded = RateLimit(REFUSALS_RECORDED_PER_WINDOW, REFUSAL_WINDOW_S)
        self.suppressed = 0

    def watch(self, sock: zmq.Socket) -> None:
        self.monitor = sock.get_monitor_socket(zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED | zmq.EVENT_CLOSED
                                               | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
                                               | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL)

    def sockets(self) -> list[zmq.Socket]:
        return [s for s in (self.zap, self.monitor) if s is not None]

    def handle(self, now: float) -> None:
        """Drain the connection events, then answer every waiting ZAP request."""
        self._events(now)
        while self.zap.poll(0):
            request = self.zap.recv_multipart()
            self._events(now)  # (libzmq queues a socket's ACCEPTED before its ZAP request: seen before the answer)
            self._answer(request, now)

    def _events(self, now: float) -> None:
        accepted = False
        while self.monitor is not None and self.monitor.poll(0):
            e = recv_monitor_message(self.monitor)
            if e["event"] == zmq.EVENT_ACCEPTED:
                self.handshaked.discard(e["value"])  # (a number libzmq reused: the old connection is gone)
                self.pending.pop(e["value"], None)  # (... and the new one goes last in the accept order)
                self.pending[e["value"]] = Pending(peer_address(e["value"]), now)
                accepted = True
            elif e["event"] == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL:  # before ZAP: no address is known here
                reason = HANDSHAKE_FAILURES.get(e["value"], f"handshake failed (ZMTP error {e['value']:#x})")
                self._refused(ConnectionRefusal("", reason), now)
            elif e["event"] == zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL:
                self._refused(ConnectionRefusal("", "handshake failed: the peer closed or garbled it (no CURVE, or "
                                                    "plain TCP)"), now)
            else:
                self.pending.pop(e["value"], None)
                self.handshaked.discard(e["value"])
        if accepted:  # (after every event already queued: the fds cut are as fresh as can be known)
            self._bound_pending(now)
        for fd, p in list(self.pending.items()):
            if now - p.accepted_at < HANDSHAKED_AFTER_S:
                break  # (oldest first: the rest are younger)
            self._handshake_done(fd)

    def _handshake_done(self, fd: int) -> None:
        del self.pending[fd]
        self.handshaked.add(fd)

    def _bound_pending(self, now: float) -> None:
        """Cut the oldest sockets waiting for a handshake beyond the per-address and the total cap."""
        per_address: dict[str, list[int]] = {}
        for fd, p in self.pending.items():
            per_address.setdefault(p.address, []).append(fd)
        over = [fd for fds in per_address.values() for fd in fds[:max(0, len(fds) - self.pending_per_address)]]
        for fd in over:
            self._cut(fd, f"pending handshakes from one address over {self.pending_per_address}: the oldest cut", now)
        for fd in list(self.pending)[:max(0, len(self.pending) - self.pending_total)]:
            self._cut(fd, f"pending handshakes over {self.pending_total}: the oldest cut", now)

    def _cut(self, fd: int, reason: str, now: float) -> None:
        p = self.pending.pop(fd)
        cut(fd)
        self._refused(ConnectionRefusal(p.address, reason), now)

    def _answer(self, frames: list[bytes], now: float) -> None:
        if len(frames) < 6:
            return  # not a ZAP request (nothing else can reach an inproc endpoint of our own context)
        version, request_id, _domain, address, _identity, mechanism = frames[:6]
        address_s = address.decode(errors="replace")[:64]
        user, reason, status = b"", "", ZAP_DENIED
        if version != ZAP_VERSION:
            reason = "unsupported ZAP version"
        elif mechanism != b"CURVE" or len(frames) != 7:
            reason = f"mechanism {mechanism.decode(errors='replace')[:16]} (this syncer needs CURVE: a join key)"
        else:
            principal = self.ring.principal(z85.encode(frames[6]))
            if principal is None:  # (the key first: a wrong key is refused for good even when the syncer is full)
                revoked = z85.encode(frames[6]) in self.ring.revoked
                reason = "revoked island key" if revoked else "unknown key (not this run's join key)"
            elif len(self.handshaked) >= self.max_connections:
                status = ZAP_TEMPORARY
                reason = f"too many connections (--max-connections {self.max_connections} reached): retry later"
            else:
                user = principal.encode()
        if user:
            self.zap.send_multipart([ZAP_VERSION, request_id, ZAP_OK, b"OK", user, b""])
            waiting = [fd for fd, p in self.pending.items() if p.address == address_s]
            if waiting:
                self._handshake_done(waiting[0])
            return
        self.zap.send_multipart([ZAP_VERSION, request_id, status, reason.encode()[:200], b"", b""])
        self._refused(ConnectionRefusal(address_s, reason), now)

    def _refused(self, r: ConnectionRefusal, now: float) -> None:
        # budgeted per kind of refusal (its first word: handshake, mechanism, too, unknown, revoked...), so that a
        # flood of one kind (strangers without CURVE) cannot hide another (too many connections) from the tape
        if self.recorded.allow(r.reason.split(" ", 1)[0], now):
            self.refusals.append(r)
        else:
            self.suppressed += 1

    def drain(self) -> tuple[list[ConnectionRefusal], int]:
        """(refusals to record, how many more were refused but not recorded one by one)."""
        out, n = self.refusals, self.suppressed
        self.refusals, self.suppressed = [], 0
        return out, n

    def close(self) -> None:
        for s in self.sockets():
            s.close(linger=0)
