"""The leader's side of the other nodes: their workers' news, their leases, their loss.

Every follower relays its workers' starts, control messages and exits to the leader's mailbox; the leader
reaches a follower's workers through that node's mailbox. A node whose lease ran out, or whose agent the
hostfile launcher saw end, is lost: all its ranks are one fault.
"""

from __future__ import annotations

import signal
import time
from dataclasses import dataclass
from typing import Any

from ftrun import events, protocol
from ftrun.agent.failures import WorkerFailure
from ftrun.agent.ports import LeaderInbox, Notices, Restart, WorkerControl, WorkerHandle
from ftrun.agent.workers import WorkerSlot
from ftrun.events import EventSink
from ftrun.protocol import Plan, node_of
from ftrun.store import keys
from ftrun.store.leases import NodeLeases
from ftrun.store.mailbox import Outbox


def relay_mail(uid: int, data: bytes) -> tuple[str, dict[str, Any]]:
    """The mail (box, message) that asks worker ``uid``'s agent to hand ``data`` on to it."""
    return keys.node_box(node_of(uid)), {"t": protocol.RELAY, "data": data.decode(), "uid": uid}


def mail(outbox: Outbox, messages: list[tuple[str, dict[str, Any]]], broadcast: dict[str, Any] | None = None
         ) -> None:
    """Send the leader's mail (or ``broadcast`` it to every node); dropped while the store does not answer (an
    etcd cluster can be unreachable from node 0): a lasting loss is the leases' business, on both sides."""
    try:
        if broadcast is not None:
            outbox.broadcast(broadcast)
        if messages:
            outbox.send_many(messages)
    except RuntimeError:
        pass


@dataclass
class Takeover:
    """A newly elected leader's wait before it plans without the lost leader's workers."""

    lost: int  # the node whose lease ran out (the leader before)
    why: str
    since: float  # wall clock: when it last renewed
    awaiting: set[int]  # the other nodes that have yet to tell of their workers
    deadline: float  # monotonic: plan without those that have not by then (their leases judge them)


class RemoteWorker:
    """The leader's handle on a worker of another node: what the leader's coordination needs of a worker."""

    def __init__(self, outbox: Outbox, slot: WorkerSlot, pid: int) -> None:
        self.outbox = outbox
        self.slot = slot
        self.pid = pid
        self.exitcode: int | None = None

    @property
    def uid(self) -> int:
        """The worker's id in generation plans."""
        return self.slot.uid

    def send(self, data: bytes) -> None:
        """Relay control messages to the worker through its agent."""
        mail(self.outbox, [relay_mail(self.uid, data)])

    def send_signal(self, sig: int) -> None:
        """Ask the worker's agent to signal it."""
        if self.exitcode is None:
            self._tell_agent({"t": protocol.SIGNAL, "sig": int(sig)})

    def _tell_agent(self, message: dict[str, Any]) -> None:
        mail(self.outbox, [(keys.node_box(node_of(self.uid)), {**message, "uid": self.uid})])


