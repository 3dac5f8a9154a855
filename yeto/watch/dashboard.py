"""`yeto dashboard`'s shell: it finds a run (a directory, or a launched run's name), follows its files and serves
the page on loopback.

It only reads: the tape and the islands' files as they grow (each poll reads the bytes appended since the last,
never a lock or a socket of the syncer's), or, for a cloud run, what `yeto status` reads (the head's tape over
ssh, SkyPilot's cost report), at most every CLOUD_POLL_S. The server is the standard library's
ThreadingHTTPServer: three GET routes and no framework needed for them (the page polls; nothing streams).

A run's internals are for its operator: every request must name this server by a loopback name in its Host header
(a page from elsewhere whose name was made to resolve to 127.0.0.1, DNS rebinding, sends its own name) and carry the
token printed in the URL (as Jupyter does), or the cookie the first page load with it sets (another local user, or
a page in the operator's browser from another origin, has neither).
"""

from __future__ import annotations

import json
import secrets
import threading
import time
from http import HTTPStatus
from http.cookies import SimpleCookie
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, Callable, Optional
from urllib.parse import parse_qs

from yeto import YetoError, in_current_words, one_line
from yeto.island.metrics import METRICS_FILE, RUN_FILE
from yeto.launch.registry import find_run, run_dirs
from yeto.sync.shell.tape import TAPE_FILE
from yeto.watch.alerts import alerts
from yeto.watch.page import export_page, live_page, plotly_js
from yeto.watch.snapshot import IslandFiles, snapshot

CLOUD_POLL_S = 10.0  # a cloud head's tape is copied over ssh at most this often
COST_POLL_S = 60.0  # SkyPilot's cost report is asked at most this often
REFOLD_S = 5.0  # an unchanged run is folded again this often (for states that change with time alone)
MAX_PORT = 65535
HOST = "127.0.0.1"  # loopback only: the page shows a run's internals to whoever can reach it
LOOPBACK_NAMES = ("127.0.0.1", "localhost", "[::1]")  # the Host headers a request may name this server by
TOKEN_BYTES = 24


class JsonlFollower:
    """The complete lines appended to a JSONL file since the last `read`; a torn last line waits for its end."""

    def __init__(self, path: Path):
        self.path = path
        self.offset = 0
        self.records: list[dict[str, Any]] = []

    def read(self) -> bool:
        """Fold in what was appended; True when something was."""
        try:
            size = self.path.stat().st_size
        except FileNotFoundError:
            return False
        if size < self.offset:  # rewritten (a repaired torn tail): start over
            self.offset, self.records = 0, []
        if size == self.offset:
            return False
        with open(self.path, "rb") as f:
            f.seek(self.offset)
            data = f.read(size - self.offset)
        end = data.rfind(b"\n") + 1
        for line in data[:end].splitlines():
            if line.strip():
                try:
                    self.records.append(in_current_words(json.loads(line)))
                except ValueError:
                    continue  # `yeto tape --audit` names damage; the dashboard shows what it can read
        self.offset += end
        return end > 0


def _read_json(path: Path) -> dict[str, Any]:
    try:
        return in_current_words(json.loads(path.read_text()))
    except (OSError, ValueError):
        return {}


class LocalRun:
    """A run's directory on this machine, as `yeto.launch.registry.find_run` reads it: a launch's --out, a syncer's
    --out (the islands beside it, if any), or an island's or a standalone `yeto train`'s --out (no tape)."""

    def __init__(self, root: Path, name: str = ""):
        self.root = root
        found = run_dirs(root)
        self.tape = JsonlFollower((found.syncer if found and found.syncer else root) / TAPE_FILE)
        self.islands: dict[Path, JsonlFollower] = {}
        self.info = {"name": name or root.name, "dir": str(root), "kind": "local",
                     "standalone": bool(found and found.standalone)}

    def _island_dirs(self) -> dict[int, Path]:
        """The run's island directories as they are now (a launch's appear as its islands start)."""
        found = run_dirs(self.root)
        return found.islands if found is not None else {}

    def stamp(self) -> str:
        """Changes whenever a file the snapshot comes from grew (the page redraws its charts only then)."""
        return ",".join(str(f.offset) for f in (self.tape, *self.islands.values()))

    def read(self) -> tuple[list[dict[str, Any]], dict[int, IslandFiles], dict[str, Any]]:
        self.tape.read()
        islands = {}
        for lid, d in sorted(self._island_dirs().items()):
            follower = self.islands.setdefault(d, JsonlFollower(d / METRICS_FILE))
            follower.read()
            islands[lid] = IslandFiles(lid, _read_json(d / RUN_FILE), follower.records,
                                       _read_json(d / "summary.json"))
        return self.tape.records, islands, self.info


