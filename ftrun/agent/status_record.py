"""The agent's live status record, published to the store about once a second for `ftrun status`.

Every agent publishes its node's record (``ftrun/status/node/<node_rank>``): its workers with their rank,
pid, state, step, step time, time since their last progress, CPU and memory, GPU health, and the node's
last notable events. The leader (node 0) also publishes the job's record (``ftrun/status/job``): run id,
generation, world size now and at start, steps/s, faults survived, recoveries with their latencies.
Publishing is one psutil sample per worker (cached processes) and one or two store ``set`` calls.
"""

from __future__ import annotations

import os
import socket
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import psutil

from ftrun import events
from ftrun.agent.cadence import periodic_interval
from ftrun.agent.ports import Coordination, LocalWorkers
from ftrun.events import EventSink
from ftrun.store.job import JobStore
from ftrun.tally import EventTally, exit_reason

if TYPE_CHECKING:
    from ftrun.agent.workers import Worker

STATUS_INTERVAL = 1.0
"""Seconds between two records (more in a job of many nodes: :func:`~ftrun.agent.cadence.periodic_interval`)."""
RATE_WINDOW = 10.0
"""Seconds over which steps/s is measured."""
PROGRESS_INTERVAL = 5.0
"""Seconds between two ``progress`` events in the event log (about 90 KB of log an hour)."""

GpuStatus = Callable[[], dict[int, dict[str, Any]]]
"""GPU health by local rank: gpu_index, util, mem_used, mem_total, temperature, ecc_uncorrected, last_xid,
evicted (None where unknown); an empty dict where there is no GPU."""


def worker_state(exitcode: int | None, member: bool, spare: bool, recovering: bool, hung: bool) -> str:
    """One word for what a worker is doing: running, recovering, hung, spare, joining, finished or lost (and
    ``unkillable``, set by the caller, for one still there after SIGKILL that ftrun gave up on)."""
    if exitcode is not None:
        return "finished" if exitcode == 0 else "lost"
    if hung:
        return "hung"
    if member:
        return "recovering" if recovering else "running"
    return "spare" if spare else "joining"


@dataclass(frozen=True)
class RunInfo:
    """What the status records say of the run itself."""

    run_id: str  # the run directory's name
    rdzv_id: str
    run_dir: str
    node_rank: int
    nnodes: int
    world_size: int  # at the start


