"""The process group of each generation: the stale one is abandoned, a fresh one formed among the members.

Why not re-form the stale group in place with torch 2.14's ``_reconfigure``: on Gloo it re-forms the
group, but the collectives that were in flight when the peer died are not aborted (``abort()`` is a
no-op on Gloo too). They keep the group's worker threads blocked, waiting for peers that will never
send, and every new collective queues behind them. A fresh group has threads of its own, so ftrun
abandons the stale group (shuts it down without waiting, and keeps the object alive so that no
destructor ever joins its blocked threads) and forms a new one on a store prefix of its generation.
"""

from __future__ import annotations

import ctypes
import time
from collections.abc import Callable
from datetime import timedelta

import torch.distributed as dist

from ftrun.protocol import Plan


class Superseded(Exception):
    """A newer generation arrived while this one was being formed or used."""


def _abandon(group: dist.ProcessGroup) -> None:
    """Never free ``group``: its destructor would wait for collectives that cannot finish."""
    ctypes.pythonapi.Py_IncRef(ctypes.py_object(group))


class Communicator:
    """Owns the default process group across generations, one fresh group per generation.

    The stale group is aborted first where the backend supports abort (NCCL), which frees kernels
    blocked on a dead peer; then a store barrier among the plan's members (interruptible by a newer
    plan) and a new default group on the prefix ``ftrun/a<attempt>/g<gen>``, so no key of a dead
    generation or attempt is ever read.
    """

    def __init__(self, store: dist.Store, attempt: int, uid: int, backend: str, timeout: timedelta) -> None:
        self.store = store
        self.prefix = f"ftrun/a{attempt}"
        self.uid = uid
        self.backend = backend
        self.timeout = timeout

    def start_alone(self) -> None:
        """A group of this worker alone: a spare waits in it until a plan places it."""
        self._init(f"alone{self.uid}", 0, 1)

    def form(self, plan: Plan, superseded: Callable[[], bool]) -> None:
        """Form ``plan``'s group; raises :class:`Superseded` if a newer plan comes during the barrier."""
        barrier = f"{self.prefix}/g{plan.gen}/arrived/"
        self.store.set(barrier + str(self.uid), "1")
        self._wait_keys([barrier + str(uid) for uid in plan.members], superseded)
        if dist.is_initialized():
            stale = dist.group.WORLD
            _abandon(stale)
            dist.destroy_process_group()
        self._init(f"g{plan.gen}", plan.rank_of(self.uid), plan.world_size)

    def abort(self) -> None:
        """Abort the current communicator where the backend can (NCCL: frees blocked kernels)."""
        if dist.is_initialized() and dist.get_backend() == "nccl":
            abort = getattr(dist.distributed_c10d, "_abort_process_group", None)
            if abort is not None:
                abort()

    def _init(self, name: str, rank: int | None, world_size: int) -> None:
        dist.init_process_group(self.backend, store=dist.PrefixStore(f"{self.prefix}/{name}", self.store),
                                rank=rank, world_size=world_size, timeout=self.timeout)

    def _wait_keys(self, keys: list[str], superseded: Callable[[], bool]) -> None:
        """Wait for every key, checking for a newer plan between short polls (store waits cannot be cut)."""
        while not self.store.check(keys):
            if superseded():
                raise Superseded(keys[0])
            time.sleep(0.001)
