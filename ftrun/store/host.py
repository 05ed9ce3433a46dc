"""The job's store: a TCPStore served on a socket bound before anything starts, in this process or (the agent's
fork server forks it) in a process of its own."""

from __future__ import annotations

import errno
import ipaddress
import os
import socket
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta
from typing import TYPE_CHECKING

from ftrun.config import Endpoint
from ftrun.errors import UsageError

if TYPE_CHECKING:
    from torch.distributed import TCPStore

LIBUV_REFUSAL = b"does not support initialization with an listen fd"
"""What torch logs (to file descriptor 2, from C++) as its libuv server refuses a listening socket, before
raising NotImplementedError; ftrun then does what the line advises, so the line is not passed on."""


class StoreHost:
    """Hosts the job's TCPStore on a socket bound at construction, on one address.

    The address is the one the clients use (``LaunchConfig.store_listen``): loopback for a job on this
    machine, this machine's address on the hosts' network for several nodes; every interface only when
    asked. Binding first gives a clear error for a busy port before anything starts, and lets workers be
    spawned (and import torch) while the agent itself is still importing torch: their store clients connect
    to the already-listening socket and are served once :meth:`start` hands it to TCPStore.
    """

    def __init__(self, endpoint: Endpoint, listen: str) -> None:
        address = ipaddress.ip_address(listen)
        self.listen = listen
        self.client_host = ("::1" if address.version == 6 else "127.0.0.1") if address.is_unspecified else listen
        """Where this machine's own clients (the agent, a local status) reach the store."""
        self.sock = socket.socket(socket.AF_INET6 if address.version == 6 else socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            self.sock.bind((listen, endpoint.port))
        except OSError as exc:
            self.sock.close()
            if exc.errno == errno.EADDRINUSE:
                raise UsageError(
                    f"port {endpoint.port} is already in use: pick a free one with --master-port/--rdzv-endpoint, "
                    "or leave it out and ftrun picks one"
                ) from None
            raise UsageError(f"cannot listen on {listen} port {endpoint.port}: {exc.strerror}") from None
        self.sock.listen(1024)
        self.port: int = self.sock.getsockname()[1]
        self.store: TCPStore | None = None

    def close(self) -> None:
        """Close this process's listening socket (once another process serves the store on its own copy)."""
        self.sock.close()

    def start(self) -> TCPStore:
        """Serve the store on the bound socket (imports torch); returns the agent's own handle on it."""
        from torch.distributed import TCPStore

        options = {"is_master": True, "master_listen_fd": self.sock.fileno(), "wait_for_workers": False,
                   "timeout": timedelta(seconds=300)}
        with _stderr_without(LIBUV_REFUSAL):
            try:
                self.store = TCPStore(self.client_host, self.port, use_libuv=True, **options)
            except NotImplementedError:  # torch's libuv server took no listening socket before pytorch#150215
                # (torch 2.6); its classic server does, but looks up each client's name as it accepts it
                self.store = TCPStore(self.client_host, self.port, use_libuv=False, **options)
        self.sock.detach()  # the server owns the descriptor now, and closes it when it stops
        return self.store


@contextmanager
def _stderr_without(dropped: bytes) -> Iterator[None]:
    """Hold back what is written to file descriptor 2 meanwhile (torch's C++ logs write there, and other threads
    may), and write it after, but for the lines that contain ``dropped``."""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as held:
        os.dup2(held.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            held.seek(0)
            kept = b"".join(line for line in held.read().splitlines(keepends=True) if dropped not in line)
            while kept:
                kept = kept[os.write(2, kept):]
