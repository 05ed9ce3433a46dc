"""The leader's coordination: carries out the recovery decisions for the whole job, and times each recovery.

The leader (node 0's agent) learns of faults from its own workers' exits, from the other nodes (through
:class:`~ftrun.agent.nodes.RemoteNodes`), from the hang watchdog and GPU health; the decisions themselves
are :mod:`ftrun.agent.decisions`' pure functions. What is left here are their effects: events, plans
written to the store and sent to every worker, replacements started, rescues asked for.
"""

from __future__ import annotations

import json
import signal
import time
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from ftrun import events, protocol
from ftrun.agent.decisions import (Act, Decision, LinkTrouble, Membership, Recovery, RecoveryOptions, Rescue,
                                   decide_deadline, decide_fault, decide_join, decide_link_fault, lost_ranks,
                                   recovery_summary, rescue_outcome, split_lost, succeeded, waiting_for)
from ftrun.agent.ports import GpuUse, LocalWorkers, Notices, Restart, WorkerControl, WorkerHandle
from ftrun.agent.watchdog import HangWatchdog
from ftrun.events import EventSink
from ftrun.health.hangs import HangPolicy
from ftrun.protocol import Plan, node_of
from ftrun.store.job import JobStore

if TYPE_CHECKING:
    from ftrun.agent.failures import WorkerFailure
    from ftrun.agent.nodes import RemoteNodes
    from ftrun.agent.workers import Worker

RESCUE_TIMEOUT = 10.0
"""Seconds the live workers have to save their state before a group restart."""


@dataclass(frozen=True)
class LeaderSetup:
    """What a leader is told of its attempt."""

    attempt: int
    sizes: tuple[int, ...]  # training workers per node
    options: RecoveryOptions
    respawn: bool
    hang_timeout: float | None
    multinode: bool
    restarted_after: float | None = None  # wall clock: the failure that ended the previous attempt, if any


