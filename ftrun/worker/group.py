"""The process group of each generation: the stale one is aborted, a fresh one formed among the members.

Why not re-form the stale group in place with torch 2.14's ``_reconfigure``: on Gloo it re-forms the
group, but the collectives that were in flight when the peer died are not aborted (``abort()`` is a
no-op on Gloo too). They keep the group's worker threads blocked, waiting for peers that will never
send, and every new collective queues behind them. So ftrun aborts a Gloo group itself, by shutting
down the group's own TCP connections: every collective in flight on it fails at once, here and on
every peer. The stale group object is kept alive (its destructor would join threads) and a fresh
group is formed on a store prefix of its generation.
"""

from __future__ import annotations

import ctypes
import os
import socket
import sys
import threading
from collections.abc import Callable
from datetime import timedelta

import psutil
import torch.distributed as dist

from ftrun.protocol import Plan
from ftrun.store import keys
from ftrun.worker.interruptible import InterruptibleStore, StoreTimeout, Superseded


def _abandon(group: dist.ProcessGroup) -> None:
    """Never free ``group``: its destructor would wait for collectives that cannot finish."""
    ctypes.pythonapi.Py_IncRef(ctypes.py_object(group))


def _tcp_fds() -> set[int]:
    """This process's connected TCP sockets (listeners left out: Gloo's must keep accepting)."""
    return {conn.fd for conn in psutil.Process().net_connections(kind="tcp") if conn.fd != -1 and conn.raddr}


def _shut_down(fds: set[int]) -> None:
    """Shut down the sockets behind ``fds`` (both directions) without closing the descriptors."""
    for fd in fds:
        try:
            with socket.socket(fileno=os.dup(fd)) as sock:
                sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass  # already closed by its owner


class Communicator:
    """Owns the default process group across generations, one fresh group per generation.

    The stale group is aborted first where the backend supports abort (NCCL), which frees kernels
    blocked on a dead peer; then a store barrier among the plan's members (interruptible by a newer
    plan) and a new default group on the prefix ``ftrun/a<attempt>/g<gen>``, so no key of a dead
    generation or attempt is ever read.
    """

    def __init__(self, store: dist.Store, attempt: int, uid: int, backend: str, timeout: timedelta) -> None:
        self.store = store
        self.attempt = attempt
        self.uid = uid
        self.backend = backend
        self.timeout = timeout
        self._lock = threading.Lock()
        self._group_fds: set[int] = set()  # the current group's own connections (Gloo)

    def start_alone(self) -> None:
        """A group of this worker alone: a spare waits in it until a plan places it."""
        self._init(f"alone{self.uid}", 0, 1)

    def form(self, plan: Plan, superseded: Callable[[], bool]) -> None:
        """Form ``plan``'s group; raises :class:`Superseded` if a newer plan comes during the barrier."""
        self.store.set(keys.arrived(self.attempt, plan.gen, self.uid), "1")
        self._wait_members(plan, superseded)
        if dist.is_initialized():
            self.abort()
            _abandon(dist.group.WORLD)
            dist.destroy_process_group()
        self._init(f"g{plan.gen}", plan.rank_of(self.uid), plan.world_size, superseded)

    def abort(self) -> None:
        """Make every collective in flight on the current group fail now, here and on its peers.

        NCCL: ``_abort_process_group`` where this torch has it. Gloo: shut down the group's connections.
        Safe to call from the watcher thread, and more than once.
        """
        if not dist.is_initialized():
            return
        if dist.get_backend() == "nccl":
            abort = getattr(dist.distributed_c10d, "_abort_process_group", None)
            if abort is not None:
                abort()
            return
        with self._lock:
            fds, self._group_fds = self._group_fds, set()
        _shut_down(fds)

    def _init(self, name: str, rank: int | None, world_size: int, superseded: Callable[[], bool] = lambda: False) -> None:
        before, hook = _tcp_fds(), sys.excepthook
        store = dist.PrefixStore(keys.group_prefix(self.attempt, name), self.store)
        if "nccl" not in self.backend:  # NCCL reads the store in its first collective, not here
            store = InterruptibleStore(store, superseded)  # a newer plan ends the group's rendezvous
        try:
            dist.init_process_group(self.backend, store=store, rank=rank, world_size=world_size, timeout=self.timeout)
        except Exception:
            if superseded():  # torch may hand back the store's Superseded as its own error
                raise Superseded(name) from None
            raise
        sys.excepthook = hook  # torch's would stack a "[rankN]:" prefix per group; the agent prefixes lines
        with self._lock:
            self._group_fds = _tcp_fds() - before

    def _wait_members(self, plan: Plan, superseded: Callable[[], bool]) -> None:
        """Wait until every member of ``plan`` has reached its barrier; Superseded when a newer plan comes,
        one clear error naming the missing workers after the process group's timeout."""
        arrived = {uid: keys.arrived(self.attempt, plan.gen, uid) for uid in plan.members}
        try:
            InterruptibleStore(self.store, superseded).wait(list(arrived.values()), self.timeout)
        except StoreTimeout:
            missing = [uid for uid, key in arrived.items() if not self.store.check([key])]
            raise RuntimeError(f"ftrun: worker{'s' if len(missing) > 1 else ''} {missing} did not reach generation "
                               f"{plan.gen}'s barrier within {self.timeout.total_seconds():g} s (the process group "
                               "timeout of ftrun.init)") from None
