"""Who may talk to the syncer: the run's CURVE credentials, join keys, and the ZAP gatekeeper.

Encryption and authentication are ZeroMQ's own CURVE (libzmq does the crypto);
this module only manages keys and answers ZAP requests (ZeroMQ RFC 27).

- The syncer has one key pair (`<out>/keys/syncer.key_secret`, mode 0600).
- A *join key* (`<out>/join.key`, 0600) is what a learner needs: the syncer's
  public key plus a client key pair the syncer admits. Every learner may share
  it; it can name any learner id not bound to a per-learner key.
- A *learner key* (`yeto keys add`: `<out>/keys/learners/<id>.key`) admits one
  learner id only, and can be revoked (`yeto keys revoke`) without touching the
  others; a revoked key is refused at the handshake and its connections are cut.

Why a ZAP handler of our own instead of pyzmq's `Authenticator`: the syncer
must record each refusal with the peer's address and reason, map a key to the
learner id it is bound to (ZAP's User-Id, which the syncer sees on every
message), cap learner connections and the sockets still in their handshake,
and run inside its own poll loop. pyzmq's credentials callback sees only the key. The handler is a few lines of frame
parsing; nothing cryptographic happens here.
"""

from __future__ import annotations

import ipaddress
import json
import os
import re
import socket
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import zmq
from zmq.auth.certs import load_certificate
from zmq.utils import z85
from zmq.utils.monitor import recv_monitor_message

from yeto import YetoError
from yeto.sync.core.limits import RateLimit

JOIN_KEY_FILE = "join.key"
KEYS_DIR = "keys"
SYNCER_SECRET_FILE = "syncer.key_secret"
LEARNER_KEYS = "learners"
REVOKED_KEYS = "revoked"
JOIN_KEY_ENV = "YETO_JOIN_KEY"
JOIN_PRINCIPAL = "join"  # the ZAP User-Id of a connection authenticated by the shared join key
LEARNER_PRINCIPAL = "learner:"  # ... and of one authenticated by the key of one learner id: "learner:<id>"
ZAP_ENDPOINT = "inproc://zeromq.zap.01"
ZAP_VERSION = b"1.0"
KEY_CHARS = 40  # a z85-encoded CURVE key
KEYS_RESCAN_S = 2.0  # how often the syncer looks for added or revoked learner keys
HANDSHAKE_IVL_MS = 10_000  # a connection that has not finished its handshake by then is closed (by libzmq)
HANDSHAKED_AFTER_S = HANDSHAKE_IVL_MS / 1000 + 2.0  # a socket still open this long after its accept has finished its
# handshake (libzmq would have closed it otherwise); the margin covers monitor events still on their way
PENDING_PER_ADDRESS = 16  # sockets waiting for their handshake from one source address; beyond, its oldest is cut
PENDING_TOTAL = 256  # ... and from all addresses together (a stranger with many addresses)
ZAP_OK = b"200"
ZAP_TEMPORARY = b"300"  # RFC 27: a temporary failure; CURVE then drops the client silently and it reconnects
ZAP_DENIED = b"400"  # RFC 27: an authentication failure; the client's monitor sees it (final for a learner)
REFUSALS_RECORDED_PER_WINDOW = 20  # refusals of a kind written to the tape one by one per window; the rest counted
REFUSAL_WINDOW_S = 60.0  # that budget's window: a flood of one kind costs the tape at most 20 lines a minute

HANDSHAKE_FAILURES = {  # libzmq's ZMQ_PROTOCOL_ERROR_ZMTP_* codes a stranger's connection ends with
    0x11000001: "handshake failed: a message that does not decrypt with this syncer's key (another run's join key?)",
    0x11000002: "handshake failed: no CURVE (a peer without a join key, or plain TCP)",
}
_LINE = re.compile(r'^\s*([a-z-]+)\s*=\s*"?([^"\s]*)"?\s*$')


