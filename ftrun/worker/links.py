"""Checking the links between the members of a generation before its groups form.

A collective that fails while every process is alive means a link failed (a reset connection, a link that
drops packets). The leader then re-forms the same members with a plan that asks for a probe: before the
store barrier, every member connects to every other member's prober (a listening socket on the address
Gloo uses) and publishes whom it could not reach. If every link connects, the groups form as usual; if not,
nobody forms, and the matrix goes to the leader, which excludes as few members as it must.
"""

from __future__ import annotations

import json
import os
import socket
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor

import psutil

from ftrun.protocol import is_address, split_address

PROBE_TIMEOUT = 2.0
"""Seconds one connection attempt may take before the peer counts as unreachable."""


class LinkFailure(Exception):
    """Some members of a generation cannot connect to each other: ``unreachable`` is the whole matrix."""

    def __init__(self, unreachable: dict[int, list[int]]) -> None:
        broken = sorted({tuple(sorted((a, b))) for a, peers in unreachable.items() for b in peers})
        super().__init__(f"links that do not connect: {', '.join(f'{a}-{b}' for a, b in broken)}")
        self.unreachable = unreachable


def gloo_address() -> str:
    """The IPv4 address Gloo's sockets use here: GLOO_SOCKET_IFNAME's interface, else this host's name's."""
    interface = os.environ.get("GLOO_SOCKET_IFNAME", "").split(",")[0].strip()
    if interface:
        for address in psutil.net_if_addrs().get(interface, []):
            if address.family == socket.AF_INET:
                return address.address
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"


class Prober:
    """A listening socket peers connect to, to learn whether the link between them works.

    Its thread accepts and closes connections until the process ends; it is started once per worker.
    """

    def __init__(self) -> None:
        self.host = gloo_address()
        self._socket = socket.create_server((self.host, 0))
        self.address = f"{self.host}:{self._socket.getsockname()[1]}"
        threading.Thread(target=self._serve, name="ftrun-link-prober", daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                connection, _ = self._socket.accept()
            except OSError:
                return
            connection.close()

    def unreachable(self, peers: dict[int, str], timeout: float = PROBE_TIMEOUT) -> list[int]:
        """The peers (uid -> HOST:PORT) this worker cannot connect to within ``timeout`` s, all tried at once."""
        if not peers:
            return []
        with ThreadPoolExecutor(max_workers=min(32, len(peers)), thread_name_prefix="ftrun-probe") as pool:
            results = dict(zip(peers, pool.map(lambda address: _connects(address, timeout), peers.values())))
        return sorted(uid for uid, ok in results.items() if not ok)


def _connects(address: str, timeout: float) -> bool:
    """Whether a connection to ``address`` (a peer's prober, as published in the store) opens; an address that
    is not HOST:PORT reads as unreachable."""
    if not is_address(address):
        return False
    try:
        socket.create_connection(split_address(address), timeout=timeout).close()
        return True
    except OSError:
        return False


def probe(store: object, prober: Prober, me: int, members: Sequence[int], address_key: Callable[[int], str],
          result_key: Callable[[int], str], wait: Callable[[list[str]], None]) -> None:
    """Publish this worker's prober, probe every other member's, publish whom it cannot reach, and wait for
    every member's result; :class:`LinkFailure` with the whole matrix if any link does not connect."""
    store.set(address_key(me), prober.address)
    others = [uid for uid in members if uid != me]
    wait([address_key(uid) for uid in others])
    peers = {uid: store.get(address_key(uid)).decode(errors="replace") for uid in others}
    store.set(result_key(me), json.dumps(prober.unreachable(peers)))
    wait([result_key(uid) for uid in others])
    unreachable = {uid: _uids(store.get(result_key(uid))) for uid in members}
    if any(unreachable.values()):
        raise LinkFailure(unreachable)


def _uids(raw: bytes) -> list[int]:
    """A member's published result: a JSON list of uids (anything else reads as every link failed)."""
    try:
        value = json.loads(raw)
        if isinstance(value, list) and all(type(uid) is int for uid in value):
            return value
    except (ValueError, RecursionError):
        pass
    return [-1]
