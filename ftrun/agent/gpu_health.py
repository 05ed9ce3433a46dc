"""GPU health on the live job: NVML signals become actions on this node's workers.

The NVML monitor runs on its own thread; each signal it reports is queued and the agent's event loop is
woken through a pipe (:attr:`GpuHealth.wake_fd`) it registers in its selector, so every decision is taken
and acted on by the loop thread (the only thread that touches workers). Drills enter the same path through
:meth:`GpuHealth.inject`.
"""

from __future__ import annotations

import logging
import os
import queue
import signal
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ftrun import events
from ftrun.agent.ports import LocalWorkers, Notices
from ftrun.events import EventSink
from ftrun.health.nvml import NvmlMonitor
from ftrun.health.policy import XidTable, decide
from ftrun.health.signals import SIGNAL_KINDS, Action, Decision, HealthSignal

if TYPE_CHECKING:
    from ftrun.agent.workers import Worker

DRAIN_BATCH = 64
"""Signals the loop handles per wake-up: a flood of them must not keep it from its workers."""
_STYLES = {Action.IGNORE: "dim", Action.RESTART_RANK: "bold yellow", Action.EVICT_GPU: "bold yellow",
           Action.EVICT_NODE: "bold red"}


class _ConsoleHandler(logging.Handler):
    """Shows the monitor's warnings (NVML unusable, a failing call) as ftrun notices."""

    def __init__(self, notices: Notices) -> None:
        super().__init__(logging.WARNING)
        self.notices = notices

    def emit(self, record: logging.LogRecord) -> None:
        self.notices.notice(f"ftrun: {record.getMessage()}", style="yellow")


