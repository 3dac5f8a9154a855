"""A user-space link emulator: a TCP proxy in front of an island's connections that behaves like a WAN link.

The machine's kernel has no netem, so the link is emulated in the proxy. Each direction of a `Link` is a
bottleneck with a token bucket (a rate in bits per second, shared by all the link's connections, as one access
line is; a `per_connection` profile gives each its own) followed by a delay line: a chunk read at time t leaves
the bottleneck at depart = max(t, previous depart) + bytes / rate and is written out at depart + RTT/2 + jitter,
never before the chunk ahead of it (order is preserved). The bottleneck holds at most `QUEUE_S` of data (a
router's buffer): past that the proxy stops reading, so the sender feels back-pressure as on a real line. A stall
freezes the whole link (both directions, every connection) for `stall_s` at exponential intervals of mean
`stall_every_s` drawn from a seeded RNG; `cut(seconds)` makes it a black hole for a while (nothing moves, new
connections hang) that heals by itself, as a dropped route does. The proxy is byte-transparent, so CURVE runs
through it unchanged.

Link profiles are a small table (`PROFILES`): datacenter, region, home, poor. Every connection direction is
pumped by a reader and a writer thread (threads, not asyncio: each writer sleeps to its chunk's release time, so
the timing does not depend on one event loop keeping up with all the links). The proxy is Python, so it has a
ceiling of its own (bench/wan.py measures it on each run; docs/benchmarks.md): a profile faster than that ceiling
on a loaded machine is capped by the CPU, not by its bucket. Loopback only.

Written by hand: no maintained Python library emulates a shaped, delayed, stalling TCP link in user space
(toxiproxy is a Go server, tc/netem need the kernel module and root).
"""

from __future__ import annotations

import collections
import random
import socket
import struct
import threading
import time
from dataclasses import dataclass, replace
from typing import Optional

from yeto import YetoError

MBIT = 1_000_000  # bits per second
MAX_CHUNK = 65536  # bytes read at once
MIN_CHUNK = 1024
CHUNK_S = 0.005  # a chunk is at most this much of the line's time (finer pacing at low rates)
QUEUE_S = 0.05  # the bottleneck's buffer, in seconds of the line's rate: the proxy stops reading past it
POLL_S = 0.01  # how often a blocked thread looks again (a cut, a stall, a full buffer, closing)


@dataclass(frozen=True)
class Profile:
    """A link as the island sees it. Rates in bits/s (0: unlimited); down = syncer -> island."""

    name: str
    down_bps: float = 0.0
    up_bps: float = 0.0
    rtt_s: float = 0.0
    jitter_s: float = 0.0  # each chunk's one-way delay varies by up to +- this much (order is kept)
    stall_s: float = 0.0  # each stall freezes the link this long ...
    stall_every_s: float = 0.0  # ... at exponential intervals of this mean (0: never)
    per_connection: bool = False  # each connection gets the whole rate (not one line the connections share)


PROFILES: dict[str, Profile] = {p.name: p for p in (
    Profile("unshaped"),  # the proxy alone: no rate limit, no delay
    Profile("datacenter", down_bps=1000 * MBIT, up_bps=1000 * MBIT, rtt_s=0.001),
    Profile("region", down_bps=200 * MBIT, up_bps=200 * MBIT, rtt_s=0.060),
    Profile("home", down_bps=50 * MBIT, up_bps=10 * MBIT, rtt_s=0.040, jitter_s=0.005),
    Profile("poor", down_bps=10 * MBIT, up_bps=2 * MBIT, rtt_s=0.120, jitter_s=0.020, stall_s=2.0,
            stall_every_s=30.0),
)}


def profile(name: str) -> Profile:
    """The profile named `name`, or a YetoError that lists them."""
    if name not in PROFILES:
        raise YetoError(f"no link profile {name!r}: use one of {', '.join(PROFILES)}")
    return PROFILES[name]


class _Bottleneck:
    """One direction's token bucket: the time the line is busy until, shared by the link's connections."""

    def __init__(self) -> None:
        self.free_at = 0.0
        self.lock = threading.Lock()

    def depart(self, nbytes: int, bps: float, now: float) -> float:
        with self.lock:
            start = max(now, self.free_at)
            self.free_at = start + (nbytes * 8 / bps if bps else 0.0)
            return self.free_at

    def backlog_s(self, now: float) -> float:
        return self.free_at - now


