"""Starting agents on other hosts."""

from __future__ import annotations

import socket

import psutil


def is_local(host: str) -> bool:
    """Whether ``host`` names this machine (localhost, a loopback address, or one of this machine's names)."""
    if host in ("localhost", socket.gethostname(), socket.getfqdn()):
        return True
    try:
        address = socket.gethostbyname(host)
    except OSError:
        return False
    if address.startswith("127."):
        return True
    return any(a.address == address for addrs in psutil.net_if_addrs().values() for a in addrs)
