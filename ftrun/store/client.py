"""Client connections to a job's TCPStore: the one place ftrun constructs one."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import TYPE_CHECKING, TypeVar

from ftrun.errors import NoSuchJob, UsageError

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
    """A client connection to the store of the job at HOST:PORT; NoSuchJob (one line) when it is not there,
    or when what listens there does not answer as a store within ``timeout`` seconds."""
    host, port = parse_endpoint(endpoint)
    try:  # a plain connect first: a refused or unreachable endpoint is one line, at once
        socket.create_connection((host, port), timeout=timeout).close()
    except OSError as exc:
        raise NoSuchJob(f"cannot reach a job at {host}:{port}: {exc.strerror or exc}") from None
    import torch.distributed  # noqa: F401 -- before the deadline starts: importing torch takes seconds

    try:
        return _within(timeout, lambda: open_client(host, port, timeout))
    except TimeoutError:
        raise NoSuchJob(f"cannot reach a job at {host}:{port}: no answer within {timeout:g} s "
                        "(is that a job's store port?)") from None
    except RuntimeError as exc:
        raise NoSuchJob(f"cannot reach a job at {host}:{port}: {str(exc).splitlines()[0]}") from None


T = TypeVar("T")


def _within(seconds: float, call: Callable[[], T]) -> T:
    """``call()``'s result, or TimeoutError after ``seconds``.

    torch's TCPStore client waits without a deadline for a server that accepts the connection but never
    answers its handshake (a listener of another kind, a hung process), and its constructor cannot be
    interrupted: it runs on a daemon thread, left behind at the deadline.
    """
    outcome: list = []

    def run() -> None:
        try:
            outcome.append((True, call()))
        except BaseException as exc:  # noqa: BLE001 -- raised again in the caller's thread
            outcome.append((False, exc))

    thread = threading.Thread(target=run, name="ftrun-connect", daemon=True)
    thread.start()
    thread.join(seconds)
    if not outcome:
        raise TimeoutError(f"no answer within {seconds:g} s")
    ok, value = outcome[0]
    if not ok:
        raise value
    return value
