"""Ports a test names (``--master-port``, a store's or an etcd member's address) before something binds them."""

from __future__ import annotations

import random
import socket
from pathlib import Path


def ports_to_name() -> range:
    """The ports to pick from: below the kernel's ephemeral range.

    A port the kernel picks as free (a bind to port 0) comes from that range, as does the local port of every
    connection opened meanwhile: under load another test's connection was given the port between the pick and
    the launcher's bind (EADDRINUSE). Below the range only a listener that names its port takes one.
    """
    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    return range(max(10000, low - 12000), low)


def free_port(given: set[int]) -> int:
    """A TCP port that was free a moment ago and is not in ``given`` (the ports picked before; it is added)."""
    band = ports_to_name()
    for port in random.sample(band, min(len(band), 200)):
        if port in given:
            continue
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind(("", port))
            except OSError:
                continue
        given.add(port)
        return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:  # no such band here: the kernel's pick
        sock.bind(("", 0))
        return sock.getsockname()[1]
