"""The recovery coordinator: turns worker faults into new generations and times each recovery."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ftrun import protocol
from ftrun.agent.planning import next_plan, why_not_in_place
from ftrun.agent.watchdog import HangWatchdog
from ftrun.health.hangs import HangPolicy
from ftrun.protocol import Plan

if TYPE_CHECKING:
    from ftrun.agent.agent import Agent
    from ftrun.agent.cluster import RemoteWorker
    from ftrun.agent.failures import WorkerFailure
    from ftrun.agent.workers import Worker


@dataclass
class Recovery:
    """One recovery in progress: from the first fault noticed to the first step committed after it."""

    kind: str  # "fault" or "join"
    started: float  # time.time() the fault happened, as far as is known (or the joiner became ready)
    before: Plan  # the generation the fault hit: lost ranks are named by their rank in it
    committed_before: int
    lost_ranks: list[int] = field(default_factory=list)
    lost_uids: list[int] = field(default_factory=list)
    plan_sent: float = 0.0
    gen: int = 0
    reports: dict[int, dict[str, Any]] = field(default_factory=dict)
    waiting_since: float | None = None  # below --min-nproc: waiting for joiners since
    noticed: float = field(default_factory=time.time)  # when ftrun learned of it (later for a lost node)


@dataclass
class Rescue:
    """Before a group restart: the live workers write their last committed state, within a deadline."""

    reason: str
    deadline: float
    waiting: set[int]
    saved: dict[int, int] = field(default_factory=dict)  # uid -> committed step written


RESCUE_TIMEOUT = 10.0


class Coordinator:
    """Decides, for each fault, between in-place recovery and a group restart, and runs the former.

    Learns of faults from the agent (worker exits), writes each generation's plan to the store and
    sends it to every local worker over its control channel, and records one event per recovery with
    its phases timed.
    """

    def __init__(self, agent: Agent, store: Any) -> None:
        self.agent = agent
        self.store = store
        self.config = agent.config.recovery
        self.target = agent.world_size
        self.plan = Plan(0, protocol.initial_members(agent.sizes))
        self.adopted: set[int] = set()
        self.ready: list[int] = []
        self.finished: set[int] = set()  # exited with code 0
        self.trained: set[int] = set()  # committed at least one step
        self.joiners: set[int] = set()  # placed after the start (spares, respawned workers)
        self.left_loop: set[int] = set()  # finished their step loop: the training is complete
        self.last_step: dict[int, int] = {}
        self.recovery: Recovery | None = None
        self.rescue: Rescue | None = None
        self.watchdog = HangWatchdog(agent, HangPolicy(fixed=self.config.hang_timeout))

    # --------------------------------------------------------------- inputs
    def on_message(self, worker: Worker | RemoteWorker, message: dict[str, Any]) -> None:
        """A control message from a worker (another node's, relayed by its agent, which watches its hangs)."""
        uid, kind = worker.uid, message.get("t")
        watchdog = self.watchdog if uid in self.agent.workers else None
        if kind == protocol.HELLO:
            self.adopted.add(uid)
            if watchdog:
                watchdog.started(uid)
        elif kind == protocol.ENTERED:
            if watchdog:
                watchdog.entered(uid, message["step"])
        elif kind == protocol.FINISHED:
            if watchdog:
                watchdog.finished(uid)
            self.left_loop.add(uid)
            if self.recovery is not None and self.recovery.kind == "join":
                self.recovery = None  # a joiner placed as training ended: nothing left for it to join
        elif kind == protocol.READY:
            self.ready.append(uid)
            self.agent.events.write("joiner_ready", uid=uid, pid=worker.pid)
            self._place_joiners()
        elif kind == protocol.RECOVERED and self.recovery and message["gen"] == self.recovery.gen:
            self.recovery.reports[uid] = message
        elif kind == protocol.SAVED and self.rescue is not None:
            self.rescue.waiting.discard(uid)
            self.rescue.saved[uid] = message["step"]
        elif kind == protocol.PROGRESS:
            self.trained.add(uid)
            self.last_step[uid] = message["step"]
            if watchdog:
                watchdog.committed(uid, message["step"], message["step_time"])
            if self.recovery and message["gen"] == self.recovery.gen:
                self._recovered(message)

    def on_finished(self, worker: Worker) -> None:
        """A worker ended with exit code 0; once every member that trained has, joiners and spares are stopped."""
        self.finished.add(worker.uid)
        if self.succeeded():
            self.agent.stop_all()

    def on_faults(self, faults: list[tuple[Worker | RemoteWorker, WorkerFailure]]) -> bool:
        """Workers failed together (a node lost): one new generation without them; False to restart the group."""
        health = self.agent.gpu_health
        if not self.config.enabled:
            return False
        if self.rescue is not None:
            return True  # the group restarts as soon as the survivors' state is saved
        members = []
        for worker, failure in faults:
            if worker.uid in self.ready or worker.uid not in self.plan.members:
                if worker.uid in self.ready:
                    self.ready.remove(worker.uid)
                self.agent.events.write("joiner_lost", uid=worker.uid, how=failure.how)
                if worker.uid in health.restarts and health.usable(worker.slot.local_rank):  # a spare, on its GPU
                    self.agent.start_worker(worker.slot.local_rank, rank=None, respawn_of=worker.slot)
            else:
                members.append((worker, failure))
        if not members:
            return True
        lost = {worker.uid for worker, _ in members}
        survivors = [m for m in self.plan.members if m not in lost and m not in self.finished]
        replaced = [worker for worker, _ in members if self._replaced(worker)]
        reason = why_not_in_place(self.plan.members, self.adopted, len(survivors), len(self.ready) + len(replaced),
                                  self.config.min_nproc)
        if reason is not None:
            for uid in lost:
                self.agent.events.write("recovery_refused", uid=uid, reason=reason)
            if not all(m in self.adopted for m in self.plan.members):
                return False
            self._give_up(reason)  # the survivors hold good state: save it, then restart the group
            return True
        if self.recovery is None:
            first = min(failure.when for _, failure in members)
            self.recovery = Recovery("fault", first, self.plan, max(self.last_step.values(), default=-1))
        before = self.recovery.before
        ranks = []
        for worker, failure in members:
            rank = before.rank_of(worker.uid) if worker.uid in before.members else self.plan.rank_of(worker.uid)
            ranks.append(rank)
            self.recovery.lost_ranks.append(rank)
            self.recovery.lost_uids.append(worker.uid)
            self.agent.events.write("fault", uid=worker.uid, rank=rank, pid=failure.pid, how=failure.how,
                                    message=failure.message, gen=self.plan.gen)
        if len(survivors) + len(self.ready) < self.config.min_nproc:
            self.recovery.waiting_since = self.recovery.waiting_since or time.time()
            self.plan = Plan(self.plan.gen, survivors)
        else:
            what = f"lost rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}"
            self._issue(next_plan(self.plan, lost, self.ready, self.target, what))
        for worker in replaced:  # after the plan: starting a process is not on the survivors' path
            self.agent.start_worker(worker.slot.local_rank, rank=None, respawn_of=worker.slot)
        return True

    def _replaced(self, worker: Worker | RemoteWorker) -> bool:
        """Whether a lost member gets a replacement: with --respawn, or after a GPU health restart without it;
        never on an evicted GPU (another node's GPUs are its own agent's to judge)."""
        if worker.uid not in self.agent.workers:
            return self.config.respawn
        health = self.agent.gpu_health
        return (self.config.respawn or worker.uid in health.restarts) and health.usable(worker.slot.local_rank)

    def tick(self, now: float) -> str | None:
        """Called every monitor interval: the reason to fall back to a group restart, or None."""
        wall = time.time()
        self.watchdog.kill_due()
        if self.rescue is not None:
            return self._rescued(wall)
        recovery = self.recovery
        if recovery is None:
            stuck = self.watchdog.check([m for m in self.plan.members if m not in self.finished
                                         and m in self.agent.workers])
            if stuck and not self.agent.config.multinode:  # other nodes' ranks may be busy: their agents judge
                self._give_up(stuck)
            return None
        if recovery.waiting_since is not None and wall - recovery.waiting_since > self.config.join_timeout:
            self._give_up(f"no joiner came within --join-timeout {self.config.join_timeout:.0f} s "
                          f"to reach --min-nproc {self.config.min_nproc}")
        elif recovery.waiting_since is None and wall - recovery.started > self.config.recovery_timeout:
            self._give_up(f"in-place recovery did not finish within --recovery-timeout "
                          f"{self.config.recovery_timeout:.0f} s")
        return None

    def succeeded(self) -> bool:
        """Whether every member of the current generation finished with exit code 0.

        A joiner placed as the others were finishing, which never committed a step, does not count.
        """
        counted = [uid for uid in self.plan.members if uid not in self.joiners or uid in self.trained]
        return bool(counted) and all(uid in self.finished for uid in counted)

    # ------------------------------------------------------------ decisions
    def _place_joiners(self) -> None:
        """Ready joiners fill a generation that is below its target size."""
        if self.recovery is not None and self.recovery.waiting_since is None:
            return  # a recovery is under way; joiners are placed once it is done
        if len(self.plan.members) >= self.target or not self.ready or self.left_loop or self.finished:
            return  # full, nobody to place, or the training is over
        if self.recovery is None:
            self.recovery = Recovery("join", time.time(), self.plan, max(self.last_step.values(), default=-1))
        if len(self.plan.members) + len(self.ready) < self.config.min_nproc:
            return
        self.recovery.waiting_since = None
        self._issue(next_plan(self.plan, (), self.ready, self.target, "joiner ready"))

    def _issue(self, plan: Plan) -> None:
        """Make ``plan`` the current generation: store it, and send it to every live local worker."""
        for uid in plan.joiners:
            self.ready.remove(uid)
            self.joiners.add(uid)
        self.plan = plan
        self.recovery.gen = plan.gen
        self.recovery.plan_sent = time.time()
        self.recovery.reports.clear()
        message = json.dumps(plan.message())
        self.store.set(f"ftrun/a{self.agent.restart_count}/plan/{plan.gen}", message)
        self.store.set(f"ftrun/a{self.agent.restart_count}/gen", str(plan.gen))
        data = (message + "\n").encode()
        for worker in self.agent.job_workers():
            worker.send(data)
        self.agent.events.write("generation", gen=plan.gen, members=plan.members, reason=plan.reason,
                                lost=plan.lost, joiners=plan.joiners, world_size=plan.world_size)

    def _recovered(self, first_commit: dict[str, Any]) -> None:
        """The first step of the new generation committed: the recovery is over; record and announce it."""
        recovery, self.recovery = self.recovery, None
        done = first_commit["time"]
        phases = {"detect": round(max(0.0, recovery.noticed - recovery.started), 6),
                  "plan": round(recovery.plan_sent - max(recovery.noticed, recovery.started), 6)}
        for name in ("abort", "rendezvous", "agree", "transfer"):
            phases[name] = max((r["timings"][name] for r in recovery.reports.values()), default=0.0)
        recovered_at = max((r["plan_received"] + sum(r["timings"].values()) for r in recovery.reports.values()),
                           default=recovery.plan_sent)
        phases["first_step"] = round(done - recovered_at, 6)
        after = min((r["step"] for r in recovery.reports.values()), default=recovery.committed_before)
        lost_steps = max(0, recovery.committed_before - max(after, first_commit["step"] - 1))
        total = done - recovery.started
        self.agent.events.write(
            "recovery", kind=recovery.kind, gen=self.plan.gen, lost_ranks=recovery.lost_ranks,
            lost_uids=recovery.lost_uids, world_before=recovery.before.world_size, world_after=self.plan.world_size,
            joiners=self.plan.joiners, steps_lost=lost_steps, resumed_at_step=first_commit["step"],
            latency=round(total, 6), phases=phases)
        if recovery.kind == "fault":
            lost = ", ".join(str(r) for r in recovery.lost_ranks)
            what = f"loss of rank{'s' if len(recovery.lost_ranks) > 1 else ''} {lost}"
        else:
            what = f"joiner{'s' if len(self.plan.joiners) > 1 else ''} arriving"
        self.watchdog.restart_clocks(self.plan.members)
        self.agent.console.notice(
            f"ftrun: recovered from {what} in {total:.2f} s: world {recovery.before.world_size} -> "
            f"{self.plan.world_size}, {lost_steps} steps lost", style="bold green")
        self._place_joiners()

    def _give_up(self, reason: str) -> None:
        """Fall back to a group restart, after the live workers have written their state (never lose it)."""
        self.agent.events.write("recovery_failed", reason=reason, gen=self.plan.gen)
        self.recovery = None
        live = {w.uid for w in self.agent.job_workers() if w.uid in self.adopted}
        self.rescue = Rescue(reason, time.time() + RESCUE_TIMEOUT, live)
        for worker in self.agent.job_workers():
            if worker.uid in live:
                worker.send(protocol.encode(protocol.SAVE))

    def _rescued(self, wall: float) -> str | None:
        """The fallback reason once every live worker saved its state (or the deadline passed)."""
        rescue = self.rescue
        if rescue.waiting and wall < rescue.deadline:
            return None
        best = max(rescue.saved.values(), default=-1)
        self.agent.events.write("rescue", saved=rescue.saved, best_step=best, missing=sorted(rescue.waiting))
        if best < 0:
            return rescue.reason
        return f"{rescue.reason}; the state of step {best} was saved for the restart"