@dataclass(frozen=True)
class JoinKey:
    """What a learner needs to reach the run: the syncer's public key and an admitted client key pair."""

    syncer_public: bytes
    public: bytes
    secret: bytes
    learner: Optional[int] = None  # bound to this learner id (a per-learner key), or any id (the join key)

    def text(self) -> str:
        lines = ["# yeto join key: admits a learner to one run. Keep it secret (it is a credential);",
                 "# pass it with --join-key FILE or the YETO_JOIN_KEY environment variable.",
                 f'syncer-public-key = "{self.syncer_public.decode()}"',
                 f'public-key = "{self.public.decode()}"',
                 f'secret-key = "{self.secret.decode()}"']
        if self.learner is not None:
            lines.append(f"learner = {self.learner}")
        return "\n".join(lines) + "\n"

    @staticmethod
    def parse(text: str, where: str) -> "JoinKey":
        values: dict[str, str] = {}
        for n, line in enumerate(text.splitlines(), 1):
            if not line.strip() or line.lstrip().startswith("#"):
                continue
            m = _LINE.match(line)
            if not m:
                raise YetoError(f"{where}: line {n} is not `name = \"value\"`: not a yeto join key file")
            values[m.group(1)] = m.group(2)
        missing = [k for k in ("syncer-public-key", "public-key", "secret-key") if k not in values]
        if missing:
            raise YetoError(f"{where}: not a yeto join key (missing {', '.join(missing)}); use the join.key the "
                            "syncer wrote to its --out directory")
        keys = {k: values[k].encode() for k in ("syncer-public-key", "public-key", "secret-key")}
        for k, v in keys.items():
            if len(v) != KEY_CHARS:
                raise YetoError(f"{where}: {k} is not a {KEY_CHARS}-character z85 CURVE key")
        try:
            derived = zmq.curve_public(keys["secret-key"])
        except (zmq.ZMQError, ValueError) as e:
            raise YetoError(f"{where}: secret-key is not a valid CURVE key ({e})") from e
        if derived != keys["public-key"]:
            raise YetoError(f"{where}: public-key does not belong to secret-key: the file is damaged")
        learner = values.get("learner")
        if learner is not None and not learner.isdigit():
            raise YetoError(f"{where}: learner must be a learner id, got {learner!r}")
        return JoinKey(keys["syncer-public-key"], keys["public-key"], keys["secret-key"],
                       int(learner) if learner is not None else None)