class Link:
    """A proxy on 127.0.0.1:`port` to 127.0.0.1:`target_port`, shaped by `shape` (a Profile)."""

    def __init__(self, target_port: int, shape: Profile = PROFILES["unshaped"], seed: int = 0):
        self.target = ("127.0.0.1", target_port)
        self.shape = shape
        self.rng = random.Random(seed)
        self.lock = threading.Lock()
        self.up, self.down = _Bottleneck(), _Bottleneck()
        self.bytes_up = 0  # delivered to the syncer
        self.bytes_down = 0  # delivered to the island
        self.stalls: list[tuple[float, float]] = []  # (start, end) of every stall that began, monotonic
        self.cut_until = 0.0
        self.t0 = time.monotonic()
        self.next_stall = self._draw_stall(self.t0)
        self.closed = False
        self.socks: list[socket.socket] = []
        self.listener = socket.socket()
        self.listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.listener.bind(("127.0.0.1", 0))
        self.listener.listen(64)
        self.listener.settimeout(POLL_S * 10)
        self.port = self.listener.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True, name=f"netem-{self.port}").start()

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def reshape(self, shape: Profile) -> None:
        """Change the link's profile from now on (the stall schedule restarts)."""
        with self.lock:
            self.shape = shape
            self.next_stall = self._draw_stall(time.monotonic())

    def throttle_up(self, bytes_per_s: Optional[float], per_connection: bool = False) -> None:
        """Limit the island-to-syncer rate (None: unlimited), keeping the rest of the profile; `per_connection`:
        each connection at that rate (a slow bulk upload that does not delay the heartbeats' connection)."""
        self.reshape(replace(self.shape, up_bps=8 * bytes_per_s if bytes_per_s else 0.0,
                             per_connection=per_connection))

    def cut(self, seconds: float) -> None:
        """A black hole for `seconds`: nothing moves, new connections hang; then it heals by itself."""
        self.cut_until = time.monotonic() + seconds

    def heal(self) -> None:
        """End a cut now: the connections hanging in it go through."""
        self.cut_until = 0.0

    def close(self) -> None:
        self.closed = True
        for s in [self.listener, *self.socks]:
            try:
                s.close()
            except OSError:
                pass

    def blocked_until(self, now: float) -> float:
        """The time the link is frozen until (a cut or a stall), or 0.0 when it is not frozen now."""
        with self.lock:
            while self.next_stall is not None and now >= self.next_stall[1]:
                self.next_stall = self._draw_stall(self.next_stall[1])
            stall = self.next_stall
            if stall is not None and now >= stall[0] and (not self.stalls or self.stalls[-1] != stall):
                self.stalls.append(stall)
            frozen = stall[1] if stall is not None and now >= stall[0] else 0.0
        until = max(frozen, self.cut_until)
        return until if until > now else 0.0

    def _draw_stall(self, after: float) -> Optional[tuple[float, float]]:
        s = self.shape
        if not (s.stall_s and s.stall_every_s):
            return None
        start = after + self.rng.expovariate(1 / s.stall_every_s)
        return start, start + s.stall_s

    def _wait_unfrozen(self) -> None:
        while not self.closed and self.blocked_until(time.monotonic()):
            time.sleep(POLL_S)

    def _accept(self) -> None:
        while not self.closed:
            try:
                client, _ = self.listener.accept()
            except (socket.timeout, OSError):
                continue
            threading.Thread(target=self._serve, args=(client,), daemon=True).start()

    def _serve(self, client: socket.socket) -> None:
        self._wait_unfrozen()  # a new connection during a cut or a stall hangs until it heals
        try:
            server = socket.create_connection(self.target)
        except OSError:  # nothing listens there: the island gets a reset, as a refused connection gives
            client.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            client.close()
            return
        for s in (client, server):
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.socks += [client, server]
        seed = self.rng.random()
        _Pipe(self, client, server, up=True, seed=seed).start()
        _Pipe(self, server, client, up=False, seed=seed + 1).start()


class _Pipe:
    """One direction of one connection: a reader that paces chunks into the bottleneck, a writer that releases them
    at their time."""

    def __init__(self, link: Link, src: socket.socket, dst: socket.socket, up: bool, seed: float):
        self.link, self.src, self.dst, self.up = link, src, dst, up
        self.shared = link.up if up else link.down
        self.own = _Bottleneck()  # (used under a per_connection profile)
        self.rng = random.Random(seed)
        self.queue: collections.deque[tuple[float, Optional[bytes]]] = collections.deque()
        self.ready = threading.Condition()
        self.last_release = 0.0

    def start(self) -> None:
        threading.Thread(target=self._read, daemon=True).start()
        threading.Thread(target=self._write, daemon=True).start()

    @property
    def bottleneck(self) -> _Bottleneck:
        return self.own if self.link.shape.per_connection else self.shared

    def _rate(self) -> float:
        s = self.link.shape
        return s.up_bps if self.up else s.down_bps

    def _read(self) -> None:
        link = self.link
        data: Optional[bytes] = b""
        try:
            self.src.settimeout(POLL_S * 10)
            while not link.closed:
                link._wait_unfrozen()
                bps = self._rate()
                while bps and not link.closed:
                    ahead_s = self.bottleneck.backlog_s(time.monotonic()) - QUEUE_S  # (read once: the clock moves)
                    if ahead_s <= 0:
                        break
                    time.sleep(min(POLL_S, ahead_s))
                chunk = int(min(MAX_CHUNK, max(MIN_CHUNK, bps / 8 * CHUNK_S))) if bps else MAX_CHUNK
                try:
                    data = self.src.recv(chunk)
                except socket.timeout:
                    continue
                if not data:
                    break
                self._enqueue(data, bps)
        except OSError:
            pass
        self._put(time.monotonic(), None)  # the end: the writer closes both sides once the data ahead is out

    def _enqueue(self, data: bytes, bps: float) -> None:
        s, now = self.link.shape, time.monotonic()
        depart = self.bottleneck.depart(len(data), bps, now)
        delay = s.rtt_s / 2 + (self.rng.uniform(-s.jitter_s, s.jitter_s) if s.jitter_s else 0.0)
        self.last_release = max(self.last_release, depart + max(0.0, delay))
        self._put(self.last_release, data)

    def _put(self, release: float, data: Optional[bytes]) -> None:
        with self.ready:
            self.queue.append((release, data))
            self.ready.notify()

    def _write(self) -> None:
        link = self.link
        try:
            while not link.closed:
                with self.ready:
                    while not self.queue and not link.closed:
                        self.ready.wait(POLL_S * 10)
                    if link.closed:
                        break
                    release, data = self.queue.popleft()
                if data is None:
                    break
                while (wait := release - time.monotonic()) > 0 and not link.closed:
                    time.sleep(min(wait, POLL_S * 10))
                link._wait_unfrozen()  # a cut or stall while the chunk was in flight: it is held, not lost
                self.dst.sendall(data)
                with link.lock:
                    if self.up:
                        link.bytes_up += len(data)
                    else:
                        link.bytes_down += len(data)
        except OSError:
            pass
        finally:
            for s in (self.src, self.dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
                s.close()