class GpuHealth:
    """This node's GPU health: one NVML monitor, the Xid policy table, and what each decision does.

    GPUs are mapped to local ranks as the workers see them: local rank ``i`` uses the ``i``-th GPU of
    ``CUDA_VISIBLE_DEVICES`` (every GPU, in NVML order, when it is unset). Without a usable NVML the
    monitor is off and each local rank stands for a virtual GPU of the same index, so drills
    (:meth:`inject`) and evictions behave the same on CPU-only jobs.
    """

    def __init__(self, log: EventSink, notices: Notices, workers: LocalWorkers, end_attempt: Callable[[str], None],
                 table: XidTable, *, local_ranks: int, poll_interval: float = 5.0) -> None:
        self.log = log
        self.notices = notices
        self.workers = workers
        self.end_attempt = end_attempt
        self.table = table
        self.local_ranks = local_ranks
        """Local ranks this node may start workers on: --nproc-per-node and the spares'."""
        self.monitor = NvmlMonitor(self._post, poll_interval=poll_interval)
        self.monitoring = False
        self.evicted: set[int] = set()
        """GPU indices never handed to a worker again in this run."""
        self.node_evicted: str | None = None
        """Why this node is evicted (every worker stopped, no group restart), once it is."""
        self.restarts: set[int] = set()
        """Uids (of the current attempt) killed for a restart on the same GPU: the coordinator replaces each."""
        self._last_xid: dict[int, int] = {}
        self._queue: queue.SimpleQueue[HealthSignal] = queue.SimpleQueue()
        self._closed = False
        self._wake_r, self._wake_w = os.pipe()
        for fd in (self._wake_r, self._wake_w):
            os.set_blocking(fd, False)
        self._log_handler = _ConsoleHandler(notices)

    # ------------------------------------------------------------ lifecycle
    @property
    def wake_fd(self) -> int:
        """Readable when a signal is queued: then call :meth:`drain` from the loop."""
        return self._wake_r

    def start(self) -> None:
        """Start watching (one ``nvmlInit``); without NVML, one notice and the monitor stays off."""
        logger = logging.getLogger("ftrun.health")
        logger.addHandler(self._log_handler)
        logger.propagate = False
        self.monitoring = self.monitor.start()

    def stop(self) -> None:
        """Stop the monitor (it shuts NVML down) and release the wake pipe (unregister it first)."""
        self.monitor.stop()
        self._closed = True
        os.close(self._wake_r)
        os.close(self._wake_w)
        logger = logging.getLogger("ftrun.health")
        logger.removeHandler(self._log_handler)
        logger.propagate = True

    def _post(self, health: HealthSignal) -> None:
        """Monitor thread: queue the signal and wake the event loop."""
        self._queue.put(health)
        if self._closed:  # the monitor outlived stop()'s wait: nobody reads the queue any more
            return
        try:
            os.write(self._wake_w, b"\0")
        except BlockingIOError:
            pass  # the pipe is full: the loop is already due to wake and drains the whole queue

    def drain(self) -> None:
        """Loop thread, when the wake pipe is readable: handle the queued signals, oldest first, at most
        :data:`DRAIN_BATCH` of them; with more queued, the pipe is left readable, so that the loop serves its
        workers and comes back."""
        try:
            while os.read(self._wake_r, 4096):
                pass
        except BlockingIOError:
            pass
        for _ in range(DRAIN_BATCH):
            try:
                health = self._queue.get_nowait()
            except queue.Empty:
                return
            self.handle(health, source="nvml")
        if not self._queue.empty():
            os.write(self._wake_w, b"\0")

    # ------------------------------------------------------------- mapping
    def gpu_of(self, local_rank: int) -> int | None:
        """The GPU index local rank ``local_rank`` uses; its own index as a virtual GPU without NVML."""
        if not self.monitoring:
            return local_rank
        return next((gpu for gpu, rank in self.monitor.gpus.items() if rank == local_rank), None)

    def usable(self, local_rank: int) -> bool:
        """Whether a worker may be started on ``local_rank``: its GPU (if any) is not evicted."""
        return self.node_evicted is None and self.gpu_of(local_rank) not in self.evicted

    def usable_ranks(self, nproc: int) -> list[int]:
        """The local ranks below ``nproc`` a worker may be started on."""
        return [rank for rank in range(nproc) if self.usable(rank)]

    def workers_on(self, gpu: int) -> list[Worker]:
        """The live workers (members, spares, joiners) whose local rank uses GPU ``gpu``."""
        return [w for w in self.workers.live() if self.gpu_of(w.slot.local_rank) == gpu]

    # ------------------------------------------------------------ decisions
    def handle(self, health: HealthSignal, source: str = "nvml") -> Decision:
        """Decide what ``health`` calls for, record and announce it, and act on this node's workers.

        Runs on the agent's loop thread. IGNORE records only. RESTART_RANK kills the worker on that GPU
        (SIGKILL): the survivors recover in place and a replacement starts on the same local rank, with or
        without ``--respawn``. EVICT_GPU kills it and never uses that GPU again in this run (no
        replacement, spare or group restart gets it). EVICT_NODE kills every worker here and ends the
        job on this node, without a group restart.
        """
        decision = decide(health, self.table)
        gpu = health.gpu_index
        if health.kind == "xid":
            self._last_xid[gpu] = health.value
        victims = self.workers_on(gpu)
        self.log.write(events.GPU_HEALTH, kind=health.kind, gpu=gpu, local_rank=health.local_rank,
                                value=health.value, action=decision.action.value, reason=decision.reason,
                                source=source, detail=health.detail, pids=[w.pid for w in victims])
        self.notices.notice(f"ftrun: GPU health: {decision.reason} -> {decision.action.value}",
                                  style=_STYLES[decision.action])
        if decision.action is Action.RESTART_RANK:
            self.restarts.update(w.uid for w in victims)
            self._kill(victims)
        elif decision.action is Action.EVICT_GPU:
            self.evicted.add(gpu)
            self._kill(victims)
        elif decision.action is Action.EVICT_NODE:
            self.node_evicted = decision.reason
            self.end_attempt(f"this node is evicted: {decision.reason}")
        return decision

    def inject(self, kind: str, local_rank: int, value: int) -> Decision:
        """A drill: handle a ``kind`` signal with ``value`` for local rank ``local_rank``'s GPU, as if NVML sent it.

        ``kind`` is one of ``SIGNAL_KINDS`` (``xid`` with the Xid code, ``ecc_uncorrected`` with the
        count...). ValueError (one line) for an unknown kind, or a local rank this node does not run or
        that has no GPU.
        """
        if kind not in SIGNAL_KINDS:
            raise ValueError(f"unknown health signal kind {kind!r} (choose from {', '.join(SIGNAL_KINDS)})")
        if not 0 <= local_rank < self.local_ranks:
            raise ValueError(f"local rank {local_rank} is not on this node (local ranks 0-{self.local_ranks - 1})")
        gpu = self.gpu_of(local_rank)
        if gpu is None:
            raise ValueError(f"local rank {local_rank} has no GPU on this node")
        health = HealthSignal(kind, gpu, int(value), f"injected {kind} {value}", time.time(), local_rank)
        return self.handle(health, source="inject")

    def gpu_status(self) -> dict[int, dict[str, Any]]:
        """Per local rank: ``gpu_index, util, mem_used, mem_total, temperature, ecc_uncorrected, last_xid,
        evicted`` (None where NVML cannot tell); empty when the monitor is off (no GPU, no NVML).
        """
        if not self.monitoring:
            return {}
        return {
            d["local_rank"]: {
                "gpu_index": d["index"], "util": d["utilization"], "mem_used": d["memory_used"],
                "mem_total": d["memory_total"], "temperature": d["temperature"],
                "ecc_uncorrected": d["ecc_uncorrected_volatile"], "last_xid": self._last_xid.get(d["index"]),
                "evicted": d["index"] in self.evicted,
            }
            for d in self.monitor.describe_devices()
        }

    @staticmethod
    def _kill(victims: list[Worker]) -> None:
        for worker in victims:
            worker.send_signal(signal.SIGKILL)
