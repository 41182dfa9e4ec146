"""sd_notify spoken directly: one datagram per message to $NOTIFY_SOCKET (no systemd binding needed).

A socket name starting with '@' is in the abstract namespace (leading NUL byte).
"""
from __future__ import annotations

import logging
import os
import socket

log = logging.getLogger(__name__)


def notify(message: str) -> bool:
    """Send e.g. "READY=1"; False when not run under systemd (no NOTIFY_SOCKET) or the send failed."""
    address = os.environ.get("NOTIFY_SOCKET")
    if not address:
        return False
    if address.startswith("@"):
        address = "\0" + address[1:]
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
            sock.connect(address)
            sock.sendall(message.encode("utf-8"))
        return True
    except OSError as exc:
        log.warning("sd_notify %r failed: %s", message.split("=", 1)[0], exc)
        return False


def watchdog_interval() -> float | None:
    """Seconds between WATCHDOG=1 pings (half of WatchdogSec), or None when no watchdog is asked for."""
    usec = os.environ.get("WATCHDOG_USEC")
    pid = os.environ.get("WATCHDOG_PID")
    if not usec or not os.environ.get("NOTIFY_SOCKET"):
        return None
    if pid and pid.isdigit() and int(pid) != os.getpid():
        return None
    try:
        value = int(usec)
    except ValueError:
        return None
    return value / 2e6 if value > 0 else None
