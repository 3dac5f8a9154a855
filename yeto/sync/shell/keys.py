"""The run's credentials: the syncer's CURVE key pair, the join key, and per-island keys that can be revoked.

- The syncer has one key pair (`<out>/keys/syncer.key_secret`, mode 0600).
- A *join key* (`<out>/join.key`, 0600) is what an island needs: the syncer's
  public key plus a client key pair the syncer admits. Every island may share
  it; it can name any island id not bound to a per-island key.
- A *island key* (`yeto keys add`: `<out>/keys/islands/<id>.key`) admits one
  island id only, and can be revoked (`yeto keys revoke`) without touching the
  others; a revoked key is refused at the handshake and its connections are cut
  (`yeto.sync.shell.gate`).

Keys are made and read with ZeroMQ's own tools (`zmq.curve_keypair`, `zmq.auth.certs`); nothing cryptographic
happens here.
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
from typing import Callable, Optional

import zmq
from zmq.auth.certs import load_certificate

from yeto import OLD_WORD, YetoError, in_current_words
from yeto.sync.shell.tape import TAPE_FILE, read_tape
from yeto.sync.wire.protocol import JOIN_PRINCIPAL, ISLAND_PRINCIPAL

JOIN_KEY_FILE = "join.key"
KEYS_DIR = "keys"
SYNCER_SECRET_FILE = "syncer.key_secret"
ISLAND_KEYS = "islands"
OLD_WORD_KEYS = OLD_WORD + "s"  # the folder of island keys in runs keyed before the rename
REVOKED_KEYS = "revoked"
JOIN_KEY_ENV = "YETO_JOIN_KEY"
KEY_CHARS = 40  # a z85-encoded CURVE key
KEYS_RESCAN_S = 2.0  # how often the syncer looks for added or revoked island keys
KEYS_EVENT = "keys"  # the tape's record that a running syncer read changed island keys (its summary)
KEYS_ACK_WAIT_S = 2 * KEYS_RESCAN_S + 1.0  # `yeto keys add/revoke` waits this long for that record
ACK_POLL_S = 0.2  # how often it looks
RUN_BOUNDS = ("start", "finish", "stop")  # the tape's events that start or end a syncer's session
_LINE = re.compile(r'^\s*([a-z-]+)\s*=\s*"?([^"\s]*)"?\s*$')


@dataclass(frozen=True)
class JoinKey:
    """What an island needs to reach the run: the syncer's public key and an admitted client key pair."""

    syncer_public: bytes
    public: bytes
    secret: bytes
    island: Optional[int] = None  # bound to this island id (a per-island key), or any id (the join key)

    def text(self) -> str:
        lines = ["# yeto join key: admits an island to one run. Keep it secret (it is a credential);",
                 "# pass it with --join-key FILE or the YETO_JOIN_KEY environment variable.",
                 f'syncer-public-key = "{self.syncer_public.decode()}"',
                 f'public-key = "{self.public.decode()}"',
                 f'secret-key = "{self.secret.decode()}"']
        if self.island is not None:
            lines.append(f"island = {self.island}")
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
        island = in_current_words(values).get("island")
        if island is not None and not island.isdigit():
            raise YetoError(f"{where}: island must be an island id, got {island!r}")
        return JoinKey(keys["syncer-public-key"], keys["public-key"], keys["secret-key"],
                       int(island) if island is not None else None)


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


def island_join_key(path: Optional[str], insecure: bool, syncer: str) -> Optional[JoinKey]:
    """The join key an island uses: --join-key FILE, else $YETO_JOIN_KEY (the file's contents); None with
    --insecure (loopback only). An island without one gets a one-line error saying where to find it."""
    if insecure:
        require_loopback(syncer.removeprefix("tcp://").rpartition(":")[0], "island --syncer")
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


def has_keyring(out: str | Path) -> bool:
    """`out` holds a syncer's credentials (its key pair is the first file a keyring gets)."""
    return (Path(out) / KEYS_DIR / SYNCER_SECRET_FILE).is_file()


