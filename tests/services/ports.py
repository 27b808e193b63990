"""Owns free loopback TCP ports for test servers, and the small helpers the harness shares.

Ports are drawn at random from below the kernel's ephemeral range, so an outgoing
connection (which takes its local port from that range) cannot grab a port a test server
is about to bind or re-bind after a restart. Ports handed out in this process are never
handed out twice.
"""

from __future__ import annotations

import os
import random
import socket
import threading
from pathlib import Path

_LOCK = threading.Lock()
_HANDED_OUT: set[int] = set()
_LOWEST = 20000
_MAX_TRIES = 500


def _ephemeral_range() -> tuple[int, int]:
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 32768, 60999


def _candidate_range() -> tuple[int, int]:
    """A port range that does not overlap the ephemeral one (inclusive bounds)."""
    low, high = _ephemeral_range()
    if low - 1 - _LOWEST >= 2000:
        return _LOWEST, low - 1
    # Unusual kernel settings: fall back to the space above the ephemeral range.
    if 65535 - (high + 1) >= 2000:
        return high + 1, 65535
    return 10000, 65535


def is_port_free(port: int, host: str = "127.0.0.1") -> bool:
    """True if nothing listens on or holds ``host:port`` right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


def free_port(host: str = "127.0.0.1") -> int:
    """One free TCP port on ``host``, not handed out before by this process."""
    low, high = _candidate_range()
    rng = random.SystemRandom()
    with _LOCK:
        for _ in range(_MAX_TRIES):
            port = rng.randint(low, high)
            if port in _HANDED_OUT:
                continue
            if is_port_free(port, host):
                _HANDED_OUT.add(port)
                return port
    raise RuntimeError(f"no free port found on {host} in {low}-{high} after {_MAX_TRIES} tries")


def free_ports(count: int, host: str = "127.0.0.1") -> list[int]:
    """``count`` distinct free TCP ports on ``host``."""
    return [free_port(host) for _ in range(count)]


class ServiceError(RuntimeError):
    """A test service could not be found, started, stopped or used."""


def pid_exists(pid: int) -> bool:
    """True if process ``pid`` exists at all, zombies included (what ``kill(pid, 0)`` sees)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def pid_alive(pid: int) -> bool:
    """True if process ``pid`` exists and is not a zombie."""
    if not pid_exists(pid):
        return False
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True  # no /proc: trust kill(0)
    # The state is the first field after the parenthesised command name.
    state = stat.rsplit(")", 1)[-1].split()[0]
    return state not in ("Z", "X")


def child_pids(pid: int) -> list[int]:
    """PIDs whose parent is ``pid`` (from /proc; empty where /proc is missing)."""
    children: list[int] = []
    try:
        entries = os.listdir("/proc")
    except OSError:
        return children
    for entry in entries:
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[-1].split()
        if len(fields) > 1 and fields[1] == str(pid):
            children.append(int(entry))
    return children


def tail(path: Path, lines: int = 40) -> str:
    """The last ``lines`` lines of a text file, or a note saying it cannot be read."""
    try:
        with path.open("rb") as handle:
            handle.seek(0, os.SEEK_END)
            size = handle.tell()
            handle.seek(max(0, size - 256 * 1024))
            data = handle.read()
    except OSError as exc:
        return f"<cannot read {path}: {exc}>"
    text = data.decode("utf-8", errors="replace")
    return "\n".join(text.splitlines()[-lines:])
