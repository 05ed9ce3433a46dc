"""Client connections to a job's TCPStore: the one place ftrun constructs one.

The workers use torch's client; the agents, ``ftrun status`` and ``ftrun inject`` use :mod:`ftrun.store.wire`,
which speaks the same protocol without importing torch.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from datetime import timedelta
from typing import TYPE_CHECKING

from ftrun.errors import NoSuchJob, UsageError
from ftrun.protocol import is_address, split_address
from ftrun.store import etcd, etcd_config, keys
from ftrun.store.auth import Seal, secret_for_endpoint
from ftrun.store.job import JobStore
from ftrun.store.kv import KeyValue
from ftrun.store.wire import StoreClient, StoreError

if TYPE_CHECKING:
    from torch.distributed import TCPStore


def open_client(host: str, port: int, timeout: float) -> TCPStore:
    """A client connection to the TCPStore at ``host:port``; each call waits at most ``timeout`` seconds."""
    from torch.distributed import TCPStore

    return TCPStore(host, port, is_master=False, wait_for_workers=False, timeout=timedelta(seconds=timeout),
                    use_libuv=True)


RETRY_PAUSE = 0.05
"""Seconds before the second try to reach a store not served yet; each later pause is longer, up to the next."""
RETRY_PAUSE_MAX = 1.0


def open_client_retrying(host: str, port: int, call_timeout: float, total: float,
                         waiting: Callable[[], None] = lambda: None) -> StoreClient:
    """A connection (without torch) whose calls wait at most ``call_timeout`` s, retried for ``total`` s: the
    store may be served later than this process starts. ``waiting`` is called once, when the first try fails or
    has no answer within ``call_timeout``. A refused connection fails at once, so the tries are spaced out (up to
    RETRY_PAUSE_MAX s apart), as torch's client spaces its own."""
    deadline = time.monotonic() + total
    told: list[bool] = []

    def tell() -> None:
        if not told:
            told.append(True)
            waiting()

    tries = 0
    while True:
        try:  # a socket that listens before the store is served is waited on: it is about to be
            return StoreClient(host, port, call_timeout,
                               first_connect_timeout=max(call_timeout, deadline - time.monotonic()), slow=tell)
        except StoreError:
            left = deadline - time.monotonic()
            if left <= 0:
                raise
            tries += 1
            tell()
            time.sleep(min(RETRY_PAUSE * tries, RETRY_PAUSE_MAX, left))


def parse_endpoint(endpoint: str) -> tuple[str, int]:
    """``HOST:PORT`` as given to ``--endpoint``; UsageError when it is not one."""
    if not is_address(endpoint):
        raise UsageError(f"--endpoint {endpoint[:80]!r}: expected HOST:PORT with a port from 1 to 65535, "
                         "e.g. node0:29500")
    return split_address(endpoint)


STORE_START_WAIT = 30.0
"""Seconds to wait for the store of a job that this machine's registry lists: a job is registered as it starts,
and its store is served once its agent has imported torch, seconds later on a busy machine."""


def check_endpoint(endpoint: str) -> None:
    """UsageError unless ``endpoint`` names a job's store: HOST:PORT, or an ``etcd://`` URL."""
    if endpoint.startswith(etcd_config.SCHEME):
        etcd_config.parse_url(endpoint)
    else:
        parse_endpoint(endpoint)


def connect(endpoint: str, timeout: float = 5.0, connect_timeout: float | None = None) -> KeyValue:
    """A client connection to the store of the job at HOST:PORT (without torch), or at an ``etcd://`` URL;
    NoSuchJob (one line) when nothing there answers within ``connect_timeout`` (default ``timeout``) seconds.

    Pass STORE_START_WAIT for a job found in this machine's registry.
    """
    if endpoint.startswith(etcd_config.SCHEME):
        options = etcd_config.parse_url(endpoint)
        kv = etcd.EtcdKeyValue(options, timeout)
        try:
            kv.check([keys.JOB])
        except etcd_config.EtcdUnavailable as exc:
            raise NoSuchJob(f"cannot reach the job's etcd at {options.describe()}: {exc}") from None
        return kv
    host, port = parse_endpoint(endpoint)
    try:
        return StoreClient(host, port, timeout, connect_timeout)
    except StoreError as exc:
        raise NoSuchJob(f"cannot reach a job at {host}:{port}: {exc}") from None


def connect_job(endpoint: str, secret: str | None, secret_file: str | None = None,
                connect_timeout: float | None = None) -> JobStore:
    """The store of the job at HOST:PORT (or an ``etcd://`` URL), read and written with the run's ``secret`` (None: the one in
    ``secret_file`` or FTRUN_SECRET_FILE). NoSuchJob when nobody answers there, before any secret is asked for."""
    kv = connect(endpoint, connect_timeout=connect_timeout)
    return JobStore(kv, Seal(secret or secret_for_endpoint(secret_file, endpoint)))
