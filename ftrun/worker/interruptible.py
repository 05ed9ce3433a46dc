"""A store view whose waits a newer generation's plan cuts short, and which always end by a deadline.

torch's store waits block in C++ until the key appears or their timeout passes (30 minutes for a process
group): nothing can interrupt them. A process group formed for a plan that a newer one replaced (a member
died at the barrier, or during the group's own rendezvous) would sit there for that long. This view polls
instead, with a growing pause (1 ms up to 5 ms for the first second, the time a recovery's barrier and
rendezvous take, then up to 50 ms: quick to notice a key, cheap on the store when waiting long), and between
polls asks whether the plan was superseded. (A blocking wait with a short timeout would notice a key at once,
but torch's client logs two warning lines at each of its timeouts.)

torch calls a Python :class:`torch.distributed.Store` subclass back from C++ (its ``PythonStore``
trampoline), so the view also serves as the store of ``init_process_group``: Gloo's rendezvous waits for each
peer's address through it, and a newer plan ends that wait too (measured: torch 2.14 and 2.15, Gloo).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from datetime import timedelta

import torch.distributed as dist

FIRST_PAUSE = 0.001
QUICK_PAUSE = 0.005  # the longest pause within the first QUICK_WINDOW seconds of a wait
QUICK_WINDOW = 1.0
LONGEST_PAUSE = 0.05


class Superseded(Exception):
    """A newer generation arrived while this one was being formed or used."""


class StoreTimeout(RuntimeError):
    """Keys a wait was for were not written by its deadline."""


class InterruptibleStore(dist.Store):
    """``inner``, with waits (and gets of a key not yet written) that raise :class:`Superseded` as soon as
    ``superseded()`` says so, and :class:`StoreTimeout` at their timeout (the inner store's by default)."""

    def __init__(self, inner: dist.Store, superseded: Callable[[], bool]) -> None:
        super().__init__()
        self.inner = inner
        self.superseded = superseded

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        """Return once every key exists."""
        seconds = (timeout or self.inner.timeout).total_seconds()
        started = time.monotonic()
        pause = FIRST_PAUSE
        while not self.inner.check(keys):
            if self.superseded():
                raise Superseded(keys[0])
            waited = time.monotonic() - started
            if waited > seconds:
                raise StoreTimeout(f"{keys} not all written within {seconds:g} s")
            time.sleep(pause)
            pause = min(2 * pause, QUICK_PAUSE if waited < QUICK_WINDOW else LONGEST_PAUSE)

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
