"""Fault drills served by the agent: the ``inject`` command posted to its node's mailbox by `ftrun inject`.

Each drill acts on one local worker, named by its rank (the rank it was started with, as in its console
prefix and in ``ping``), and is recorded as an ``inject`` event as it is carried out (the agent's loop is
single-threaded, so the event precedes the worker's exit and the recovery; a refused drill is not recorded):

- ``kill``       SIGKILL the worker;
- ``hang``       SIGSTOP it (the hang watchdog then kills it);
- ``exception``  the worker raises :class:`ftrun.worker.injected.InjectedFault` in its main thread at its next step;
- ``slow``       the worker sleeps ``seconds`` in each step (0 clears), for ``duration`` seconds if given;
- ``xid``, ``ecc`` a GPU health signal on the worker's GPU, through the same policy path as a real NVML event.

The answer is ``{"ok": True, "run": ..., "message": ..., "rank", "uid", "pid", "fault", "time"}`` (``run``: the
run acted on; ``fault``: whether the worker is expected to be lost, so a recovery follows; ``time``: the
event's, as the drill was carried out) or ``{"ok": False, "run": ..., "error": ...}``.
"""

from __future__ import annotations

import signal
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ftrun import events, protocol
from ftrun.agent.gpu_health import GpuHealth
from ftrun.events import EventSink
from ftrun.health.signals import Action

if TYPE_CHECKING:
    from ftrun.agent.workers import Worker

Answer = dict[str, Any]


class DrillError(Exception):
    """A drill that cannot be carried out: its message is the answer's ``error``."""


class Drills:
    """Serves the ``inject`` command for one agent, on the workers it runs."""

    def __init__(self, log: EventSink, run: str, node_rank: int, ranked: Callable[[], dict[int, Worker]],
                 adopted: Callable[[int], bool], gpu_health: GpuHealth) -> None:
        self.log = log
        self.run = run
        self.node_rank = node_rank
        self.ranked = ranked
        """This node's live workers that hold a rank, by the rank they were started as."""
        self.adopted = adopted
        """Whether a worker (uid) uses the worker API."""
        self.gpu_health = gpu_health
        self.kinds: dict[str, Callable[[Worker, dict[str, Any]], tuple[str, bool]]] = {
            "kill": self._kill, "hang": self._hang, "exception": self._exception, "slow": self._slow,
            "xid": self._gpu, "ecc": self._gpu}

    def inject(self, message: dict[str, Any]) -> Answer:
        """Validate the drill, record it, carry it out; the answer for the client."""
        kind = message.get("kind")
        try:
            if kind not in self.kinds:
                raise DrillError(f"unknown drill {kind!r} (choose from {', '.join(protocol.DRILL_KINDS)})")
            worker = self._worker(message.get("rank"))
            what, fault = self.kinds[kind](worker, message)
        except DrillError as exc:
            return {"ok": False, "run": self.run, "error": str(exc)}
        args = {k: v for k, v in message.items() if k not in ("cmd", "kind", "rank", "reply_to")}
        record = self.log.write(events.INJECT, kind=kind, rank=worker.slot.rank, uid=worker.uid,
                                         pid=worker.pid, args=args)
        where = f"rank {worker.slot.rank} (pid {worker.pid}, node {self.node_rank})"
        return {"ok": True, "run": self.run, "message": f"{where}: {what}", "rank": worker.slot.rank,
                "uid": worker.uid, "pid": worker.pid, "fault": fault, "time": record["time"]}

    def _worker(self, rank: Any) -> Worker:
        """The live worker started as ``rank`` on this node."""
        mine = self.ranked()
        if not isinstance(rank, int) or rank not in mine:
            ranks = ", ".join(str(r) for r in sorted(mine)) or "none"
            raise DrillError(f"node {self.node_rank} runs no live rank {rank!r} (its ranks: {ranks})")
        return mine[rank]

    def _uses_api(self, worker: Worker, kind: str) -> None:
        if not self.adopted(worker.uid):
            raise DrillError(f"rank {worker.slot.rank} does not use the ftrun worker API (ftrun.init()), "
                             f"so it cannot act out '{kind}'; try kill or hang")

    # ------------------------------------------------------------ the drills: (what was done, fault expected)
    @staticmethod
    def _kill(worker: Worker, _message: dict[str, Any]) -> tuple[str, bool]:
        worker.send_signal(signal.SIGKILL)
        return "killed (SIGKILL)", True

    def _hang(self, worker: Worker, _message: dict[str, Any]) -> tuple[str, bool]:
        worker.send_signal(signal.SIGSTOP)
        if self.adopted(worker.uid):
            return "stopped (SIGSTOP); the hang watchdog will kill it", True
        return "stopped (SIGSTOP); it does not use the worker API, so no watchdog will notice", False

    def _exception(self, worker: Worker, _message: dict[str, Any]) -> tuple[str, bool]:
        self._uses_api(worker, "exception")
        text = f"exception injected by ftrun inject into rank {worker.slot.rank}"
        worker.send(protocol.encode(protocol.RAISE, message=text))
        return "will raise InjectedFault at its next step", True

    def _slow(self, worker: Worker, message: dict[str, Any]) -> tuple[str, bool]:
        self._uses_api(worker, "slow")
        seconds, duration = message.get("seconds"), message.get("duration")
        if not protocol.is_duration(seconds, zero=True):
            raise DrillError(f"slow needs 0 to {protocol.MAX_SECONDS:,.0f} SECONDS, not {str(seconds)[:40]}")
        if duration is not None and not protocol.is_duration(duration):
            raise DrillError(f"--for needs more than 0 and at most {protocol.MAX_SECONDS:,.0f} SECONDS, "
                             f"not {str(duration)[:40]}")
        worker.send(protocol.encode(protocol.SLOW, seconds=seconds, duration=duration))
        if seconds == 0:
            return "steps no longer slowed", False
        return f"each step slowed by {seconds:g} s" + (f" for {duration:g} s" if duration else ""), False

    def _gpu(self, worker: Worker, message: dict[str, Any]) -> tuple[str, bool]:
        value = message.get("value")
        if not isinstance(value, int):
            raise DrillError(f"{message['kind']} needs an integer value, not {value!r}")
        kind = "xid" if message["kind"] == "xid" else "ecc_uncorrected"
        try:
            decision = self.gpu_health.inject(kind, worker.slot.local_rank, value)
        except ValueError as exc:
            raise DrillError(str(exc)) from None
        return f"{kind} {value} on its GPU: {decision.action.value} ({decision.reason})", \
            decision.action is not Action.IGNORE