class CloudRun:
    """A launched cloud run: the head's tape over ssh and SkyPilot's costs, as `yeto status` reads them."""

    def __init__(self, record, clock: Callable[[], float] = time.time):
        self.record = record
        self.clock = clock
        self.events: list[dict[str, Any]] = []
        self.info: dict[str, Any] = {"name": record.name, "dir": record.out, "kind": "cloud"}
        self._tape_at = self._cost_at = 0.0
        self._fetching = threading.Lock()

    def stamp(self) -> str:
        return f"{len(self.events)},{self.info.get('cost')}"

    def read(self) -> tuple[list[dict[str, Any]], dict[int, IslandFiles], dict[str, Any]]:
        """What was last fetched; a fetch that is due runs on its own thread (ssh may take SSH_TIMEOUT_S), except
        the first, which the page waits for."""
        now = self.clock()
        due = now - self._tape_at >= CLOUD_POLL_S or now - self._cost_at >= COST_POLL_S
        if due and not self._fetching.locked():
            if self._tape_at == 0.0:
                self._fetch(now)
            else:
                threading.Thread(target=self._fetch, args=(now,), daemon=True).start()
        return self.events, {}, self.info

    def _fetch(self, now: float) -> None:
        from yeto.launch.manage import _head_tape, cloud_costs

        with self._fetching:
            if now - self._tape_at >= CLOUD_POLL_S:
                self._tape_at = now
                events, why = _head_tape(self.record)
                self.events = events or self.events
                self.info["note"] = why
            if now - self._cost_at >= COST_POLL_S:
                self._cost_at = now
                try:
                    from yeto.launch.cloud import SkyPilotClient

                    cost = sum(cloud_costs(self.record, SkyPilotClient()).values())
                    hours = max((now - self.record.created) / 3600, 1e-9)
                    self.info.update(cost=round(cost, 4), cost_per_hour=round(cost / hours, 4))
                except Exception as e:  # SkyPilot's errors are many; the page says the cost is unknown
                    self.info["note"] = f"SkyPilot unreachable ({one_line(e)})"


def open_run(target: str):
    """A run's directory (`yeto.launch.registry.find_run`: a launch's, a syncer's, an island's or a standalone
    run's), else a run launched under that name."""
    found = find_run(target)
    if found.record is not None and found.record.kind != "local":
        return CloudRun(found.record)
    return LocalRun(found.given, found.record.name if found.record is not None else "")


class Dashboard:
    """The run's latest snapshot. Folded again only when a file grew, or REFOLD_S after the last fold (a state can
    change with time alone: late); between, the last one is served with its clock moved on, so a long tape costs
    a fold per change, not one per poll of every open page."""

    def __init__(self, source, clock: Callable[[], float] = time.time):
        self.source = source
        self.clock = clock
        self._lock = threading.Lock()
        self._last: Optional[dict[str, Any]] = None
        self._folded = (None, 0.0)  # (the source's stamp, when)

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            events, islands, info = self.source.read()
            now, grown = self.clock(), self.source.stamp()
            if self._last is not None and self._folded[0] == grown and now - self._folded[1] < REFOLD_S:
                self._last["run"]["now"] = now
                return self._last
            snap = snapshot(events, islands, now, info)
            snap["alerts"] = alerts(snap, events)
            states = ",".join(row["state"] for row in snap["fleet"])  # a state can change with time alone (late)
            snap["run"]["stamp"] = f"{grown}|{states}|{len(snap['alerts'])}"
            self._last, self._folded = snap, (grown, now)
            return snap


