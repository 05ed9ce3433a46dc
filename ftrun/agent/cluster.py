"""Several nodes, one job: the leader's view of other nodes' workers, the followers' relay, node leases.

Node 0's agent is the leader: its Coordinator plans every generation. Each other agent (a follower) runs
its own workers and hang watchdog, and relays to the leader, through the leader's mailbox in the store,
what the Coordinator needs: worker starts, their control messages and their exits. The leader reaches a
follower's workers through that node's mailbox. Every follower renews a lease in the store; the leader
declares a node lost when its lease is older than ``--node-timeout``, and a follower that cannot renew
for that long stops its own workers (fences itself), so a partitioned node never trains on alone.
"""

from __future__ import annotations

import json
import signal
import threading
import time
from dataclasses import asdict
from typing import TYPE_CHECKING, Any

from ftrun import control, protocol
from ftrun.agent.failures import WorkerFailure
from ftrun.agent.watchdog import HangWatchdog
from ftrun.agent.workers import WorkerSlot
from ftrun.health.hangs import HangPolicy
from ftrun.protocol import UID_STRIDE

if TYPE_CHECKING:
    from ftrun.agent.agent import Agent
    from ftrun.agent.workers import Worker

LEADER_BOX = control.node_box(0)
"""Followers write to node 0's mailbox: node 0's agent is the leader."""

PROGRESS_FORWARD_INTERVAL = 0.5
"""A follower forwards a worker's first commit of each generation at once, later ones at most this often."""


def node_of(uid: int) -> int:
    """The node rank that started worker ``uid``."""
    return uid // UID_STRIDE


def lease_key(node_rank: int) -> str:
    """The store counter node ``node_rank`` increments to renew its lease."""
    return f"ftrun/lease/{node_rank}"


def evicted_key(node_rank: int) -> str:
    """Set by the leader when it declared node ``node_rank`` lost: that node must stop."""
    return f"ftrun/evicted/{node_rank}"


class RemoteWorker:
    """The leader's handle on a worker of another node, with the parts of :class:`Worker` the Coordinator uses."""

    def __init__(self, store: Any, slot: WorkerSlot, pid: int) -> None:
        self.store = store
        self.slot = slot
        self.pid = pid
        self.exitcode: int | None = None

    @property
    def uid(self) -> int:
        """The worker's id in generation plans."""
        return self.slot.uid

    def send(self, data: bytes) -> None:
        """Relay control messages to the worker through its agent."""
        self._tell_agent({"t": "relay", "data": data.decode()})

    def send_signal(self, sig: int) -> None:
        """Ask the worker's agent to signal it."""
        if self.exitcode is None:
            self._tell_agent({"t": "signal", "sig": int(sig)})

    def _tell_agent(self, message: dict[str, Any]) -> None:
        control.post(self.store, control.node_box(node_of(self.uid)), {**message, "uid": self.uid})


class LeaseKeeper:
    """A follower's lease: a thread renews it on a store connection of its own, with a short timeout."""

    def __init__(self, connect_store: Any, node_rank: int, timeout: float) -> None:
        self.node_rank = node_rank
        self.timeout = timeout
        self.renewed = time.monotonic()
        self.evicted = False
        self._connect = connect_store
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="ftrun-lease", daemon=True)

    def start(self) -> None:
        """Start renewing."""
        self._thread.start()

    def stop(self) -> None:
        """Stop renewing (at the next renewal)."""
        self._stop.set()

    def fence_reason(self) -> str | None:
        """Why this node must stop its workers now, or None while its lease holds."""
        if self.evicted:
            return "the leader declared this node lost: stopping its workers"
        silent = time.monotonic() - self.renewed
        if silent > self.timeout:
            return (f"could not renew this node's lease on the store for {silent:.1f} s (--node-timeout "
                    f"{self.timeout:g}): fencing, so that a cut-off node does not train on alone")
        return None

    def _run(self) -> None:
        store = None
        while not self._stop.wait(self.timeout / 5):
            try:
                store = store or self._connect()
                store.add(lease_key(self.node_rank), 1)
                self.evicted = store.check([evicted_key(self.node_rank)])
                self.renewed = time.monotonic()
            except RuntimeError:
                store = None  # reconnect on the next renewal


