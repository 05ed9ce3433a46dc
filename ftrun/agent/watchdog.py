"""The agent's hang watchdog: notices a rank that stopped making progress, dumps its stacks, kills it.

A rank whose process is stopped (SIGSTOP, a debugger) is killed without a dump.

The kill turns a hang into the fault every other path already handles: the survivors recover in place. A
rank is killed once: until it has ended, nothing is judged again (its peers wait for it inside a collective),
and one still there :data:`~ftrun.agent.shutdown.KILL_WAIT` seconds after SIGKILL is handed back as
unkillable, for the agent to give up on.
"""

from __future__ import annotations

import signal
import time
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import psutil

from ftrun import events
from ftrun.agent.ports import LocalWorkers, Notices
from ftrun.agent.shutdown import KILL_WAIT
from ftrun.events import EventSink
from ftrun.health.hangs import HangPolicy, RankActivity, hang_timeout, hung_ranks
from ftrun.protocol import STACK_DUMP_SIGNAL

if TYPE_CHECKING:
    from ftrun.agent.workers import Worker

DUMP_GRACE = 0.5  # seconds between the stack dump request and the kill


@dataclass
class _Progress:
    last: float  # time.monotonic() of the last progress message
    committed: int = 0
    committed_step: int = -1
    entered_step: int = -1
    step_times: deque[float] = field(default_factory=lambda: deque(maxlen=20))


class HangWatchdog:
    """Tracks the progress of this node's workers and handles the ones that hang."""

    def __init__(self, workers: LocalWorkers, log: EventSink, notices: Notices, policy: HangPolicy) -> None:
        self.workers = workers
        self.log = log
        self.notices = notices
        self.policy = policy
        self.progress: dict[int, _Progress] = {}
        self.killing: dict[int, float] = {}  # uid -> when to SIGKILL it (after its stack dump)
        self.killed: dict[int, float] = {}  # uid -> when it got SIGKILL, until it is seen to have ended

    def started(self, uid: int) -> None:
        """A worker joined through the API: its clock starts now."""
        self.progress[uid] = _Progress(time.monotonic())

    def committed(self, uid: int, step: int, step_time: float) -> None:
        """A worker committed ``step``, which took ``step_time`` seconds (and every step since the one it told
        before: a worker tells its commits only now and then)."""
        p = self.progress.setdefault(uid, _Progress(time.monotonic()))
        told = max(1, step - p.committed_step) if p.committed_step >= 0 else 1
        p.last, p.committed, p.committed_step = time.monotonic(), p.committed + told, step
        p.step_times.append(step_time)

    def entered(self, uid: int, step: int) -> None:
        """A worker started the first collective of ``step``."""
        p = self.progress.setdefault(uid, _Progress(time.monotonic()))
        p.last, p.entered_step = time.monotonic(), step

    def finished(self, uid: int) -> None:
        """A worker left its step loop: it is no longer expected to make progress."""
        self.progress.pop(uid, None)

    def restart_clocks(self, uids: list[int]) -> None:
        """After a recovery: time spent recovering is not time without progress."""
        now = time.monotonic()
        for uid in uids:
            if uid in self.progress:
                self.progress[uid].last = now

    def kill_due(self) -> list[tuple[Worker, float]]:
        """SIGKILL the hung workers whose stack dump had its time; return those still there KILL_WAIT s after
        their SIGKILL, with the seconds since (each once): they will not die."""
        now = time.monotonic()
        for uid, when in list(self.killing.items()):
            if now >= when:
                del self.killing[uid]
                self.workers.get(uid).send_signal(signal.SIGKILL)
                self.killed[uid] = now
        unkillable = []
        for uid, when in list(self.killed.items()):
            worker = self.workers.get(uid)
            if worker.exitcode is not None or worker.abandoned:
                del self.killed[uid]
            elif now - when >= KILL_WAIT:
                del self.killed[uid]
                unkillable.append((worker, round(now - when, 3)))
        return unkillable

    def check(self, members: list[int]) -> str | None:
        """Start dumping and killing hung members (recovery follows their death); a reason if all are stuck."""
        if self.killing or self.killed:
            return None  # judge again once the culprits are gone and the survivors have recovered
        now = time.monotonic()
        activity = {uid: self._activity(uid, now) for uid in members if uid in self.progress}
        culprits, stuck = hung_ranks(activity)
        for uid in culprits:
            self._dump_and_kill(uid, activity[uid], now)
        if stuck:
            longest = max(a.silent_for for a in activity.values())
            return f"every rank has made no progress for {longest:.0f} s (a hang inside a collective)"
        return None

    def _activity(self, uid: int, now: float) -> RankActivity:
        p = self.progress[uid]
        silent_for, timeout = now - p.last, hang_timeout(self.policy, p.step_times, p.committed)
        # Only a silent rank's process state matters, and reading it costs a /proc read: every tick, for every
        # rank, it took several per cent of a core from the workers.
        stopped = silent_for > timeout and _is_stopped(self.workers.get(uid).pid)
        return RankActivity(silent_for, timeout, p.entered_step > p.committed_step, stopped)

    def _dump_and_kill(self, uid: int, activity: RankActivity, now: float) -> None:
        worker = self.workers.get(uid)
        self.log.write(events.HANG, uid=uid, rank=worker.slot.rank, pid=worker.pid,
                                silent_for=round(activity.silent_for, 3), timeout=round(activity.timeout, 3),
                                stopped=activity.stopped, in_collective=activity.in_collective)
        # A stopped process cannot run the dump's handler without being resumed, and resumed it would train on
        # beside its replacement group while faulthandler walks the frames of its running threads (which can
        # crash it: SIGSEGV). Its stacks say only where the stop caught it: it is killed as it is.
        what = "stopped: killing it" if activity.stopped else "dumping its stacks, then killing it"
        self.notices.notice(
            f"ftrun: rank {worker.slot.rank} (pid {worker.pid}) made no progress for {activity.silent_for:.1f} s "
            f"(timeout {activity.timeout:.1f} s): {what}", style="bold yellow")
        if activity.stopped:
            worker.send_signal(signal.SIGKILL)
            self.killed[uid] = now
        else:
            worker.send_signal(STACK_DUMP_SIGNAL)
            self.killing[uid] = now + DUMP_GRACE


def _is_stopped(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_STOPPED
    except psutil.Error:
        return False