class RemoteNodes:
    """The other nodes as the leader sees them: feeds their workers' news to the leader's coordination."""

    def __init__(self, outbox: Outbox, leases: NodeLeases, nnodes: int, attempt: int, log: EventSink,
                 notices: Notices, control: WorkerControl, coordination: LeaderInbox, node_rank: int = 0,
                 late: tuple[int, int] | None = None) -> None:
        self.node_rank = node_rank  # the leader's own node: 0, or the node elected after it
        self.outbox = outbox
        self.leases = leases
        self.nnodes = nnodes  # at most (--nnodes MIN:MAX's MAX)
        # --nnodes MIN:MAX: nodes from rank MIN on join the running job, each with this many training workers
        self.first_late, self.late_nproc = late if late is not None else (nnodes, 0)
        self.joined: set[int] = set()  # such nodes that joined in this attempt
        # the nodes the job starts with whose workers have yet to start (a progress line says so meanwhile); a
        # leader elected after node 0 takes over a running job
        self.starting: set[int] | None = set(range(1, self.first_late)) if node_rank == 0 else None
        self.attempt = attempt
        self.log = log
        self.notices = notices
        self.control = control
        self.coordination = coordination
        self.remote: dict[int, RemoteWorker] = {}  # the other nodes' workers, by uid
        self.lost: dict[int, str] = {}  # the nodes lost in this attempt: why, by node
        self.takeover: Takeover | None = None  # a new leader's wait for the other nodes' news of their workers

    def present(self) -> list[int]:
        """The other nodes whose workers this attempt heard of, less those lost."""
        return sorted({node_of(uid) for uid in self.remote} - set(self.lost))

    def live(self) -> list[RemoteWorker]:
        """The other nodes' workers that have not ended."""
        return [w for w in self.remote.values() if w.exitcode is None]

    def take_over(self, plan: Plan, takeover: Takeover) -> None:
        """This node was elected leader after ``takeover.lost``'s loss: that node's members of ``plan`` are
        lost once every node in ``takeover.awaiting`` has told of its workers (or its time is up)."""
        for uid in plan.members:
            if node_of(uid) == takeover.lost:  # its local rank is not known here: its index on its node stands in
                slot = WorkerSlot(uid=uid, worker_id=f"{takeover.lost}:{uid}", local_rank=uid % protocol.UID_STRIDE,
                                  rank=plan.rank_of(uid))
                self.remote[uid] = RemoteWorker(self.outbox, slot, 0)
        self.takeover = takeover
        self.tick(time.monotonic())

    def tick(self, now: float) -> None:
        """Nodes whose lease ran out are lost (none is judged while the store does not answer)."""
        takeover = self.takeover
        if takeover is not None and (not takeover.awaiting or now >= takeover.deadline):
            self.takeover = None
            self.node_lost(takeover.lost, takeover.why, takeover.since)
        try:
            expired = self.leases.expired(now)
        except RuntimeError:
            return
        for node, ago in expired:
            never = self.starting is not None and node in self.starting and not any(
                node_of(uid) == node for uid in self.remote)
            why = (f"it did not start within {self.leases.start_grace:g} s (--rdzv-conf join_timeout)" if never
                   else f"its lease expired (no renewal for {self.leases.timeout:g} s)")
            self.node_lost(node, why, time.time() - ago)

    def on_mail(self, message: dict[str, Any]) -> None:
        """A follower's news of its workers (or the hostfile launcher's news of a follower's end)."""
        kind, uid = message["t"], message.get("uid")
        if kind == protocol.COMMITS:  # each as if told alone
            for entry in message["commits"]:
                self.on_mail({"t": protocol.WORKER_MESSAGE, **entry})
            return
        if kind == protocol.NODE_GONE:
            if message["node"] in self.leases.seen:
                self.node_lost(message["node"], message["reason"], message["since"])
            return
        if kind == protocol.FOLLOWING:
            self.coordination.seen_generation(message["gen"])
            if self.takeover is not None:
                self.takeover.awaiting.discard(message["node"])
            return
        if kind == protocol.NODE_STUCK:
            self.coordination.node_stuck(message["node"], message["gen"], message["reason"])
            return
        if kind == protocol.WORKER_STARTED:
            if node_of(uid) in self.leases.seen:  # heard from: its lease counts from now at the latest
                self.leases.watch(node_of(uid), time.monotonic())
            else:
                self._admit(node_of(uid))
            slot = WorkerSlot(uid=uid, worker_id=f"{node_of(uid)}:{uid}", local_rank=message["local_rank"],
                              rank=message["rank"], joiner=message["joiner"])
            self.remote[uid] = RemoteWorker(self.outbox, slot, message["pid"])
            self.log.write(events.WORKER_START, uid=uid, rank=slot.rank, local_rank=slot.local_rank,
                           pid=message["pid"], joiner=slot.joiner, attempt=self.attempt, node=node_of(uid))
            return
        worker = self.remote.get(uid)
        if worker is None or worker.exitcode is not None:
            return  # a worker of a node already declared lost
        if kind == protocol.WORKER_MESSAGE:
            self.control.worker_message(worker, message["msg"])
        elif kind == protocol.WORKER_EXITED:
            worker.exitcode = message["code"]
            self.log.write(events.WORKER_EXIT, uid=uid, rank=worker.slot.rank, pid=worker.pid,
                           exitcode=worker.exitcode, node=node_of(uid))
            if worker.exitcode == 0:
                self.coordination.on_finished(worker)
            elif not self.control.stopping():
                self.control.workers_failed([(worker, WorkerFailure(**message["failure"]))])

    def unstarted(self) -> list[int]:
        """The nodes the job starts with (--nnodes, or MIN of MIN:MAX) whose workers have not started, less
        those lost."""
        if self.starting is None:
            return []
        return sorted(self.starting - {node_of(uid) for uid in self.remote} - set(self.lost))

    def waiting(self) -> str | None:
        """Which of the nodes the job starts with it still waits for, or None; each has the leases' start grace
        (--rdzv-conf join_timeout) to renew its lease for the first time, or it is lost."""
        missing = self.unstarted()
        if not missing:
            self.starting = None
            return None
        return (f"waiting for node{'s' * (len(missing) > 1)} {', '.join(map(str, missing))} to start "
                f"{'their' if len(missing) > 1 else 'its'} workers ({self.first_late - len(missing)} of "
                f"{self.first_late} nodes here): up to {self.leases.start_grace:g} s")

    def _admit(self, node: int) -> None:
        """A late node's first worker started: watch its lease, and grow the generation by its workers (they
        join as joiners: placed at the next generation, taking their state from their peers)."""
        if node < self.first_late or node in self.joined or node in self.lost:
            return
        self.joined.add(node)
        self.leases.watch(node, time.monotonic())
        target = self.coordination.grow(self.late_nproc)
        self.log.write(events.NODE_JOINED, node=node, target=target)
        self.notices.notice(f"ftrun: node {node} joined: its workers join the group at the next generation",
                            style="bold")

    def node_lost(self, node: int, why: str, since: float) -> None:
        """Declare ``node`` lost (gone since ``since``, wall clock): its workers are one fault."""
        self.leases.forget(node)
        lost = [w for w in self.live() if node_of(w.uid) == node]
        if not any(node_of(uid) == node for uid in self.remote):  # lost before its workers started
            self.lost[node] = why
            self.control.end_attempt(f"node {node} was lost before its workers started: {why}")
            return
        if not lost:
            return  # its workers had all ended: it was done, not lost
        self.lost[node] = why
        self.log.write(events.NODE_LOST, node=node, reason=why, ranks=[w.slot.rank for w in lost])
        if not self.control.stopping():  # in a stop, the nodes end as they were told to: no news
            self.notices.notice(f"ftrun: node {node} lost: {why}", style="bold yellow")
        faults: list[tuple[WorkerHandle, WorkerFailure]] = []
        for worker in lost:
            worker.exitcode = -signal.SIGKILL
            faults.append((worker, WorkerFailure(worker.slot.rank, worker.slot.local_rank, worker.pid,
                                                 -signal.SIGKILL, since, f"node {node} lost: {why}", "")))
        if not self.control.stopping():
            self.control.workers_failed(faults)

    def start_replacement(self, worker: WorkerHandle) -> None:
        """Ask ``worker``'s node to start a joiner in its place."""
        mail(self.outbox, [(keys.node_box(node_of(worker.uid)), {"t": protocol.START_WORKER, "uid": worker.uid,
                                                                 "local_rank": worker.slot.local_rank,
                                                                 "rank": worker.slot.rank})])

    def relay(self, workers: list[WorkerHandle], data: bytes) -> None:
        """Relay the same control message to each of these workers of other nodes, through their agents: one
        broadcast, written once whatever the number of nodes (a plan; each node hands it to its workers among
        ``workers``)."""
        mail(self.outbox, [], {"t": protocol.RELAY_ALL, "data": data.decode(), "uids": [w.uid for w in workers]})

    def end(self, reason: str | None, restart: Restart | None) -> None:
        """Tell every other node how the leader's attempt ended: it succeeded (``reason`` None), the group
        restarts (``restart``: as which attempt, in which store), or it failed with ``reason`` (each node stops
        its workers too)."""
        if restart is not None:
            message: dict[str, Any] = {"t": protocol.RESTART, "attempt": restart.attempt, "reason": reason or "",
                                       "store": f"{restart.store.host}:{restart.store.port}"}
        elif reason is None:
            message = {"t": protocol.DONE}
        else:
            message = {"t": protocol.STOP, "reason": f"the leader stopped: {reason}"}
        mail(self.outbox, [(keys.node_box(node), message) for node in range(self.nnodes)
                           if node != self.node_rank and node not in self.lost])
