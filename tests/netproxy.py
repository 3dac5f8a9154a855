"""A small TCP proxy for fault tests: put it between a learner and the syncer, then cut or slow the link.

`cut(seconds)` makes the link a black hole (nothing is forwarded, new connections
hang) and heals it by itself, as a dropped route does; `throttle(bytes_per_s)`
slows the learner-to-syncer direction, as a slow uplink does. Each connection is
pumped by two threads; everything is on loopback.
"""

from __future__ import annotations

import socket
import threading
import time

CHUNK = 4096
POLL_S = 0.02


class Proxy:
    def __init__(self, target_port: int):
        self.target = ("127.0.0.1", target_port)
        self.listener = socket.socket()
        self.listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.listener.bind(("127.0.0.1", 0))
        self.listener.listen(64)
        self.listener.settimeout(POLL_S * 5)
        self.port = self.listener.getsockname()[1]
        self.healed_at = 0.0
        self.up_bytes_per_s: float | None = None
        self.closed = False
        self.socks: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def cut(self, seconds: float) -> None:
        self.healed_at = time.monotonic() + seconds

    def throttle(self, bytes_per_s: float | None) -> None:
        self.up_bytes_per_s = bytes_per_s

    def close(self) -> None:
        self.closed = True
        for s in [self.listener, *self.socks]:
            try:
                s.close()
            except OSError:
                pass

    def _down(self) -> bool:
        return time.monotonic() < self.healed_at

    def _accept(self) -> None:
        while not self.closed:
            try:
                client, _ = self.listener.accept()
            except (socket.timeout, OSError):
                continue
            threading.Thread(target=self._serve, args=(client,), daemon=True).start()

    def _serve(self, client: socket.socket) -> None:
        while self._down() and not self.closed:  # a new connection during a cut hangs until it heals
            time.sleep(POLL_S)
        try:
            server = socket.create_connection(self.target)
        except OSError:
            client.close()
            return
        self.socks += [client, server]
        for src, dst, up in ((client, server, True), (server, client, False)):
            threading.Thread(target=self._pump, args=(src, dst, up), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, up: bool) -> None:
        try:
            src.settimeout(POLL_S)
            while not self.closed:
                if self._down():
                    time.sleep(POLL_S)
                    continue
                try:
                    data = src.recv(CHUNK if not (up and self.up_bytes_per_s) else min(CHUNK, 512))
                except socket.timeout:
                    continue
                if not data:
                    break
                while self._down() and not self.closed:  # cut while in flight: hold it, as a black hole does
                    time.sleep(POLL_S)
                dst.sendall(data)
                if up and self.up_bytes_per_s:
                    time.sleep(len(data) / self.up_bytes_per_s)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
                s.close()
