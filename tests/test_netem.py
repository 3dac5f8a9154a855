"""The link emulator on loopback: rate, delay, stalls and cuts as measured from outside, bytes intact and in order,
and a real CURVE syncer round through it."""

import hashlib
import socket
import statistics
import threading
import time

import pytest

from tests.test_faults import assert_run_complete
from tests.test_fleet import finish, start_island, syncer
from yeto import YetoError
from yeto.launch.local import free_port
from yeto.testbed.netem import MBIT, PROFILES, Link, Profile, profile

RATE_TOLERANCE = 0.15


class Sink:
    """A loopback server: each connection either echoes what it gets or swallows it, hashing and timing it."""

    def __init__(self, echo: bool):
        self.echo = echo
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.received = 0
        self.digest = hashlib.sha256()
        self.first = self.last = 0.0
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        conn, _ = self.listener.accept()
        with conn:
            while data := conn.recv(65536):
                now = time.monotonic()
                self.first = self.first or now
                self.last = now
                self.received += len(data)
                self.digest.update(data)
                if self.echo:
                    conn.sendall(data)

    def close(self) -> None:
        self.listener.close()


def connect(link: Link) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", link.port), timeout=30)
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return s


def ping(s: socket.socket, payload: bytes = b"p") -> float:
    t = time.monotonic()
    s.sendall(payload)
    got = b""
    while len(got) < len(payload):
        got += s.recv(len(payload) - len(got))
    assert got == payload
    return time.monotonic() - t


def test_a_bulk_upload_runs_at_the_profile_rate_and_arrives_intact():
    rate = 20 * MBIT
    sink = Sink(echo=False)
    link = Link(sink.port, Profile("test", up_bps=rate, down_bps=4 * rate, rtt_s=0.02))
    payload = bytes(range(256)) * (16 * 1024)  # 4 MiB: 1.7 s at 20 Mbit/s
    try:
        with connect(link) as s:
            s.sendall(payload)
        deadline = time.monotonic() + 30
        while sink.received < len(payload) and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        link.close()
        sink.close()
    assert sink.received == len(payload) and sink.digest.digest() == hashlib.sha256(payload).digest()
    measured = len(payload) * 8 / (sink.last - sink.first)
    assert abs(measured / rate - 1) < RATE_TOLERANCE, f"{measured / MBIT:.1f} Mbit/s through a 20 Mbit/s link"
    assert link.bytes_up == len(payload)


def test_a_bulk_download_runs_at_its_own_rate():
    rate = 24 * MBIT
    sink = Sink(echo=True)
    link = Link(sink.port, Profile("test", up_bps=100 * MBIT, down_bps=rate))
    payload = bytes(range(256)) * (12 * 1024)  # 3 MiB each way
    got = bytearray()
    try:
        with connect(link) as s:
            sender = threading.Thread(target=s.sendall, args=(payload,))
            sender.start()
            t0 = time.monotonic()
            while len(got) < len(payload):
                got += s.recv(65536)
                if len(got) < 65536:
                    t0 = time.monotonic()  # time from the first chunk: the upload's own start is not the downlink's
            took = time.monotonic() - t0
            sender.join()
    finally:
        link.close()
        sink.close()
    assert bytes(got) == payload
    measured = (len(payload) - 65536) * 8 / took
    assert abs(measured / rate - 1) < RATE_TOLERANCE, f"{measured / MBIT:.1f} Mbit/s down a 24 Mbit/s link"


def test_a_ping_pong_measures_the_profile_rtt():
    sink = Sink(echo=True)
    link = Link(sink.port, Profile("test", rtt_s=0.1))
    try:
        with connect(link) as s:
            rtts = [ping(s) for _ in range(8)]
    finally:
        link.close()
        sink.close()
    assert 0.095 < statistics.median(rtts) < 0.14, rtts


def test_jitter_varies_the_delay_but_keeps_the_order():
    sink = Sink(echo=True)
    link = Link(sink.port, Profile("test", rtt_s=0.04, jitter_s=0.02), seed=3)
    payloads = [f"{i:06d}".encode() for i in range(200)]
    try:
        with connect(link) as s:
            rtts = [ping(s) for _ in range(10)]
            for p in payloads:  # many small writes in flight at once: each chunk gets its own jitter
                s.sendall(p)
            want, got = b"".join(payloads), b""
            while len(got) < len(want):
                got += s.recv(65536)
    finally:
        link.close()
        sink.close()
    assert got == want
    assert max(rtts) - min(rtts) > 0.005, rtts  # the delay varies ...
    assert 0.02 < statistics.mean(rtts) < 0.04 + 0.03, rtts  # ... around the profile's RTT


