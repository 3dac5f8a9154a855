"""Checks of a person's flags shared by the island's and the syncer's configs: each failure is one YetoError
that names the flag, the value and the fix, raised before anything heavy (a model, a socket) is touched."""

from __future__ import annotations

from pathlib import Path

from yeto import YetoError

PORT_MIN, PORT_MAX = 1, 65535


def check_port(port: int, flag: str) -> None:
    if not PORT_MIN <= port <= PORT_MAX:
        raise YetoError(f"{flag} {port} is not a TCP port: use {PORT_MIN}-{PORT_MAX} (the syncer's default is 29400)")


def check_address(address: str, flag: str = "--syncer") -> tuple[str, int]:
    """HOST:PORT (or tcp://HOST:PORT) with a port in range -> (host, port)."""
    host, sep, port = address.removeprefix("tcp://").rpartition(":")
    if not sep or not host or not port.isdigit():
        raise YetoError(f"{flag} must be HOST:PORT (e.g. syncer.example.org:29400), got {address!r}")
    check_port(int(port), f"{flag}'s port")
    return host, int(port)


def check_out_dir(path: str, flag: str = "--out") -> None:
    """A run directory must be a directory (it is created when missing)."""
    p = Path(path).expanduser()
    if p.exists() and not p.is_dir():
        raise YetoError(f"{flag} {path} is a file, not a directory: pass a directory (it is created if missing)")


def check_range(value: float, flag: str, low: float | None = None, high: float | None = None,
                low_open: bool = False, high_open: bool = False) -> None:
    """`low <= value <= high` (`<` on an open side); the message says the allowed range."""
    too_low = low is not None and (value <= low if low_open else value < low)
    too_high = high is not None and (value >= high if high_open else value > high)
    if too_low or too_high:
        lo = "" if low is None else f"{'(' if low_open else '['}{low}"
        hi = "" if high is None else f"{high}{')' if high_open else ']'}"
        want = f"in {lo}, {hi}" if low is not None and high is not None else (
            f"{'above' if low_open else 'at least'} {low}" if low is not None else
            f"{'below' if high_open else 'at most'} {high}")
        raise YetoError(f"{flag} must be {want}, got {value}")