class NodeLeases:
    """The leader's side of the leases: which followers stopped renewing."""

    START_GRACE = 60.0
    """Seconds a node has to renew for the first time (its agent may still be starting over ssh)."""

    def __init__(self, store: Any, nodes: list[int], timeout: float) -> None:
        self.store = store
        self.timeout = timeout
        now = time.monotonic()
        self.seen: dict[int, tuple[int, float]] = {n: (0, now + self.START_GRACE - timeout) for n in nodes}
        self.next_check = now

    def expired(self, now: float) -> list[tuple[int, float]]:
        """Nodes whose lease expired since the last call, with the wall-clock time of their last renewal seen."""
        if now < self.next_check:
            return []
        self.next_check = now + min(0.5, self.timeout / 5)
        lost = []
        for node, (count, when) in list(self.seen.items()):
            current = self.store.add(lease_key(node), 0)
            if current != count:
                self.seen[node] = (current, now)
            elif now - when > self.timeout:
                lost.append((node, time.time() - (now - when)))
        for node, _ in lost:
            self.forget(node)
        return lost

    def forget(self, node: int) -> None:
        """Stop watching ``node`` (lost, or done) and tell it, should it come back, that it was evicted."""
        if self.seen.pop(node, None) is not None:
            self.store.set(evicted_key(node), "1")


class Followers:
    """The leader's side of the other nodes: their workers' news, their leases, their loss."""

    def __init__(self, agent: Agent, store: Any) -> None:
        self.agent = agent
        self.store = store
        self.remote: dict[int, RemoteWorker] = {}  # the other nodes' workers, by uid
        self.leases = NodeLeases(store, list(range(1, agent.config.min_nodes)), agent.config.node_timeout)

    def live(self) -> list[RemoteWorker]:
        """The other nodes' workers that have not ended."""
        return [w for w in self.remote.values() if w.exitcode is None]

    def tick(self, now: float) -> None:
        """Nodes whose lease ran out are lost."""
        for node, since in self.leases.expired(now):
            self.node_lost(node, f"its lease expired (no renewal for {self.leases.timeout:g} s)", since)

    def on_message(self, message: dict[str, Any]) -> None:
        """A follower's news of its workers (or the hostfile launcher's news of a follower's end)."""
        agent, kind, uid = self.agent, message["t"], message.get("uid")
        if kind == "node_gone":
            if message["node"] in self.leases.seen:
                self.node_lost(message["node"], message["reason"], message["since"])
            return
        if kind == "worker_start":
            slot = WorkerSlot(uid=uid, worker_id=f"{node_of(uid)}:{uid}", local_rank=message["local_rank"],
                              rank=message["rank"], spare=message["spare"])
            self.remote[uid] = RemoteWorker(self.store, slot, message["pid"])
            agent.events.write("worker_start", uid=uid, rank=slot.rank, local_rank=slot.local_rank,
                               pid=message["pid"], joiner=slot.spare, attempt=agent.restart_count, node=node_of(uid))
            return
        worker = self.remote.get(uid)
        if worker is None or worker.exitcode is not None:
            return  # a worker of a node already declared lost
        if kind == "msg":
            agent.coordinator.on_message(worker, message["msg"])
        elif kind == "exit":
            worker.exitcode = message["code"]
            agent.events.write("worker_exit", uid=uid, rank=worker.slot.rank, pid=worker.pid,
                               exitcode=worker.exitcode, node=node_of(uid))
            if worker.exitcode == 0:
                agent.coordinator.on_finished(worker)
            elif agent.stop_deadline is None:
                agent.workers_failed([(worker, WorkerFailure(**message["failure"]))])

    def node_lost(self, node: int, why: str, since: float | None = None) -> None:
        """Declare ``node`` lost (gone since ``since``, wall clock): its workers are one fault."""
        self.leases.forget(node)
        lost = [w for w in self.live() if node_of(w.uid) == node]
        if not lost:
            return  # its workers had all ended: it was done, not lost
        self.agent.events.write("node_lost", node=node, reason=why, ranks=[w.slot.rank for w in lost])
        self.agent.console.notice(f"ftrun: node {node} lost: {why}", style="bold yellow")
        when = since or time.time()
        faults = []
        for worker in lost:
            worker.exitcode = -signal.SIGKILL
            faults.append((worker, WorkerFailure(worker.slot.rank, worker.slot.local_rank, worker.pid,
                                                 -signal.SIGKILL, when, f"node {node} lost: {why}", "")))
        if self.agent.stop_deadline is None:
            self.agent.workers_failed(faults)

    def stop(self, reason: str) -> None:
        """The leader gives up: every other node stops its workers too."""
        for node in range(1, self.agent.config.min_nodes):
            control.post(self.store, control.node_box(node), {"t": "stop", "reason": f"the leader stopped: {reason}"})


