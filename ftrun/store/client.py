"""Client connections to a job's TCPStore: the one place ftrun constructs one."""

from __future__ import annotations

import socket
import time
from datetime import timedelta
from typing import TYPE_CHECKING

from ftrun.errors import NoSuchJob, UsageError
from ftrun.store.auth import Seal, secret_for_endpoint
from ftrun.store.job import JobStore

if TYPE_CHECKING:
    from torch.distributed import TCPStore


def open_client(host: str, port: int, timeout: float) -> TCPStore:
    """A client connection to the TCPStore at ``host:port``; each call waits at most ``timeout`` seconds."""
    from torch.distributed import TCPStore

    return TCPStore(host, port, is_master=False, wait_for_workers=False, timeout=timedelta(seconds=timeout),
                    use_libuv=True)


def open_client_retrying(host: str, port: int, call_timeout: float, total: float) -> TCPStore:
    """A connection whose calls wait at most ``call_timeout`` s (torch fixes the socket's timeout when it
    connects), retried for ``total`` s: the store may be served later than this process starts."""
    deadline = time.monotonic() + total
    while True:
        try:
            return open_client(host, port, call_timeout)
        except RuntimeError:
            if time.monotonic() > deadline:
                raise


def parse_endpoint(endpoint: str) -> tuple[str, int]:
    """``HOST:PORT`` as given to ``--endpoint``; UsageError when it is not one."""
    host, _, port_text = endpoint.rpartition(":")
    if not host or not port_text.isascii() or not port_text.isdigit() or not 0 < int(port_text) < 65536:
        raise UsageError(f"--endpoint {endpoint!r}: expected HOST:PORT, e.g. node0:29500")
    return host, int(port_text)


def connect(endpoint: str, timeout: float = 5.0) -> TCPStore:
    """A client connection to the store of the job at HOST:PORT; NoSuchJob (one line) when it is not there."""
    host, port = parse_endpoint(endpoint)
    try:  # a plain connect first: a refused or unreachable endpoint is one line, at once
        socket.create_connection((host, port), timeout=timeout).close()
    except OSError as exc:
        raise NoSuchJob(f"cannot reach a job at {host}:{port}: {exc.strerror or exc}") from None
    try:
        return open_client(host, port, timeout)
    except RuntimeError as exc:
        raise NoSuchJob(f"cannot reach a job at {host}:{port}: {str(exc).splitlines()[0]}") from None


def connect_job(endpoint: str, secret: str | None, secret_file: str | None = None) -> JobStore:
    """The store of the job at HOST:PORT, read and written with the run's ``secret`` (None: the one in
    ``secret_file`` or FTRUN_SECRET_FILE). NoSuchJob when nobody answers there, before any secret is asked for."""
    kv = connect(endpoint)
    return JobStore(kv, Seal(secret or secret_for_endpoint(secret_file, endpoint)))