class StatusPublisher:
    """Builds this node's status record (and the job's, on the leader) and writes them to the store.

    Feed every event to :attr:`tally` (an event log listener); point :attr:`coordination` and
    :attr:`attempt` at the current attempt's before publishing.
    """

    def __init__(self, run: RunInfo, workers: LocalWorkers, log: EventSink, gpu_status: GpuStatus | None = None,
                 nodes: int = 1) -> None:
        self.run = run
        self.every = periodic_interval(nodes, STATUS_INTERVAL)
        """Seconds between two records of this node's, in a job of up to ``nodes`` nodes."""
        self.log = log
        self.workers = workers
        self.gpu_status = gpu_status
        self.store: JobStore | None = None
        self.dropped: Callable[[], dict[str, Any]] | None = None
        """The messages the agent refused so far (``mail``, ``channel``, ``last``: why the last was)."""
        self.coordination: Coordination | None = None
        self.leads = run.node_rank == 0
        """Whether this node leads (node 0, or the node elected after it): it publishes the job's record too."""
        self.attempt = 0
        self.tally = EventTally()
        self.host = socket.gethostname()
        self.processes: dict[int, psutil.Process] = {}  # pid -> cached Process (cpu_percent needs the same one)
        self.last_rank: dict[int, int] = {}  # uid -> the rank it held last (shown for workers that ended)
        self.rates: deque[tuple[float, int]] = deque()  # (time, highest committed step) over RATE_WINDOW
        self.next_publish = 0.0
        self.latest: tuple[dict[str, Any] | None, dict[str, Any] | None] = (None, None)
        """The last (job record, node record) built: the job's only on the leader. Replaced as a whole, so
        another thread (the metrics endpoint) always reads a consistent pair."""
        self.logged_step: int | None = None  # the step of the last progress event
        self.next_progress = 0.0  # wall clock: when the next progress event is due

    def tick(self, now: float) -> None:
        """Called from the agent's loop with time.monotonic(): publish when a record is due."""
        if now >= self.next_publish and self.store is not None and self.coordination is not None:
            self.publish()
            self.next_publish = now + self.every

    def publish(self) -> None:
        """Build this node's record, and the job's on the leader, and write them (skipped while the store
        cannot be reached); on the leader, a ``progress`` event now and then."""
        node = self.node_record()
        job = self.job_record() if self.leads else None
        self.latest = (job, node)
        if job is not None:
            self._log_progress(job)
        try:
            self.store.write_status(self.run.node_rank, node)
            if job is not None:
                self.store.write_job_status(job)
        except RuntimeError:  # torch's store errors: a lasting loss of the store is the lease's business
            pass

    def _log_progress(self, job: dict[str, Any]) -> None:
        """A ``progress`` event every PROGRESS_INTERVAL seconds while steps commit: the step rate over the
        run, for `ftrun report`."""
        if job["step"] is None or job["step"] == self.logged_step or job["time"] < self.next_progress:
            return
        self.logged_step, self.next_progress = job["step"], job["time"] + PROGRESS_INTERVAL
        rate = job["steps_per_s"]
        self.log.write(events.PROGRESS, step=job["step"], steps_per_s=None if rate is None else round(rate, 3),
                       world_size=job["world_size"], gen=job["generation"])

    # ------------------------------------------------------------ records
    def node_record(self) -> dict[str, Any]:
        """This node: its agent and one entry per worker of the current attempt, and its recent events."""
        gpus = self.gpu_status() if self.gpu_status else {}
        live = {w.pid for w in self.workers.live()}
        for pid in set(self.processes) - live:
            del self.processes[pid]
        workers = [self._worker(w, gpus.get(w.slot.local_rank)) for w in self.workers.all()]
        return {"node_rank": self.run.node_rank, "host": self.host, "agent_pid": os.getpid(),
                "time": time.time(), "attempt": self.attempt, "workers": workers,
                "dropped": self.dropped() if self.dropped else None, "events": list(self.tally.recent)}

    def job_record(self) -> dict[str, Any]:
        """The job as the leader sees it: the event tally plus generation, world size, progress rate."""
        coordination = self.coordination
        now = time.time()
        step = max(coordination.last_step.values(), default=None)
        summary = self.tally.summary()
        del summary["events"]  # each node record carries its own
        summary.update(
            rdzv_id=self.run.rdzv_id, run_id=self.run.run_id, run_dir=self.run.run_dir, nnodes=self.run.nnodes,
            world_size_initial=self.run.world_size, world_size=coordination.plan.world_size,
            generation=coordination.plan.gen, recovering=coordination.recovering,
            restarting=coordination.restarting, step=step, steps_per_s=self._rate(time.monotonic(), step), time=now)
        return summary

    def _worker(self, worker: Worker, gpu: dict[str, Any] | None) -> dict[str, Any]:
        coordination = self.coordination
        uid = worker.uid
        rank = coordination.plan.rank_of(uid)
        if rank is not None:
            self.last_rank[uid] = rank
        progress = coordination.watchdog.progress.get(uid) if worker.exitcode is None else None
        state = "unkillable" if worker.abandoned else worker_state(
            worker.exitcode, rank is not None, worker.slot.joiner, coordination.recovering,
            uid in coordination.watchdog.killing)
        cpu, rss = self._usage(worker.pid) if worker.exitcode is None else (None, None)
        return {"uid": uid, "rank": self.last_rank.get(uid), "local_rank": worker.slot.local_rank,
                "pid": worker.pid, "state": state, "exit": exit_reason(worker.exitcode),
                "step": coordination.last_step.get(uid),
                "step_time": progress.step_times[-1] if progress and progress.step_times else None,
                "since_progress": time.monotonic() - progress.last if progress else None,
                "cpu_percent": cpu, "rss": rss, "gpu": gpu}

    def _usage(self, pid: int) -> tuple[float | None, int | None]:
        """CPU% since the previous record (None on the first) and resident memory of one worker."""
        process = self.processes.get(pid)
        try:
            if process is None:
                process = self.processes[pid] = psutil.Process(pid)
                process.cpu_percent(None)  # the first call only starts the measurement
                return None, process.memory_info().rss
            return process.cpu_percent(None), process.memory_info().rss
        except psutil.Error:  # it ended between the exit check and now
            return None, None

    def _rate(self, now: float, step: int | None) -> float | None:
        """Committed steps per second over the last RATE_WINDOW seconds (``now``: monotonic, so that a step of
        the wall clock is no burst or stall of training)."""
        if step is None:
            self.rates.clear()
            return None
        if self.rates and step < self.rates[-1][1]:
            self.rates.clear()  # a group restart went back to a saved step
        self.rates.append((now, step))
        while len(self.rates) > 2 and now - self.rates[1][0] >= RATE_WINDOW:
            self.rates.popleft()
        then, first = self.rates[0]
        return (step - first) / (now - then) if now > then else None
