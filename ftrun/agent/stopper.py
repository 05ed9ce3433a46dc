"""Stopping an attempt's workers on this node: save (on a preemption), signal, SIGKILL, give up on the unkillable.

The schedule and the phases are :mod:`ftrun.agent.shutdown`'s pure functions; the :class:`Stopper` carries
out each phase's action once, as the stop enters it, and reports what the workers saved.
"""

from __future__ import annotations

import signal
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from ftrun import events, protocol
from ftrun.agent.ports import Notices, WorkerHandle
from ftrun.agent.shutdown import Phase, StopSchedule, kill_now, phase
from ftrun.events import EventSink
from ftrun.processes import signal_name

_ORDER = (Phase.SAVE, Phase.SIGNAL, Phase.KILL, Phase.ABANDON)


class Stopper:
    """One stop of this node's workers (and, on the leader, of the workers it answers for).

    ``workers`` returns the live workers still waited for; ``abandon`` is called for each one still there
    :data:`~ftrun.agent.shutdown.KILL_WAIT` seconds after SIGKILL. ``savers`` (the live workers that use the
    worker API, on a preemption) are asked to write their last committed state to ``<run dir>/rescue`` first.
    ``node``: this node's rank; only node 0's line says how to resume (``--resume-from`` reads node 0's).
    ``copies``: sharded state also saves its copies of other ranks' shards (a member may be lost).
    """

    def __init__(self, stop: StopSchedule, workers: Callable[[], list[WorkerHandle]],
                 abandon: Callable[[WorkerHandle, float], None], log: EventSink, notices: Notices,
                 run_dir: Path, savers: Sequence[WorkerHandle] = (), node: int = 0, copies: bool = False) -> None:
        self.stop = stop
        self.node = node
        self.workers = workers
        self.abandon = abandon
        self.log = log
        self.notices = notices
        self.run_dir = run_dir
        self.waiting = {w.uid for w in savers}  # asked to save, not answered yet
        self.saved: dict[int, int] = {}  # uid -> the committed step it wrote
        self.errors: dict[int, str] = {}  # uid -> why it could not
        self.phase: Phase | None = None
        for worker in savers:
            worker.send(protocol.encode(protocol.SAVE, copies=copies))
        self.tick(stop.began)

    @property
    def saving(self) -> bool:
        """Whether a worker asked to save is still at it (neither answered nor ended)."""
        return any(w.uid in self.waiting for w in self.workers())

    def on_message(self, uid: int, message: dict[str, Any]) -> None:
        """A worker's control message: its answer to the request to save."""
        if message.get("t") != protocol.SAVED or uid not in self.waiting:
            return
        self.waiting.discard(uid)
        if message.get("error"):
            self.errors[uid] = str(message["error"])
        else:
            self.saved[uid] = int(message["step"])

    def kill_now(self, now: float) -> None:
        """No more saving or waiting: SIGKILL every worker left."""
        self.stop = kill_now(self.stop, now)
        self.tick(now)

    def tick(self, now: float) -> None:
        """Enter the phase the schedule has reached, taking every action on the way once."""
        current = phase(self.stop, now, self.saving)
        start = _ORDER.index(current) if self.phase is None else _ORDER.index(self.phase) + 1
        for step in _ORDER[start:_ORDER.index(current) + 1]:
            if self.phase is Phase.SAVE:
                self._report_saved()
            self.phase = step
            self._enter(step, now)

    def _enter(self, step: Phase, now: float) -> None:
        if step is Phase.SIGNAL:
            for worker in self.workers():
                worker.send_signal(self.stop.sig)
        elif step is Phase.KILL:
            for worker in self.workers():
                worker.send_signal(signal.SIGKILL)
        elif step is Phase.ABANDON:
            for worker in self.workers():
                self.abandon(worker, round(now - self.stop.kill_at, 3))

    def _report_saved(self) -> None:
        """The save phase is over: record what was saved, and tell the person how to go on from it."""
        best = max(self.saved.values(), default=-1)
        self.log.write(events.RESCUE, saved=self.saved, best_step=best, missing=sorted(self.waiting),
                       errors=self.errors, why=signal_name(self.stop.sig))
        if best >= 0 and self.node != 0:
            self.notices.notice(f"ftrun: node {self.node}: the state of step {best} is saved in "
                                f"{self.run_dir / 'rescue'} (a new launch resumes from node 0's)", style="green")
        elif best >= 0:
            self.notices.notice(f"ftrun: the state of step {best} is saved in {self.run_dir / 'rescue'}; "
                                f"`ftrun --resume-from {self.run_dir} ...` continues from it", style="bold green")
        elif self.errors:
            self.notices.notice(f"ftrun: no state could be saved: {next(iter(self.errors.values()))}",
                                style="bold red")
        else:
            self.notices.notice("ftrun: no state was saved (no step committed yet, or no worker answered within "
                                f"{self.stop.save_until - self.stop.began:g} s)", style="bold yellow")
