"""A follower's coordination: its workers' news goes to the leader, the leader's word to its workers.

A follower (an agent of node 1 and up) watches its own workers' hangs, renews its lease (and fences itself,
killing its workers, when it cannot), with etcd watches the leader's lease (and stops when the leader is
gone), and otherwise carries out what the leader decides. Its attempt ends with the leader's word: once every
worker of this node has ended, and one of them failed, it waits for the leader to say whether the job
succeeded, failed, or restarts its group.
"""

from __future__ import annotations

import json
import signal
import time
from dataclasses import asdict
from typing import TYPE_CHECKING, Any

from ftrun import events, protocol
from ftrun.agent.cadence import ProgressRelay, periodic_interval
from ftrun.agent.ports import LocalWorkers, Notices, Restart, WorkerControl, WorkerHandle
from ftrun.agent.watchdog import HangWatchdog
from ftrun.agent.workers import WorkerSlot
from ftrun.config import Endpoint
from ftrun.events import EventSink
from ftrun.health.hangs import HangPolicy
from ftrun.store import keys
from ftrun.store.leases import LeaseKeeper, NodeLeases
from ftrun.store.mailbox import Outbox

if TYPE_CHECKING:
    from ftrun.agent.failures import WorkerFailure
    from ftrun.agent.workers import Worker

PROGRESS_FORWARD_INTERVAL = 2.0
"""A follower tells the leader its workers' first commit of each generation at once, later ones together at
most this often (less often in a job of many nodes: :func:`~ftrun.agent.cadence.periodic_interval`), and with
any other message it sends it."""