class Relay:
    """A follower's stand-in for the Coordinator: its workers' news goes to the leader, its hangs are its own."""

    def __init__(self, agent: Agent, store: Any, leases: LeaseKeeper) -> None:
        self.agent = agent
        self.store = store
        self.leases = leases
        self.watchdog = HangWatchdog(agent, HangPolicy(fixed=agent.config.recovery.hang_timeout))
        self.forwarded: dict[int, tuple[int, float]] = {}  # uid -> (gen, time) of the last forwarded commit
        self.stop_reason: str | None = None
        # what this node knows of the job, for its status record
        self.plan = protocol.Plan(0, protocol.initial_members(agent.sizes))
        self.last_step: dict[int, int] = {}
        self.adopted: set[int] = set()  # workers that joined through the API
        self.recovery: int | None = None  # the generation being recovered into, until its first commit here

    def on_relay(self, data: bytes) -> None:
        """Control messages the leader sends to a worker of this node: a plan starts a recovery."""
        for line in data.decode().splitlines():
            message = json.loads(line)
            if message.get("t") == protocol.PLAN and message["gen"] > self.plan.gen:
                self.plan = protocol.Plan.from_message(message)
                self.recovery = self.plan.gen

    def on_leader_message(self, message: dict[str, Any]) -> None:
        """The leader's word for this node: a message for a worker, a signal, a worker to start, a stop."""
        kind, uid = message["t"], message.get("uid")
        worker = self.agent.workers.get(uid)
        if kind == "relay" and worker is not None and worker.exitcode is None:
            self.on_relay(message["data"].encode())
            worker.send(message["data"].encode())
        elif kind == "signal" and worker is not None:
            worker.send_signal(message["sig"])
        elif kind == "start_worker":  # the replacement of this node's worker ``uid``
            slot = WorkerSlot(uid=uid, worker_id=f"{self.agent.config.node_rank}:{uid}",
                              local_rank=message["local_rank"], rank=message["rank"])
            self.agent.start_worker(slot.local_rank, rank=None, respawn_of=slot)
        elif kind == "stop":
            self.stop_reason = message["reason"]

    def tell_leader(self, message: dict[str, Any]) -> None:
        """Post one message to the leader's mailbox; dropped if the store cannot be reached (within the
        agent's store timeout): a node cut off that long is evicted by the leader and fences itself."""
        try:
            control.post(self.store, LEADER_BOX, message)
        except RuntimeError:
            pass

    def on_start(self, worker: Worker) -> None:
        """A worker of this node started."""
        slot = worker.slot
        self.tell_leader({"t": "worker_start", "uid": slot.uid, "pid": worker.pid, "local_rank": slot.local_rank,
                          "rank": slot.rank, "spare": slot.spare})

    def on_message(self, worker: Worker, message: dict[str, Any]) -> None:
        """A control message from a worker of this node: fed to the watchdog, passed on when the leader needs it."""
        uid, kind = worker.uid, message.get("t")
        if kind == protocol.HELLO:
            self.adopted.add(uid)
            self.watchdog.started(uid)
        elif kind == protocol.ENTERED:
            self.watchdog.entered(uid, message["step"])
            return  # node-local: only the watchdog needs it
        elif kind == protocol.FINISHED:
            self.watchdog.finished(uid)
        elif kind == protocol.PROGRESS:
            self.watchdog.committed(uid, message["step"], message["step_time"])
            self.last_step[uid] = message["step"]
            if message["gen"] == self.recovery:
                self.recovery = None
            gen, last = self.forwarded.get(uid, (-1, 0.0))
            now = time.monotonic()
            if gen == message["gen"] and now - last < PROGRESS_FORWARD_INTERVAL:
                return
            self.forwarded[uid] = (message["gen"], now)
        self.tell_leader({"t": "msg", "uid": uid, "msg": message})

    def on_finished(self, worker: Worker) -> None:
        """A worker of this node ended with exit code 0."""
        self.tell_leader({"t": "exit", "uid": worker.uid, "code": 0})

    def on_faults(self, faults: list[tuple[Worker, WorkerFailure]]) -> bool:
        """Workers of this node failed: the leader decides; this node carries on meanwhile."""
        for worker, failure in faults:
            self.tell_leader({"t": "exit", "uid": worker.uid, "code": failure.exitcode, "failure": asdict(failure)})
        return True

    def tick(self, now: float) -> str | None:
        """Hangs of this node's workers, the lease, and a stop asked by the leader: the reason to stop, or None."""
        self.watchdog.kill_due()
        self.watchdog.check([w.uid for w in self.agent.live_workers()])
        fence = self.leases.fence_reason()
        if fence is not None:
            self.agent.stop_all(signal.SIGKILL)  # at once: a fenced node must not commit one more step
            self.agent.events.write("fenced", reason=fence)
        return self.stop_reason or fence

    def succeeded(self) -> bool:
        """A follower's part succeeded unless the leader or its lease stopped it."""
        return self.stop_reason is None and self.leases.fence_reason() is None