def write_secret(path: Path, text: str) -> None:
    """Write a credential readable by its owner only (0600 from the first byte: never world-readable)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.chmod(tmp, 0o600)
    os.replace(tmp, path)


def read_join_key(path: str | Path) -> JoinKey:
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as e:
        raise YetoError(f"cannot read the join key {p}: {e.strerror}. The syncer writes it to <its --out>/join.key")
    return JoinKey.parse(text, str(p))


def learner_join_key(path: Optional[str], insecure: bool, syncer: str) -> Optional[JoinKey]:
    """The join key a learner uses: --join-key FILE, else $YETO_JOIN_KEY (the file's contents); None with
    --insecure (loopback only). A learner without one gets a one-line error saying where to find it."""
    if insecure:
        require_loopback(syncer.removeprefix("tcp://").rpartition(":")[0], "learner --syncer")
        return None
    if path:
        return read_join_key(path)
    env = os.environ.get(JOIN_KEY_ENV)
    if env:
        return JoinKey.parse(env, f"${JOIN_KEY_ENV}")
    raise YetoError(f"no join key: pass --join-key FILE or set {JOIN_KEY_ENV} to that file's contents (the syncer "
                    f"writes it to <its --out>/{JOIN_KEY_FILE}); --insecure only for a syncer on this machine")


def require_loopback(host: str, what: str) -> None:
    """--insecure sends everything in clear and admits anyone: refuse it anywhere but loopback."""
    host = host.strip("[]")
    try:
        addrs = {ipaddress.ip_address(host)}
    except ValueError:
        try:
            addrs = {ipaddress.ip_address(a[4][0]) for a in socket.getaddrinfo(host, None)}
        except OSError:
            addrs = set()
    if not addrs or not all(a.is_loopback for a in addrs):
        raise YetoError(f"--insecure is refused for {what} {host!r}: without security anyone who reaches the port "
                        "can join and read the run. Use it only on 127.0.0.1; elsewhere use the join key")


# ---------------------------------------------------------------------------------------------- the run's keys


@dataclass
class Keyring:
    """The run's credentials on disk, under the syncer's --out."""

    out: Path
    syncer_public: bytes = b""
    syncer_secret: bytes = b""
    join: Optional[JoinKey] = None
    learners: dict[bytes, int] = field(default_factory=dict)  # admitted learner-key public key -> its learner id
    revoked: set[bytes] = field(default_factory=set)
    revoked_ids: set[int] = field(default_factory=set)
    scanned: tuple = ()

    @property
    def keys_dir(self) -> Path:
        return self.out / KEYS_DIR

    @staticmethod
    def ensure(out: str | Path, join_key: Optional[str] = None) -> "Keyring":
        """Load the run's credentials, creating them on first start (`--join-key FILE`: admit that key)."""
        ring = Keyring(Path(out))
        secret_path = ring.keys_dir / SYNCER_SECRET_FILE
        if secret_path.exists():
            public, secret = load_certificate(secret_path)
            if secret is None:
                raise YetoError(f"{secret_path} holds no secret key: restore it, or start a new run with another --out")
        else:
            public, secret = zmq.curve_keypair()
            write_secret(secret_path, f'# the syncer\'s CURVE key pair: keep secret\npublic-key = "{public.decode()}"\n'
                                      f'secret-key = "{secret.decode()}"\n')
        ring.syncer_public, ring.syncer_secret = public, secret
        join_path = ring.out / JOIN_KEY_FILE
        if join_key is not None:
            ring.join = read_join_key(join_key)
            if ring.join.learner is not None:
                raise YetoError(f"{join_key} is the key of learner {ring.join.learner}, not a join key")
            if Path(join_key).resolve() != join_path.resolve():
                write_secret(join_path, ring.join.text())
        elif join_path.exists():
            ring.join = read_join_key(join_path)
        else:
            client_public, client_secret = zmq.curve_keypair()
            ring.join = JoinKey(public, client_public, client_secret)
            write_secret(join_path, ring.join.text())
        if ring.join.syncer_public != public:
            raise YetoError(f"the join key {join_key or join_path} was made for another syncer key "
                            f"({ring.join.syncer_public.decode()[:8]}..., this run's is {public.decode()[:8]}...): "
                            f"use this run's {join_path}, or `yeto keys init` before the syncer's first start")
        ring.rescan()
        return ring

    def rescan(self) -> bool:
        """Re-read learner keys and revocations; True if anything changed."""
        keys: dict[str, list[JoinKey]] = {LEARNER_KEYS: [], REVOKED_KEYS: []}
        stamp = []
        for sub, into in keys.items():
            d = self.keys_dir / sub
            for p in sorted(d.glob("*.key")) if d.is_dir() else []:
                try:
                    into.append(read_join_key(p))
                    stamp.append((sub, p.name, p.stat().st_mtime_ns))
                except (YetoError, OSError):
                    continue  # a half-written or foreign file: not a key
        changed = tuple(stamp) != self.scanned
        self.scanned = tuple(stamp)
        self.revoked = {k.public for k in keys[REVOKED_KEYS]}
        self.revoked_ids = {k.learner for k in keys[REVOKED_KEYS] if k.learner is not None}
        self.learners = {k.public: k.learner for k in keys[LEARNER_KEYS]
                         if k.learner is not None and k.public not in self.revoked}
        return changed

    def principal(self, client_public: bytes) -> Optional[str]:
        """The identity a client key proves (ZAP User-Id), or None if it is not admitted."""
        if client_public in self.revoked:
            return None
        if self.join is not None and client_public == self.join.public:
            return JOIN_PRINCIPAL
        lid = self.learners.get(client_public)
        return None if lid is None else f"{LEARNER_PRINCIPAL}{lid}"

    def bound_ids(self) -> set[int]:
        """Learner ids that only their own key may speak for."""
        return set(self.learners.values())

    def revoked_principals(self) -> set[str]:
        """Principals whose connections must be cut (a learner id with a revoked key and no current one)."""
        current = set(self.learners.values())
        return {f"{LEARNER_PRINCIPAL}{lid}" for lid in self.revoked_ids - current}

    def bundle(self) -> str:
        """Every credential file of the run as one JSON text (relative path -> contents), for moving the syncer
        to another machine (the launch's head VM) as a single secret."""
        files = [self.keys_dir / SYNCER_SECRET_FILE, self.out / JOIN_KEY_FILE,
                 *sorted((self.keys_dir / LEARNER_KEYS).glob("*.key")),
                 *sorted((self.keys_dir / REVOKED_KEYS).glob("*.key"))]
        return json.dumps({str(p.relative_to(self.out)): p.read_text() for p in files if p.is_file()})

    @staticmethod
    def restore(out: str | Path, bundle: str) -> "Keyring":
        """Write a `bundle()` under `out` (mode 0600) and load it."""
        try:
            files = json.loads(bundle)
            assert isinstance(files, dict) and all(isinstance(v, str) for v in files.values())
        except (ValueError, AssertionError) as e:
            raise YetoError("the run's credentials bundle is not what `Keyring.bundle` writes") from e
        for rel, text in files.items():
            path = (Path(out) / rel).resolve()
            if Path(out).resolve() not in path.parents:
                raise YetoError(f"the credentials bundle names a path outside {out}: {rel!r}")
            write_secret(path, text)
        return Keyring.ensure(out)

    # ------------------------------------------------------------------ yeto keys

    def add_learner(self, learner: int) -> Path:
        path = self.keys_dir / LEARNER_KEYS / f"{learner}.key"
        if path.exists():
            raise YetoError(f"learner {learner} already has a key ({path}); revoke it first to issue a new one")
        public, secret = zmq.curve_keypair()
        write_secret(path, JoinKey(self.syncer_public, public, secret, learner).text())
        return path

    def revoke_learner(self, learner: int) -> Path:
        path = self.keys_dir / LEARNER_KEYS / f"{learner}.key"
        if not path.exists():
            raise YetoError(f"learner {learner} has no key under {path.parent} (see `yeto keys list`)")
        dest = self.keys_dir / REVOKED_KEYS / f"{learner}-{time.strftime('%Y%m%dT%H%M%S')}.key"
        dest.parent.mkdir(parents=True, exist_ok=True)
        os.replace(path, dest)
        return dest


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
class Refusal:
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
    its learner retries), while the sockets still waiting for their handshake are bounded on their own, per source
    address and in total, by cutting the oldest. libzmq's server-side monitor does not say which socket finished a
    handshake (HANDSHAKE_SUCCEEDED carries no fd, and ZAP names only the peer's IP), so a key approved by ZAP for an
    address marks that address's oldest waiting socket as handshaked, and any socket that outlives the handshake
    timeout has finished one (libzmq closes those that did not). A stranger sharing a learner's address may so be
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
        self.handshaked: set[int] = set()  # fds of connections that proved a key (the learner connections)
        self.refusals: list[Refusal] = []  # for the tape, drained by the syncer
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
                self._refused(Refusal("", HANDSHAKE_FAILURES.get(e["value"], f"handshake failed (ZMTP error "
                                                                             f"{e['value']:#x})")), now)
            elif e["event"] == zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL:
                self._refused(Refusal("", "handshake failed: the peer closed or garbled it (no CURVE, or plain "
                                          "TCP)"), now)
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
        self._refused(Refusal(p.address, reason), now)

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
                reason = "revoked learner key" if revoked else "unknown key (not this run's join key)"
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
        self._refused(Refusal(address_s, reason), now)

    def _refused(self, r: Refusal, now: float) -> None:
        # budgeted per kind of refusal (its first word: handshake, mechanism, too, unknown, revoked...), so that a
        # flood of one kind (strangers without CURVE) cannot hide another (too many connections) from the tape
        if self.recorded.allow(r.reason.split(" ", 1)[0], now):
            self.refusals.append(r)
        else:
            self.suppressed += 1

    def drain(self) -> tuple[list[Refusal], int]:
        """(refusals to record, how many more were refused but not recorded one by one)."""
        out, n = self.refusals, self.suppressed
        self.refusals, self.suppressed = [], 0
        return out, n

    def close(self) -> None:
        for s in self.sockets():
            s.close(linger=0)