def export(source, out: str | Path) -> Path:
    out = Path(out)
    out.write_text(export_page(Dashboard(source).snapshot()))
    return out


class PageGate:
    """Who may read the page: a request naming this server by a loopback name, with the token or its cookie."""

    def __init__(self) -> None:
        self.token = secrets.token_urlsafe(TOKEN_BYTES)
        self.port = 0
        self.hosts: set[str] = set()
        self.cookie = ""

    def listening_on(self, port: int) -> None:
        self.port = port
        self.hosts = {f"{name}:{port}" for name in LOOPBACK_NAMES}
        self.cookie = f"yeto_dashboard_{port}"  # (cookies are per host, not per port: one name per dashboard)

    def refusal(self, host: str, token: str, cookie_header: str) -> str:
        """Why this request may not read the page ("" if it may)."""
        if host.lower() not in self.hosts:
            return f"this dashboard answers only to {HOST}:{self.port} or localhost:{self.port} (Host {host!r})"
        cookie = SimpleCookie(cookie_header).get(self.cookie)
        if secrets.compare_digest(token, self.token) or (
                cookie is not None and secrets.compare_digest(cookie.value, self.token)):
            return ""
        return "open the URL `yeto dashboard` printed: it carries this page's token"


def serve(source, port: int = 0, ready: Optional[Callable[[str], None]] = None) -> None:
    """Serve the page on loopback until interrupted; `ready(url)` once it listens (the URL carries the token)."""
    if not 0 <= port <= MAX_PORT:
        raise YetoError(f"--port {port} is not a port (0 to {MAX_PORT}; 0 picks a free one)")
    board = Dashboard(source)
    page = live_page().encode()
    script = plotly_js().encode()
    gate = PageGate()

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 (the standard library's name)
            route, _, query = self.path.partition("?")
            given = parse_qs(query).get("token", [""])[0]
            why = gate.refusal(self.headers.get("Host", ""), given, self.headers.get("Cookie", ""))
            if why:
                self._refuse(why)
                return
            if route == "/":
                self._send(page, "text/html; charset=utf-8", set_cookie=bool(given))
            elif route == "/plotly.min.js":
                self._send(script, "text/javascript; charset=utf-8", cache=True)
            elif route == "/snapshot.json":
                self._send(json.dumps(board.snapshot()).encode(), "application/json")
            else:
                self.send_error(HTTPStatus.NOT_FOUND)

        def _refuse(self, why: str) -> None:
            body = (why + "\n").encode()
            self.send_response(HTTPStatus.FORBIDDEN)
            self.send_header("Content-Type", "text/plain; charset=utf-8")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def _send(self, body: bytes, kind: str, cache: bool = False, set_cookie: bool = False) -> None:
            self.send_response(HTTPStatus.OK)
            if set_cookie:  # (the page's own requests then need no token in their URLs)
                self.send_header("Set-Cookie", f"{gate.cookie}={gate.token}; HttpOnly; SameSite=Strict; Path=/")
            self.send_header("Content-Type", kind)
            self.send_header("Content-Length", str(len(body)))
            self.send_header("Cache-Control", "max-age=3600" if cache else "no-store")
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: Any) -> None:
            pass  # a request every half second per open page: not worth a line each

    try:
        server = ThreadingHTTPServer((HOST, port), Handler)
    except OSError as e:
        raise YetoError(f"cannot listen on {HOST}:{port} ({e.strerror}): pick another --port, or leave it out for a "
                        "free one") from e
    server.daemon_threads = True
    gate.listening_on(server.server_address[1])
    if ready is not None:
        ready(f"http://{HOST}:{gate.port}/?token={gate.token}")
    try:
        server.serve_forever(poll_interval=0.2)
    finally:
        server.server_close()
