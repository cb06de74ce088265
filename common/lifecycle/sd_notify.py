"""systemd readiness and watchdog (sd_notify) without a dependency: datagrams to $NOTIFY_SOCKET.

Type=notify units start their dependants only after READY=1, and WatchdogSec= restarts a process
whose main loop stops pinging. Outside systemd (no NOTIFY_SOCKET) every call does nothing.
"""

from __future__ import annotations

import os
import socket
import time

_last_ping = 0.0


def notify(state: str) -> bool:
    """Send one state string ("READY=1", ...); False when not under systemd or the send failed."""
    addr = os.environ.get("NOTIFY_SOCKET")
    if not addr or addr[0] not in "/@":
        return False
    if addr[0] == "@":
        addr = "\0" + addr[1:]  # abstract namespace
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as s:
            s.sendto(state.encode(), addr)
        return True
    except OSError:
        return False  # systemd gone or socket unreachable: never a reason to stop training


def ready(status: str = "") -> bool:
    return notify("READY=1" + (f"\nSTATUS={status}" if status else ""))


def stopping() -> bool:
    return notify("STOPPING=1")


def watchdog() -> bool:
    """Ping the watchdog, at most every WATCHDOG_USEC / 2; cheap enough for any main loop."""
    global _last_ping
    usec = os.environ.get("WATCHDOG_USEC")
    pid = os.environ.get("WATCHDOG_PID")
    if not usec or not usec.isdigit() or (pid and pid != str(os.getpid())):
        return False
    now = time.monotonic()
    if now - _last_ping < int(usec) / 2e6:
        return False
    _last_ping = now
    return notify("WATCHDOG=1")