@dataclass
class Keyring:
    """The run's credentials on disk, under the syncer's --out."""

    out: Path
    syncer_public: bytes = b""
    syncer_secret: bytes = b""
    join: Optional[JoinKey] = None
    islands: dict[bytes, int] = field(default_factory=dict)  # admitted island-key public key -> its island id
    revoked: set[bytes] = field(default_factory=set)
    revoked_ids: set[int] = field(default_factory=set)
    scanned: tuple = ()

    def __post_init__(self) -> None:
        old = self.keys_dir / OLD_WORD_KEYS
        if old.is_dir() and not (self.keys_dir / ISLAND_KEYS).exists():  # a run's keys from before the rename
            old.rename(self.keys_dir / ISLAND_KEYS)

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
            if ring.join.island is not None:
                raise YetoError(f"{join_key} is the key of island {ring.join.island}, not a join key")
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
        """Re-read island keys and revocations; True if anything changed."""
        keys: dict[str, list[JoinKey]] = {ISLAND_KEYS: [], REVOKED_KEYS: []}
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
        self.revoked_ids = {k.island for k in keys[REVOKED_KEYS] if k.island is not None}
        self.islands = {k.public: k.island for k in keys[ISLAND_KEYS]
                         if k.island is not None and k.public not in self.revoked}
        return changed

    def principal(self, client_public: bytes) -> Optional[str]:
        """The identity a client key proves (ZAP User-Id), or None if it is not admitted."""
        if client_public in self.revoked:
            return None
        if self.join is not None and client_public == self.join.public:
            return JOIN_PRINCIPAL
        lid = self.islands.get(client_public)
        return None if lid is None else f"{ISLAND_PRINCIPAL}{lid}"

    def bound_ids(self) -> set[int]:
        """Island ids that only their own key may speak for."""
        return set(self.islands.values())

    def revoked_principals(self) -> set[str]:
        """Principals whose connections must be cut (an island id with a revoked key and no current one)."""
        current = set(self.islands.values())
        return {f"{ISLAND_PRINCIPAL}{lid}" for lid in self.revoked_ids - current}

    def summary(self) -> dict[str, list[int]]:
        """What the tape's KEYS_EVENT records: the island ids bound to a key of their own, and those revoked."""
        bound = self.bound_ids()
        return {"islands": sorted(bound), "revoked": sorted(self.revoked_ids - bound)}

    def bundle(self) -> str:
        """Every credential file of the run as one JSON text (relative path -> contents), for moving the syncer
        to another machine (the launch's head VM) as a single secret."""
        files = [self.keys_dir / SYNCER_SECRET_FILE, self.out / JOIN_KEY_FILE,
                 *sorted((self.keys_dir / ISLAND_KEYS).glob("*.key")),
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

    def add_island(self, island: int) -> Path:
        path = self.keys_dir / ISLAND_KEYS / f"{island}.key"
        if path.exists():
            raise YetoError(f"island {island} already has a key ({path}); revoke it first to issue a new one")
        public, secret = zmq.curve_keypair()
        write_secret(path, JoinKey(self.syncer_public, public, secret, island).text())
        return path

    def own_key(self, island: int) -> JoinKey:
        """Island `island`'s own key, issued now if it has none: what `yeto launch` hands each island it starts, so
        its claims are trusted (yeto.sync.merge.rules.Tier) and it can be revoked alone."""
        path = self.keys_dir / ISLAND_KEYS / f"{island}.key"
        if not path.exists():
            self.add_island(island)
            self.rescan()
        return read_join_key(path)

    def issue_expected(self, islands: int) -> list[int]:
        """An island key for every expected id (0 .. islands - 1) that has none and was never revoked (a revoked
        one comes back only by `yeto keys add`): the shared join key can then take no expected id, so no holder of
        it can take one before its island starts. The ids issued."""
        have = set(self.islands.values()) | self.revoked_ids
        issued = [lid for lid in range(islands) if lid not in have]
        for lid in issued:
            self.add_island(lid)
        if issued:
            self.rescan()
        return issued

    def who_joins_with_what(self, islands: int) -> str:
        """One line for the syncer's log: which key file each island id joins with."""
        own = sorted(self.islands.values())
        mine = self.keys_dir / ISLAND_KEYS
        if not own:
            return f"islands join with {self.out / JOIN_KEY_FILE}"
        who = "every expected id joins" if set(range(islands)) <= set(own) else f"island ids {own} join"
        return (f"{who} with its own key {mine}/<id>.key (copy key i to island i: trusted), ids with no key of "
                f"their own with {self.out / JOIN_KEY_FILE} (bounded)")

    def revoke_island(self, island: int) -> Path:
        path = self.keys_dir / ISLAND_KEYS / f"{island}.key"
        if not path.exists():
            raise YetoError(f"island {island} has no key under {path.parent} (see `yeto keys list`)")
        dest = self.keys_dir / REVOKED_KEYS / f"{island}-{time.strftime('%Y%m%dT%H%M%S')}.key"
        dest.parent.mkdir(parents=True, exist_ok=True)
        os.replace(path, dest)
        return dest


# ---------------------------------------------------------------------------------------------- did the syncer see it


def tape_size(out: str | Path) -> int:
    """Bytes in the syncer's tape now: what a key change's acknowledgement must come after."""
    try:
        return (Path(out) / TAPE_FILE).stat().st_size
    except FileNotFoundError:
        return 0


def _events_from(tape: Path, offset: int) -> list[dict]:
    """The complete tape lines after byte `offset`."""
    try:
        with open(tape, "rb") as f:
            f.seek(offset)
            data = f.read()
    except FileNotFoundError:
        return []
    events = []
    for line in data[:data.rfind(b"\n") + 1].splitlines():
        try:
            events.append(json.loads(line))
        except ValueError:
            continue  # (a repaired tail; `yeto tape --audit` names damage)
    return events


def syncer_pickup(out: str | Path, since: int, acknowledges: Callable[[dict], bool],
                  wait_s: float = KEYS_ACK_WAIT_S) -> str:
    """Whether the syncer of `out` took a key change in, as one sentence: a running syncer records its keys
    (KEYS_EVENT) at its next rescan, so a record after byte `since` of its tape that `acknowledges` says so; a syncer
    not running reads the keys when it starts."""
    tape = Path(out) / TAPE_FILE
    if not tape.is_file():
        return "the syncer has not started yet: it reads the keys when it starts"
    bounds = [e for e in read_tape(tape) if e.get("event") in RUN_BOUNDS]
    if not bounds or bounds[-1]["event"] != "start":
        ended = f"its tape ends with `{bounds[-1]['event']}`" if bounds else "its tape has no start"
        return f"the syncer is not running ({ended}): it reads the keys when it starts"
    deadline = time.monotonic() + wait_s
    while True:
        ack = next((e for e in _events_from(tape, since) if e.get("event") == KEYS_EVENT and acknowledges(e)), None)
        if ack is not None:
            return f"the running syncer picked it up (tape seq {ack.get('seq')})"
        if time.monotonic() >= deadline:
            return (f"no running syncer acknowledged it within {wait_s:.0f} s (its tape's last start, seq "
                    f"{bounds[-1].get('seq')}, has no end: it was killed or is stalled): it reads the keys when it "
                    "starts")
        time.sleep(ACK_POLL_S)