class Leader:
    """Plans every generation of the job: in-place recovery when it can, a group restart when it cannot."""

    def __init__(self, setup: LeaderSetup, store: JobStore, log: EventSink, notices: Notices,
                 control: WorkerControl, local: LocalWorkers, gpus: GpuUse) -> None:
        self.setup = setup
        self.options = setup.options
        self.store = store
        self.log = log
        self.notices = notices
        self.control = control
        self.local = local
        self.gpus = gpus
        self.members = Membership(Plan(0, protocol.initial_members(setup.sizes)), target=sum(setup.sizes))
        self.recovery: Recovery | None = None
        self.rescue: Rescue | None = None
        self.watchdog = HangWatchdog(local, log, notices, HangPolicy(fixed=setup.hang_timeout))
        self.nodes: RemoteNodes | None = None  # the other nodes, once attached (multi-node jobs)
        self.trouble: LinkTrouble | None = None  # collective failures no death explains (yet)
        self.reforms = 0  # re-forms of the same members since the last recovery completed
        self.store_address = ""  # "host:port" of the process groups' store, once it moved (a new leader serves it)

    # ------------------------------------------------------------ the Coordination view
    @property
    def plan(self) -> Plan:
        """The current generation."""
        return self.members.plan

    @property
    def last_step(self) -> dict[int, int]:
        """The last step each worker committed."""
        return self.members.last_step

    @property
    def recovering(self) -> bool:
        """Whether an in-place recovery is under way."""
        return self.recovery is not None

    @property
    def restarting(self) -> bool:
        """Whether the live workers are saving their state for a group restart."""
        return self.rescue is not None

    @property
    def saved_step(self) -> int:
        """The step whose state the live workers saved for a group restart (-1: none)."""
        return max(self.rescue.saved.values(), default=-1) if self.rescue is not None else -1

    @property
    def restart_to(self) -> Restart | None:
        """The leader decides group restarts; it is never told one."""
        return None

    def awaiting(self, now: float) -> bool:
        """The leader's attempt ends when every worker of the job has, and every node it starts with has told of
        its workers or been lost: a script whose workers end before another node's start has not yet ended (an
        attempt being stopped waits for none: the nodes still starting read how it ended)."""
        return self.nodes is not None and not self.control.stopping() and bool(self.nodes.unstarted())

    def why_no_restart(self) -> str | None:
        """Why the job's group cannot restart on the same nodes, or None: a node was lost in this attempt."""
        lost = self.nodes.lost if self.nodes is not None else {}
        return "; ".join(f"node {node} was lost ({why})" for node, why in sorted(lost.items())) or None

    def adopted(self, uid: int) -> bool:
        """Whether worker ``uid`` joined through the worker API."""
        return uid in self.members.adopted

    def remote_workers(self) -> list[WorkerHandle]:
        """The other nodes' live workers."""
        return list(self.nodes.live()) if self.nodes is not None else []

    def succeeded(self) -> bool:
        """Whether every member of the current generation finished with exit code 0."""
        return succeeded(self.members)

    # ------------------------------------------------------------ inputs
    def on_start(self, worker: Worker) -> None:
        """A worker of this node started: nothing to do until it speaks."""

    def on_mail(self, message: dict[str, Any]) -> None:
        """News of another node's workers, or of a node's loss."""
        if self.nodes is not None:
            self.nodes.on_mail(message)

    def on_message(self, worker: WorkerHandle, message: dict[str, Any]) -> None:
        """A control message from a worker (another node's, relayed by its agent, which watches its hangs)."""
        uid, kind, m = worker.uid, message.get("t"), self.members
        watchdog = self.watchdog if self.local.get(uid) is not None else None
        if kind == protocol.HELLO:
            m.adopted.add(uid)
            if watchdog:
                watchdog.started(uid)
        elif kind == protocol.ENTERED:
            if watchdog:
                watchdog.entered(uid, message["step"])
        elif kind in (protocol.FINISHED, protocol.LEFT):
            if watchdog:
                watchdog.finished(uid)
            if kind == protocol.FINISHED:
                m.left_loop.add(uid)
            if message["step"] >= 0:
                m.last_step[uid] = message["step"]
            if self.recovery is not None and self.recovery.kind == "join":
                self.recovery = None  # a joiner placed as training ended: nothing left for it to join
        elif kind == protocol.READY:
            m.ready.append(uid)
            self.log.write(events.JOINER_READY, uid=uid, pid=worker.pid)
            self._place_joiners()
        elif kind == protocol.COLLECTIVE_FAILED:
            self._collective_failed(worker, message)
        elif kind == protocol.RECOVERED and self.recovery and message["gen"] == self.recovery.gen:
            self.recovery.reports[uid] = message
        elif kind == protocol.UNRECOVERABLE and self.recovery is not None and message["gen"] == self.recovery.gen:
            self._give_up(message["reason"])
        elif kind == protocol.SAVED:
            if not message.get("error") and message["step"] >= 0:  # commits are told now and then: it may be newer
                m.last_step[uid] = max(m.last_step.get(uid, -1), message["step"])
            if self.rescue is not None:
                self.rescue.waiting.discard(uid)
                if message.get("error"):
                    self.rescue.errors[uid] = str(message["error"])
                else:
                    self.rescue.saved[uid] = message["step"]
        elif kind == protocol.PROGRESS:
            if not m.trained and self.setup.restarted_after is not None:
                self.log.write(events.RESUMED, attempt=self.setup.attempt, step=message["step"],
                               latency=round(message["time"] - self.setup.restarted_after, 6))
            m.trained.add(uid)
            m.last_step[uid] = message["step"]
            if watchdog:
                watchdog.committed(uid, message["step"], message["step_time"])
            if self.recovery and message["gen"] == self.recovery.gen:
                self._recovered(message)

    def on_finished(self, worker: WorkerHandle) -> None:
        """A worker ended with exit code 0; once every member that trained has, joiners and spares are stopped."""
        self.members.finished.add(worker.uid)
        if self.succeeded():
            self.control.stop_all()

    def on_faults(self, faults: list[tuple[WorkerHandle, WorkerFailure]]) -> bool:
        """Workers failed together (a node lost): one new generation without them; False to restart the group."""
        m = self.members
        failures = {worker.uid: (worker, failure) for worker, failure in faults}
        if self.rescue is not None:  # a worker that died will never say it saved: the rescue waits no longer
            self.rescue.waiting -= set(failures)
        lost, joiners = split_lost(m, list(failures))
        if self.options.enabled and self.rescue is None:
            for uid in joiners:
                self._joiner_lost(*failures[uid])
        replaced = [failures[uid][0] for uid in lost if self._replaced(failures[uid][0])]
        before = self.recovery.before if self.recovery is not None else m.plan
        ranks = lost_ranks(before, m.plan, lost)
        decision = decide_fault(m, self.options, lost, ranks, len(replaced), self.rescue is not None)
        if decision.act is Act.RESTART and not self.options.enabled:
            return False
        self._announce([failures[uid][1] for uid in lost], ranks, decision)
        if decision.act in (Act.RESCUE, Act.RESTART):
            for uid in lost:
                self.log.write(events.RECOVERY_REFUSED, uid=uid, reason=decision.reason)
            if decision.act is Act.RESTART:
                return False
            self._give_up(decision.reason)
            return True
        if decision.act is Act.NONE:
            return True
        if self.recovery is None:
            first = min(failure.when for _, failure in failures.values())
            self.recovery = Recovery("fault", time.monotonic(), first, time.time(), before, dict(m.last_step))
        for uid, rank in zip(lost, ranks):
            worker, failure = failures[uid]
            self.recovery.lost_ranks.append(rank)
            self.recovery.lost_uids.append(uid)
            self.log.write(events.FAULT, uid=uid, rank=rank, pid=failure.pid, how=failure.how,
                           message=failure.message, gen=m.plan.gen)
        if decision.act is Act.WAIT:
            self.recovery.waiting_since = self.recovery.waiting_since or time.monotonic()
            m.plan = decision.plan
        else:
            self._issue(decision.plan)
        for worker in replaced:  # after the plan: starting a process is not on the survivors' path
            self._start_replacement(worker)
        return True

    def tick(self, now: float) -> str | None:
        """Every monitor interval: hung ranks, recovery deadlines, a rescue's end; the reason to restart, or None."""
        if self.nodes is not None:
            self.nodes.tick(now)  # also while stopping: a lost node's workers will never say they ended
        if self.control.stopping():
            return None
        for worker, waited in self.watchdog.kill_due():
            self.control.abandon(worker, waited)
        if self.rescue is not None:
            reason = rescue_outcome(self.rescue, now)
            if reason is not None:
                best = max(self.rescue.saved.values(), default=-1)
                self.log.write(events.RESCUE, saved=self.rescue.saved, best_step=best,
                               missing=sorted(self.rescue.waiting), errors=self.rescue.errors, why="restart")
            return reason
        self.notices.progress(waiting_for(self.members, self.options, self.recovery, self.rescue, self._warming(), now)
                              or (self.nodes.waiting() if self.nodes is not None and not self.control.stopping()
                                  else None))
        if self.recovery is None:
            stuck = self.watchdog.check([uid for uid in self.plan.members
                                         if uid not in self.members.finished and self.local.get(uid) is not None])
            if stuck:  # a link that drops packets: every rank waits; the other nodes say whether theirs do too
                self._trouble(now).stuck_nodes.add(0)
        nodes = {node_of(uid) for uid in self.plan.members if uid not in self.members.finished}
        self._act_on_links(decide_link_fault(self.members, self.trouble, nodes, self.reforms, now, self.recovery))
        if self.rescue is None and self.recovery is not None:
            decision = decide_deadline(self.recovery, self.options, now)
            if decision.act is Act.RESCUE:
                self._give_up(decision.reason)
        return None

    def node_stuck(self, node: int, gen: int, reason: str) -> None:
        """Every rank of another node waits in a collective of generation ``gen`` past its hang timeout."""
        if gen == self.plan.gen:
            self._trouble(time.monotonic()).stuck_nodes.add(node)

    def grow(self, workers: int) -> int:
        """A node of --nnodes MIN:MAX's optional ones joined with ``workers`` training workers: the joiners
        top the generation up to the larger target. The new target."""
        self.members.target += workers
        return self.members.target

    def seen_generation(self, gen: int) -> None:
        """Another node's workers may be in a generation this node, elected after the leader before it, never
        heard of (that leader's last plan reached them first): the next plan is numbered after it, so that
        every worker takes it for new."""
        if gen > self.plan.gen:
            self.members.plan = replace(self.plan, gen=gen)

    def close(self, reason: str | None, restart: Restart | None = None) -> None:
        """The attempt is over: every other node is told how (it succeeded, failed with ``reason``, or the
        group restarts: as which attempt, in which store)."""
        if self.nodes is not None:
            self.nodes.end(reason, restart)

    # ------------------------------------------------------------ effects
    def _trouble(self, now: float) -> LinkTrouble:
        """The current generation's link trouble, begun at ``now`` if there was none."""
        if self.trouble is None or self.trouble.gen != self.plan.gen:
            self.trouble = LinkTrouble(self.plan.gen, now)
        return self.trouble

    def _collective_failed(self, worker: WorkerHandle, message: dict[str, Any]) -> None:
        """A member's collective of the current generation failed with no new plan to explain it."""
        if message.get("gen") != self.plan.gen:
            return  # an older generation's: the plan that replaced it explains it
        trouble = self._trouble(time.monotonic())
        trouble.reasons.append(f"rank {self.plan.rank_of(worker.uid)}, {message.get('phase')}: {message.get('error')}")
        unreachable = message.get("unreachable")
        if isinstance(unreachable, dict):
            trouble.unreachable = {int(uid): [int(peer) for peer in peers] for uid, peers in unreachable.items()}

    def _act_on_links(self, decision: Decision) -> None:
        """Re-form the same members, exclude the fewest whose links fail, or give up, as decided."""
        if decision.act is Act.NONE:
            return
        trouble = self.trouble
        trouble.acted = True
        ranks = [self.plan.rank_of(uid) for uid in decision.exclude]
        action = {Act.NEW_PLAN: "reform", Act.EXCLUDE: "exclude", Act.RESCUE: "give_up"}[decision.act]
        self.log.write(events.LINK_FAULT, gen=self.plan.gen, action=action, reason=decision.reason, ranks=ranks,
                       unreachable={str(k): v for k, v in (trouble.unreachable or {}).items()})
        self.notices.notice(f"ftrun: {decision.reason}", style="bold yellow")
        if decision.act is Act.RESCUE:
            self._give_up(decision.reason)
        elif decision.act is Act.EXCLUDE:  # their deaths take the usual path: a new plan without them
            for worker in [*self.local.live(), *self.remote_workers()]:
                if worker.uid in decision.exclude:
                    worker.send_signal(signal.SIGKILL)
        else:
            self.reforms += 1
            if self.recovery is None:  # timed from the first sign of trouble (a report, or the stall seen)
                began = time.time() - (time.monotonic() - trouble.since)
                self.recovery = Recovery("link", time.monotonic(), began, began, self.plan,
                                         dict(self.members.last_step))
            self._issue(decision.plan)

    def _announce(self, failures: list[WorkerFailure], ranks: list[int], decision: Decision) -> None:
        """One console line as a fault is seen: who was lost, how, and what happens next."""
        if decision.act is Act.NONE:
            return
        hows = sorted({failure.how for failure in failures})
        who = f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))} lost ({'; '.join(hows)})"
        if decision.act is Act.NEW_PLAN:
            what, style = f"recovering in place, world {self.plan.world_size} -> {decision.plan.world_size}", \
                "bold yellow"
        elif decision.act is Act.WAIT:
            what, style = decision.reason, "bold yellow"
        else:
            what, style = f"no in-place recovery: {decision.reason}", "bold red"
            if "worker API" in decision.reason:
                what += " (to recover in place, call ftrun.init() and train in ft.steps() with ft.commit(): " \
                        "README, 'The worker API')"
            if decision.act is Act.RESCUE:
                what += "; saving the live workers' state first"
        self.notices.notice(f"ftrun: {who}: {what}", style=style)

    def _warming(self) -> int:
        """Joiners started (spares, replacements) that are not ready yet."""
        m = self.members
        return sum(1 for w in [*self.local.live(), *self.remote_workers()]
                   if w.slot.joiner and w.uid not in m.ready and w.uid not in m.plan.members)

    def _joiner_lost(self, worker: WorkerHandle, failure: WorkerFailure) -> None:
        """A joiner (not yet placed) ended: forget it; a GPU health restart still gets its replacement."""
        if worker.uid in self.members.ready:
            self.members.ready.remove(worker.uid)
        self.log.write(events.JOINER_LOST, uid=worker.uid, how=failure.how)
        if worker.uid in self.gpus.restarts and self.gpus.usable(worker.slot.local_rank):  # a spare, on its GPU
            self._start_replacement(worker)

    def _replaced(self, worker: WorkerHandle) -> bool:
        """Whether a lost member gets a replacement: with --respawn, or after a GPU health restart without it;
        never on an evicted GPU (another node's GPUs are its own agent's to judge)."""
        if self.local.get(worker.uid) is None:
            return self.setup.respawn
        return (self.setup.respawn or worker.uid in self.gpus.restarts) and self.gpus.usable(worker.slot.local_rank)

    def _start_replacement(self, worker: WorkerHandle) -> None:
        """Start a joiner in ``worker``'s place, on its node (another node's agent starts it there)."""
        if self.local.get(worker.uid) is None and self.nodes is not None:
            self.nodes.start_replacement(worker)
        else:
            self.control.start_worker(worker.slot.local_rank, rank=None, respawn_of=worker.slot)

    def _place_joiners(self) -> None:
        """Ready joiners fill a generation that is below its target size."""
        decision = decide_join(self.members, self.options, self.recovery, self.rescue is not None, self._warming())
        if decision.act not in (Act.WAIT, Act.NEW_PLAN):
            return
        if self.recovery is None:
            self.recovery = Recovery("join", time.monotonic(), time.time(), time.time(), self.plan,
                                     dict(self.members.last_step))
        if decision.act is Act.NEW_PLAN:
            self.recovery.waiting_since = None
            self._issue(decision.plan)

    def _issue(self, plan: Plan) -> None:
        """Make ``plan`` the current generation: store it, and send it to every live worker."""
        m = self.members
        if self.store_address:
            plan = replace(plan, store=self.store_address)
        for uid in plan.joiners:
            m.ready.remove(uid)
            m.joiners.add(uid)
        m.plan = plan
        self.recovery.gen = plan.gen
        self.recovery.plan_sent = time.time()
        self.recovery.reports.clear()
        try:
            self.store.publish_plan(self.setup.attempt, plan)  # a record for people and tools
        except RuntimeError:
            pass  # the workers get their plans from their agents, not from there
        data = (json.dumps(plan.message()) + "\n").encode()
        for worker in self.local.live():
            worker.send(data)
        remote = self.remote_workers()
        if remote:  # one batch of mail for every other node's workers
            self.nodes.relay(remote, data)
        self.log.write(events.GENERATION, gen=plan.gen, members=plan.members, reason=plan.reason, lost=plan.lost,
                       joiners=plan.joiners, world_size=plan.world_size)

    def _recovered(self, first_commit: dict[str, Any]) -> None:
        """The first step of the new generation committed: the recovery is over; record and announce it."""
        recovery, self.recovery = self.recovery, None
        summary = recovery_summary(recovery, first_commit, self.plan.world_size)
        self.log.write(events.RECOVERY, joiners=self.plan.joiners, **summary)
        self.reforms = 0
        if recovery.kind == "fault":
            lost = ", ".join(str(r) for r in recovery.lost_ranks)
            what = f"loss of rank{'s' if len(recovery.lost_ranks) > 1 else ''} {lost}"
        elif recovery.kind == "link":
            what = "a link fault" + (f" (rank{'s' if len(recovery.lost_ranks) > 1 else ''} "
                                     f"{', '.join(map(str, recovery.lost_ranks))} excluded)" if recovery.lost_ranks else "")
        else:
            what = f"joiner{'s' if len(self.plan.joiners) > 1 else ''} arriving"
        self.watchdog.restart_clocks(self.plan.members)
        self.notices.notice(
            f"ftrun: recovered from {what} in {summary['latency']:.2f} s: world {summary['world_before']} -> "
            f"{summary['world_after']}, {summary['steps_lost']} steps lost", style="bold green")
        self._place_joiners()

    def _give_up(self, reason: str) -> None:
        """Fall back to a group restart, after the live workers have written their state (never lose it)."""
        self.log.write(events.RECOVERY_FAILED, reason=reason, gen=self.plan.gen)
        self.recovery = None
        live = [w for w in [*self.local.live(), *self.remote_workers()] if w.uid in self.members.adopted]
        self.rescue = Rescue(reason, time.monotonic() + RESCUE_TIMEOUT, {w.uid for w in live})
        for worker in live:
            worker.send(protocol.encode(protocol.SAVE, copies=True))  # a member was lost: its shard