def test_a_stall_freezes_the_link_and_it_resumes_losing_nothing():
    sink = Sink(echo=True)
    link = Link(sink.port, Profile("test", stall_s=0.6, stall_every_s=0.5), seed=1)
    try:
        with connect(link) as s:
            t_end = time.monotonic() + 3.0
            rtts = []
            while time.monotonic() < t_end:
                rtts.append(ping(s, f"{len(rtts):05d}".encode()))
    finally:
        link.close()
        sink.close()
    assert link.stalls, "no stall in 3 s at a mean interval of 0.5 s"
    assert max(rtts) > 0.3, max(rtts)  # a ping caught in a stall waited for it ...
    assert min(rtts) < 0.05  # ... the others went straight through


def test_the_stall_schedule_is_the_seeds():
    def first_stalls(seed):
        link = Link(1, Profile("test", stall_s=1.0, stall_every_s=10.0), seed=seed)
        link.close()
        return link.next_stall[0] - link.t0

    assert first_stalls(7) == first_stalls(7) != first_stalls(8)


def test_a_cut_blackholes_the_link_then_heals_by_itself():
    sink = Sink(echo=True)
    link = Link(sink.port)
    try:
        with connect(link) as s:
            assert ping(s) < 0.5
            link.cut(1.0)
            t = ping(s, b"through the cut")
            assert t > 0.8, t  # held for the cut, then delivered
            assert ping(s) < 0.5
    finally:
        link.close()
        sink.close()
    sink = Sink(echo=True)
    link = Link(sink.port)
    try:
        link.cut(600.0)  # a connection made during a long cut hangs until the cut is healed
        threading.Timer(0.5, link.heal).start()
        with connect(link) as s:
            t = ping(s, b"after the heal")
            assert 0.4 < t < 5.0, t
    finally:
        link.close()
        sink.close()


def test_a_profile_name_that_does_not_exist_says_which_do():
    assert profile("home") is PROFILES["home"]
    with pytest.raises(YetoError, match="no link profile 'dialup'.*datacenter, region, home, poor"):
        profile("dialup")


def test_a_real_curve_syncer_round_through_a_home_link(tiny_model, tmp_path):
    """CURVE's handshake and a whole run through the emulator: an island on `home`, one direct."""
    model, port, s_out = tiny_model("llama"), free_port(), tmp_path / "syncer"
    link = Link(port, PROFILES["home"], seed=0)
    try:
        procs = {"syncer": syncer(port, s_out, "--islands", 2, "--quorum", 2, "--outer-steps", 2, "--inner-steps", 2,
                                  "--sync-bits", 4)}
        procs[0] = start_island(model, port, 0, 2, tmp_path / "l0")
        procs[1] = start_island(model, link.port, 1, 2, tmp_path / "l1")
        outs = finish(procs)
    finally:
        link.close()
    assert_run_complete(s_out, outs, 2, [tmp_path / "l0", tmp_path / "l1"], quorum_of=[0, 1])
    assert link.bytes_up > 0 and link.bytes_down > 0  # island 1's traffic went through the link


@pytest.mark.parametrize("per_connection", [False, True])
def test_connections_share_the_line_unless_per_connection(per_connection):
    """Two bulk uploads at once: on one line each gets half the rate; per connection, each gets all of it."""
    rate, size = 16 * MBIT, 1 << 20
    sinks = [Sink(echo=False), Sink(echo=False)]
    link = Link(sinks[0].port, Profile("test", up_bps=rate, per_connection=per_connection))
    link.target = ("127.0.0.1", sinks[0].port)
    try:
        first = connect(link)
        time.sleep(0.3)  # (the proxy connects to its target on its own thread)
        link.target = ("127.0.0.1", sinks[1].port)  # the second connection goes to the second sink
        second = connect(link)
        senders = [threading.Thread(target=s.sendall, args=(bytes(size),)) for s in (first, second)]
        for t in senders:
            t.start()
        for t in senders:
            t.join(30)
        deadline = time.monotonic() + 30
        while sum(s.received for s in sinks) < 2 * size and time.monotonic() < deadline:
            time.sleep(0.01)
        first.close()
        second.close()
    finally:
        link.close()
        for s in sinks:
            s.close()
    took = max(s.last for s in sinks) - min(s.first for s in sinks)
    alone = size * 8 / rate  # 0.52 s
    assert took == pytest.approx(alone if per_connection else 2 * alone, rel=RATE_TOLERANCE + 0.1), took