class Follower:
    """A follower's part in an attempt: relays, hang watching, the lease, and the leader's orders."""

    def __init__(self, node_rank: int, plan: protocol.Plan, hang_timeout: float | None, outbox: Outbox,
                 log: EventSink, notices: Notices, control: WorkerControl, local: LocalWorkers,
                 lease: LeaseKeeper, leader_lease: NodeLeases | None = None, nodes: int = 1) -> None:
        self.node_rank = node_rank
        self.leader_lease = leader_lease  # with etcd, where node 0's lease outlives it: its renewals, watched
        self.outbox = outbox
        self.leader_node = 0  # the leader: node 0, until another node is elected
        self.leader_box = keys.LEADER_BOX
        self.log = log
        self.control = control
        self.local = local
        self.lease = lease
        self.watchdog = HangWatchdog(local, log, notices, HangPolicy(fixed=hang_timeout))
        self.relay = ProgressRelay(periodic_interval(nodes, PROGRESS_FORWARD_INTERVAL))  # commits for the leader
        self.stop_reason: str | None = None  # the leader's word that the job failed, or why this node stops
        self.restart_to: Restart | None = None  # the leader's word: the group restarts, as this attempt, in this store
        self.leader_done = False  # the leader's word: the job succeeded
        self.failed_here = False  # a worker of this node failed in this attempt
        self.finished_here = False  # a worker of this node ended with exit code 0 (training is over)
        self.saved: dict[int, int] = {}  # the steps this node's workers saved for a group restart, by uid
        # what this node knows of the job, for its status record
        self.plan = plan
        self.last_step: dict[int, int] = {}
        self.last_progress: dict[int, dict[str, Any]] = {}  # each worker's last commit, for a new leader
        self.joined: dict[int, dict[str, Any]] = {}  # workers that joined through the API: their hello
        self.recovery_gen: int | None = None  # the generation being recovered into, until its first commit here
        self.stuck_told: int | None = None  # the generation this node last told the leader it is stuck in

    # ------------------------------------------------------------ the Coordination view
    @property
    def recovering(self) -> bool:
        """Whether this node's workers are recovering into a new generation."""
        return self.recovery_gen is not None

    @property
    def restarting(self) -> bool:
        """A follower never restarts its group on its own: only at the leader's word, once its workers ended."""
        return False

    @property
    def saved_step(self) -> int:
        """The step whose state this node's workers saved (at the leader's word) for a group restart (-1: none)."""
        return max(self.saved.values(), default=-1)

    def why_no_restart(self) -> str | None:
        """The leader judges whether the group can restart: a follower knows of no reason."""
        return None

    def awaiting(self, now: float) -> bool:
        """Whether this node waits for the leader's word with no worker left: one of them failed, none finished
        training, and the leader has not said how the job ends (nor is this node fenced or the leader gone)."""
        return self.failed_here and not self.finished_here and self.stop_reason is None \
            and self.restart_to is None and not self.leader_done and self.lease.fence_reason(now) is None

    def adopted(self, uid: int) -> bool:
        """Whether worker ``uid`` joined through the worker API."""
        return uid in self.joined

    def remote_workers(self) -> list[WorkerHandle]:
        """A follower answers for its own workers only."""
        return []

    def succeeded(self) -> bool:
        """A follower's part succeeded unless the leader stopped it or restarts the group, or its lease ran out."""
        return self.stop_reason is None and self.restart_to is None \
            and self.lease.fence_reason(time.monotonic()) is None

    # ------------------------------------------------------------ inputs
    def on_mail(self, message: dict[str, Any]) -> None:
        """The leader's word for this node: a message for a worker, a signal, a worker to start, a stop."""
        kind, uid = message["t"], message.get("uid")
        worker = self.local.get(uid) if isinstance(uid, int) else None
        if kind == protocol.RELAY and worker is not None and worker.exitcode is None:
            self._follow_plans(message["data"])
            worker.send(message["data"].encode())
        elif kind == protocol.RELAY_ALL:
            mine = [w for w in map(self.local.get, message["uids"]) if w is not None and w.exitcode is None]
            if mine:
                self._follow_plans(message["data"])
            for each in mine:
                each.send(message["data"].encode())
        elif kind == protocol.SIGNAL and worker is not None:
            # a node stopping its workers itself (it got the signal too) lets them save first and signals them
            # after: the leader's signal, sent once its own workers saved, would cut that short (SIGKILL would not)
            if message["sig"] == signal.SIGKILL or not self.control.stopping():
                worker.send_signal(message["sig"])
        elif kind == protocol.START_WORKER:  # the replacement of this node's worker ``uid``
            slot = WorkerSlot(uid=uid, worker_id=f"{self.node_rank}:{uid}", local_rank=message["local_rank"],
                              rank=message["rank"])
            self.control.start_worker(slot.local_rank, rank=None, respawn_of=slot)
        elif kind == protocol.STOP:
            self.stop_reason = message["reason"]
        elif kind == protocol.RESTART:
            self.restart_to = Restart(message["attempt"], Endpoint(*protocol.split_address(message["store"])))
            if self.local.live():  # none should be left: the leader waited for every worker's end
                self.control.stop_all()
        elif kind == protocol.DONE:
            self.leader_done = True

    def on_start(self, worker: Worker) -> None:
        """A worker of this node started."""
        slot = worker.slot
        self._tell_leader({"t": protocol.WORKER_STARTED, "uid": slot.uid, "pid": worker.pid,
                           "local_rank": slot.local_rank, "rank": slot.rank, "joiner": slot.joiner})

    def on_message(self, worker: WorkerHandle, message: dict[str, Any]) -> None:
        """A control message from a worker of this node: fed to the watchdog, passed on when the leader needs it."""
        uid, kind = worker.uid, message.get("t")
        if kind == protocol.HELLO:
            self.joined[uid] = message
            self.watchdog.started(uid)
        elif kind == protocol.ENTERED:
            self.watchdog.entered(uid, message["step"])
            return  # node-local: only the watchdog needs it
        elif kind in (protocol.FINISHED, protocol.LEFT):
            self.watchdog.finished(uid)
            if message["step"] >= 0:
                self.last_step[uid] = message["step"]
        elif kind == protocol.SAVED and not message.get("error"):
            self.saved[uid] = message["step"]
            if message["step"] >= 0:  # commits are told now and then: this one may be newer
                self.last_step[uid] = max(self.last_step.get(uid, -1), message["step"])
        elif kind == protocol.PROGRESS:
            self.watchdog.committed(uid, message["step"], message["step_time"])
            self.last_step[uid] = message["step"]
            self.last_progress[uid] = message
            if message["gen"] == self.recovery_gen:
                self.recovery_gen = None
            if self.relay.commit(uid, message):
                self._tell_leader()
            return
        self._tell_leader({"t": protocol.WORKER_MESSAGE, "uid": uid, "msg": message})

    def on_finished(self, worker: WorkerHandle) -> None:
        """A worker of this node ended with exit code 0."""
        self.finished_here = True
        self._tell_leader({"t": protocol.WORKER_EXITED, "uid": worker.uid, "code": 0})

    def on_faults(self, faults: list[tuple[WorkerHandle, WorkerFailure]]) -> bool:
        """Workers of this node failed: the leader decides; this node carries on meanwhile."""
        self.failed_here = True
        for worker, failure in faults:
            self._tell_leader({"t": protocol.WORKER_EXITED, "uid": worker.uid, "code": failure.exitcode,
                               "failure": asdict(failure)})
        return True

    def tick(self, now: float) -> str | None:
        """Hangs of this node's workers, the lease, and a stop asked by the leader: the reason to stop, or None."""
        if self.control.stopping():
            return None
        fence = self.lease.fence_reason(now)  # before any store call: cut off, each hangs until its timeout
        if fence is not None:
            self.control.stop_all(signal.SIGKILL)  # at once: a fenced node must not commit one more step
            self.log.write(events.FENCED, reason=fence)
            return self.stop_reason or fence  # nor stand for leader
        for worker, waited in self.watchdog.kill_due():
            self.control.abandon(worker, waited)
        stuck = self.watchdog.check([w.uid for w in self.local.live()])
        if stuck and self.stuck_told != self.plan.gen:  # the leader judges the job: are the other nodes stuck too?
            self.stuck_told = self.plan.gen
            self._tell_leader({"t": protocol.NODE_STUCK, "node": self.node_rank, "gen": self.plan.gen,
                               "reason": stuck})
        if self.relay.due(now):
            self._tell_leader()
        silent = self._leader_silence(now)
        if silent is not None and self.stop_reason is None:
            self.stop_reason = self.control.leader_lost(self.leader_node, silent)  # an election: None once one leads
            if self.stop_reason is not None:
                self.log.write(events.FENCED, reason=self.stop_reason)
                self.control.save_and_stop()
        return self.stop_reason

    def _leader_silence(self, now: float) -> float | None:
        """Seconds since node 0 last renewed its lease, once that is past --node-timeout (watched with etcd
        only); None otherwise, and while the store does not answer (this node's own lease fences it then)."""
        if self.leader_lease is None:
            return None
        try:
            lost = self.leader_lease.expired(now)
        except RuntimeError:
            return None
        return lost[0][1] if lost else None

    def close(self, reason: str | None, restart: Restart | None = None) -> None:
        """Nothing to tell anyone: the leader learns of this node's end from its workers' exits and its lease."""

    # ------------------------------------------------------------ effects
    def _follow_plans(self, data: str) -> None:
        """Control messages the leader sends to a worker of this node: a plan starts a recovery."""
        for line in data.splitlines():
            message = json.loads(line)
            if message.get("t") == protocol.PLAN and message["gen"] > self.plan.gen:
                self.plan = protocol.Plan.from_message(message)
                self.recovery_gen = self.plan.gen

    def follow(self, node: int, term: int, leader_lease: NodeLeases) -> None:
        """Another node was elected leader (``term``): its lease is watched from now on, and it is told of this
        node's live workers (what it needs to plan for them: who they are, whether they use the worker API,
        their last commit), then that this node follows it, in the generation it knows."""
        self.leader_node, self.leader_box, self.leader_lease = node, keys.node_box(node), leader_lease
        self.relay.take(time.monotonic())  # the last commits are told below, after the workers they are of
        for worker in self.local.live():
            slot = worker.slot
            self._tell_leader({"t": protocol.WORKER_STARTED, "uid": slot.uid, "pid": worker.pid,
                               "local_rank": slot.local_rank, "rank": slot.rank, "joiner": slot.joiner})
            for said in (self.joined.get(slot.uid), self.last_progress.get(slot.uid)):
                if said is not None:  # what the worker said when it joined, and its last commit
                    self._tell_leader({"t": protocol.WORKER_MESSAGE, "uid": slot.uid, "msg": said})
        self._tell_leader({"t": protocol.FOLLOWING, "node": self.node_rank, "term": term, "gen": self.plan.gen})

    def _tell_leader(self, *messages: dict[str, Any]) -> None:
        """Send ``messages`` to the leader's mailbox after the commits the relay holds (one message), in one
        write; dropped if the store cannot be reached (within the agent's store timeout): a node cut off that
        long is evicted by the leader and fences itself."""
        commits = self.relay.take(time.monotonic())
        told = [commits, *messages] if commits is not None else list(messages)
        if not told:
            return
        try:
            self.outbox.send_many([(self.leader_box, message) for message in told])
        except RuntimeError:
            pass
