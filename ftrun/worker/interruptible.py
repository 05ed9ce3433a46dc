"""A store view whose waits a newer generation's plan cuts short, and which always end by a deadline.

torch's store waits block in C++ until the key appears or their timeout passes (30 minutes for a process
group): nothing can interrupt them. A process group formed for a plan that a newer one replaced (a member
died at the barrier, or during the group's own rendezvous) would sit there for that long. This view goes
through a connection of its own, ftrun's torch-free client (:class:`ftrun.store.wire.StoreClient`), and waits
in slices of WAIT_SLICE seconds, and between slices asks whether the plan was superseded: a key is seen the
moment it is written (the server answers the WAIT then), and a slice that ends unanswered withdraws its
WAIT (CANCEL_WAIT), silently. (Polling with pauses, as before, saw a key up to a pause late, twice or more
per rendezvous; torch's own client logs two warning lines at each timeout of a short blocking wait.)

torch calls a Python :class:`torch.distributed.Store` subclass back from C++ (its ``PythonStore``
trampoline), so the view also serves as the store of ``init_process_group``: Gloo's rendezvous waits for each
peer's address through it, and a newer plan ends that wait too (measured: torch 2.14 and 2.15, Gloo).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import timedelta

import torch.distributed as dist

from ftrun.store import wire

WAIT_SLICE = 0.1
"""Seconds one WAIT may stay pending before the plan is asked again whether it was superseded."""


class Superseded(Exception):
    """A newer generation arrived while this one was being formed or used."""


class StoreTimeout(RuntimeError):
    """Keys a wait was for were not written by its deadline."""


class InterruptibleStore(dist.Store):
    """A view of the TCPStore behind ``client`` (keys under ``prefix``, as a :class:`torch.distributed.PrefixStore`
    of that prefix names them), with waits (and gets of a key not yet written) that raise :class:`Superseded`
    as soon as ``superseded()`` says so, and :class:`StoreTimeout` at their timeout (the client's by default).

    Every call goes through ``client``, a connection of this view's own (it serves one request at a time: two
    views in use at once, as the two planes' rendezvous are, need two); a failure of the connection is a
    :class:`torch.distributed.DistStoreError`, as torch's store raises it.
    """

    def __init__(self, client: wire.StoreClient, superseded: Callable[[], bool], prefix: str = "") -> None:
        super().__init__()
        self.client = client
        self.superseded = superseded
        self.prefix = f"{prefix}/" if prefix else ""

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        """Return once every key exists."""
        seconds = timeout.total_seconds() if timeout is not None else self.client.timeout
        deadline = time.monotonic() + seconds
        names = [self.prefix + key for key in keys]
        while True:
            if self.superseded():
                raise Superseded(keys[0])
            left = deadline - time.monotonic()
            if left <= 0:
                raise StoreTimeout(f"{keys} not all written within {seconds:g} s")
            with _as_torch_error():
                try:
                    self.client.wait(names, min(WAIT_SLICE, left))
                    return
                except wire.StoreTimeout:
                    pass  # the slice ran out (its WAIT withdrawn): ask the plan again

    def get(self, key: str) -> bytes:
        """The value of ``key``, once it is written."""
        self.wait([key])
        with _as_torch_error():
            return self.client.get(self.prefix + key)

    # everything else as the store does it
    def set(self, key: str, value: str | bytes) -> None:  # noqa: D102
        with _as_torch_error():
            self.client.set(self.prefix + key, value)

    def add(self, key: str, amount: int) -> int:  # noqa: D102
        with _as_torch_error():
            return self.client.add(self.prefix + key, amount)

    def check(self, keys: list[str]) -> bool:  # noqa: D102
        with _as_torch_error():
            return self.client.check([self.prefix + key for key in keys])

    def compare_set(self, key: str, expected: str | bytes, desired: str | bytes) -> bytes:  # noqa: D102
        with _as_torch_error():
            return self.client.compare_set(self.prefix + key, expected, desired)

    def delete_key(self, key: str) -> bool:  # noqa: D102
        with _as_torch_error():
            return self.client.delete_key(self.prefix + key)


@contextmanager
def _as_torch_error() -> Iterator[None]:
    """A failure of the connection as torch's store raises one: the callers' DistError handling (a failed
    recovery, told to the agent) applies."""
    try:
        yield
    except wire.StoreError as exc:
        raise dist.DistStoreError(f"the store: {exc}") from None
