"""A store view whose waits a newer generation's plan cuts short, and which always end by a deadline.

torch's store waits block in C++ until the key appears or their timeout passes (30 minutes for a process
group): nothing can interrupt them. A process group formed for a plan that a newer one replaced (a member
died at the barrier, or during the group's own rendezvous) would sit there for that long. This view waits
through a connection of its own, ftrun's torch-free client (:class:`ftrun.store.wire.StoreClient`), in
slices of WAIT_SLICE seconds, and between slices asks whether the plan was superseded: a key is seen the
moment it is written (the server answers the WAIT then), and a slice that ends unanswered withdraws its
WAIT (CANCEL_WAIT), silently. (Polling with pauses, as before, saw a key up to a pause late, twice or more
per rendezvous; torch's own client logs two warning lines at each timeout of a short blocking wait.)

torch calls a Python :class:`torch.distributed.Store` subclass back from C++ (its ``PythonStore``
trampoline), so the view also serves as the store of ``init_process_group``: Gloo's rendezvous waits for each
peer's address through it, and a newer plan ends that wait too (measured: torch 2.14 and 2.15, Gloo).
"""

from __future__ import annotations

import time
from collections.abc import Callable
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
    """``inner``, with waits (and gets of a key not yet written) that raise :class:`Superseded` as soon as
    ``superseded()`` says so, and :class:`StoreTimeout` at their timeout (the inner store's by default).

    ``waiter`` is a connection of this view's own to the server behind ``inner`` (one request at a time: a
    view waited on by two threads at once needs two), and ``prefix`` what ``inner`` puts before each key
    (a :class:`torch.distributed.PrefixStore`'s prefix; empty for none).
    """

    def __init__(self, inner: dist.Store, superseded: Callable[[], bool], waiter: wire.StoreClient,
                 prefix: str = "") -> None:
        super().__init__()
        self.inner = inner
        self.superseded = superseded
        self.waiter = waiter
        self.prefix = f"{prefix}/" if prefix else ""

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        """Return once every key exists."""
        seconds = (timeout or self.inner.timeout).total_seconds()
        deadline = time.monotonic() + seconds
        names = [self.prefix + key for key in keys]
        while True:
            if self.superseded():
                raise Superseded(keys[0])
            left = deadline - time.monotonic()
            if left <= 0:
                raise StoreTimeout(f"{keys} not all written within {seconds:g} s")
            try:
                self.waiter.wait(names, min(WAIT_SLICE, left))
                return
            except wire.StoreTimeout:
                continue
            except wire.StoreError as exc:  # as torch's store raises it: the callers' DistError handling applies
                raise dist.DistStoreError(f"waiting for {keys[0]}: {exc}") from None

    def get(self, key: str) -> bytes:
        """The value of ``key``, once it is written."""
        self.wait([key])
        return self.inner.get(key)

    # everything else as the inner store does it
    def set(self, key: str, value: str | bytes) -> None:  # noqa: D102
        self.inner.set(key, value)

    def add(self, key: str, amount: int) -> int:  # noqa: D102
        return self.inner.add(key, amount)

    def check(self, keys: list[str]) -> bool:  # noqa: D102
        return self.inner.check(keys)

    def compare_set(self, key: str, expected: str | bytes, desired: str | bytes) -> bytes:  # noqa: D102
        return self.inner.compare_set(key, expected, desired)

    def delete_key(self, key: str) -> bool:  # noqa: D102
        return self.inner.delete_key(key)

    def num_keys(self) -> int:  # noqa: D102
        return self.inner.num_keys()
