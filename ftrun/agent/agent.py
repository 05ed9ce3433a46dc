"""The node agent: runs attempts of the job on this node, one event loop each, and reports how they ended.

The agent is the thin shell around its helpers: it owns the event loop (worker output, exits, control
channels, mail, signals, GPU health wake-ups), hands each event to the helper it concerns, and provides
the narrow ports (:mod:`ftrun.agent.ports`) the helpers act through. What to do about a fault is decided
by the attempt's coordination: the leader's (node 0) or a follower's.
"""

from __future__ import annotations

import dataclasses
import os
import selectors
import signal
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import psutil

from ftrun import events, open_files, protocol, registry
from ftrun.agent import metrics
from ftrun.agent.decisions import RecoveryOptions, rescue_source
from ftrun.agent.drills import Drills
from ftrun.agent.failures import AttemptResult, WorkerFailure, describe_failure, format_report
from ftrun.agent.failover import (elect, follow_elected, serve_group_store, start_leading,
                                  watch_followers)
from ftrun.agent.follower import Follower
from ftrun.agent.gpu_health import GpuHealth
from ftrun.agent.leader import Leader, LeaderSetup
from ftrun.agent.node_links import NodeLinks, await_followers, say_ended, start_links
from ftrun.agent.nodes import RemoteNodes, Takeover
from ftrun.agent.pool import CHANNEL, EXIT, OUTPUT, WorkerPool
from ftrun.agent.restarts import GroupRestarts
from ftrun.agent.run_dir import make_run_dir, register_launch, write_run_secret
from ftrun.agent.run_links import link_saved_state
from ftrun.agent.ports import Coordination, Restart, WorkerHandle
from ftrun.agent.shutdown import OnSignal, on_signal, schedule
from ftrun.agent.status_record import RunInfo, StatusPublisher
from ftrun.agent.stopper import Stopper
from ftrun.agent.store_access import StoreAccess
from ftrun.agent.workers import Worker, WorkerSlot
from ftrun.config import Endpoint, LaunchConfig
from ftrun.console import Console
from ftrun.errors import EXIT_OK, EXIT_SIGNAL_BASE, EXIT_WORKERS_FAILED, UsageError
from ftrun.events import EventLog
from ftrun.flag_values import resumed_rescue
from ftrun.nccl import startup_notices
from ftrun.processes import SignalWake, signal_name
from ftrun.store.auth import Seal
from ftrun.store.etcd_config import answering
from ftrun.store.host import StoreHost
from ftrun.store.job import JobStore
from ftrun.tally import run_summary

SIGNAL, MAIL, GPU = "signal", "mail", "gpu"
"""The tags of the agent's own selector registrations."""
FORK_SERVER_WAIT = 300.0
"""Seconds the first workers wait for the fork server's imports before they start as new processes instead."""


class Agent:
    """Runs the job on this node: attempts, group restarts within --max-restarts, the final report."""

    def __init__(self, config: LaunchConfig, store_host: StoreHost | None, console: Console) -> None:
        self.config = config
        self.console = console
        self.run_dir, self.run_name = make_run_dir(config)
        self.seal = Seal(config.secret)
        self.access = StoreAccess(config, store_host, self.seal, console)
        self.log = EventLog(self.run_dir / "events.jsonl", console.notice)
        self.selector = selectors.DefaultSelector()
        self.pool = WorkerPool(config, self.selector, console, self.log, self.run_dir)
        self.leader = config.node_rank == 0
        self.restart_count = 0
        self.term = 0  # elections held (with etcd): node 0 leads term 0
        self.fenced = False  # this leader could not renew its lease (etcd): the job goes on without it
        self.rescued = False  # a group restart of this launch saved a state (its rescue directory holds it)
        self.stopper: Stopper | None = None  # the stop of the current attempt, once it began
        self.registered: Path | None = None  # this launch's entry in the run registry, once its store answers
        self.result = AttemptResult()  # how the current attempt is going
        self.attempt_failure: str | None = None  # set by end_attempt: why the current attempt is being ended
        self.store: JobStore | None = None  # the agent's own store handle, once the store is served
        self.coordination: Coordination | None = None  # one per attempt, made before its event loop starts
        self.links: NodeLinks | None = None  # mailbox, outbox and leases, once the store answers
        self.gpu_health = GpuHealth(self.log, console, self.pool, self.end_attempt, config.xid_table,
                                    local_ranks=config.nproc_per_node + config.recovery.spares)
        self.restarts = GroupRestarts(config, self.gpu_health, console)
        self.status = StatusPublisher(RunInfo(self.run_name, config.run_id, str(self.run_dir), config.node_rank,
                                              config.min_nodes, config.world_size), self.pool, self.log,
                                      self.gpu_health.gpu_status, config.max_nodes)
        self.log.listeners.append(self.status.tally.add)
        self.local_world = config.nproc_per_node
        """Training workers this attempt starts on this node: fewer than --nproc-per-node after a GPU eviction."""
        self.signals: SignalWake | None = None
        """The handled signals that came (its pipe is readable when one has), while the agent runs."""
        self.restarted_after: float | None = None
        """Wall-clock time of the failure that ended the previous attempt (None in the first)."""
        drills = Drills(self.log, self.run_name, config.node_rank, self.ranked_workers,
                        lambda uid: self.coordination is not None and self.coordination.adopted(uid), self.gpu_health)
        self.commands: dict[str, Callable[[dict[str, Any]], dict[str, Any]]] = {
            protocol.PING: self._ping, protocol.INJECT: drills.inject}
        """Handlers of the commands posted to this node's mailbox (``ftrun inject``...), by their ``cmd``."""

    # ----------------------------------------------------------------- run
    def run(self) -> int:
        """Run attempts until success, a signal, or restarts run out; return ftrun's exit code."""
        config = self.config
        with answering(config.etcd):
            self.access.reach_etcd()
        workers = config.nproc_per_node + config.recovery.spares
        open_files.allow(workers, open_files.PER_WORKER, f"{workers} workers on this node")
        handled = set(config.signals_to_handle) | {signal.SIGINT, signal.SIGTERM, signal.SIGHUP}
        mail_r, mail_w = os.pipe()
        os.set_blocking(mail_r, False)
        os.set_blocking(mail_w, False)
        self.gpu_health.start()
        if config.metrics_port is not None:
            try:
                metrics.serve(config.metrics_port, "0.0.0.0", lambda: self.status.latest)
            except OSError as exc:  # metrics are a window on the job, not a reason to stop it
                self.console.notice(f"ftrun: no metrics: port {config.metrics_port}: {exc.strerror or exc}",
                                    style="yellow")
        self.log.write(events.START, run_id=config.run_id, command=config.command, node=config.node_rank,
                       nproc=config.nproc_per_node, world_size=config.world_size, store_port=config.store.port)
        if self.leader:
            write_run_secret(self.run_dir, config.secret, self.console)
        with SignalWake(handled) as wake:  # until the clean-up is done: a second Ctrl-C must not cut it short
            try:
                self.signals = wake
                self.selector.register(wake.fd, selectors.EVENT_READ, (SIGNAL, wake))
                self.selector.register(mail_r, selectors.EVENT_READ, (MAIL, mail_r))
                self.selector.register(self.gpu_health.wake_fd, selectors.EVENT_READ, (GPU, None))
                try:
                    return self._run_attempts(mail_w)
                finally:
                    for fd in (wake.fd, mail_r, self.gpu_health.wake_fd):
                        self.selector.unregister(fd)
            finally:
                self._clean_up(mail_r, mail_w)

    def _clean_up(self, mail_r: int, mail_w: int) -> None:
        """The launch is over: stop the fork server and GPU health, say so to the store, leave the registry."""
        self.pool.stop_fork_server()
        self.gpu_health.stop()
        if self.links is not None:
            self.links.stop()
            if not self.leader:
                if self.store is not None:  # before it says it ended: node 0's store answers until then
                    link_saved_state(self.store, self.config.node_rank, self.run_dir, self.console)
                say_ended(self.config, self.access)
        self.access.close()  # the store's process ends
        if self.registered is not None:
            registry.unregister(self.registered)
        os.close(mail_r)
        os.close(mail_w)
        self.log.close()

    def _run_attempts(self, mail_w: int) -> int:
        self.pool.start_fork_server()
        if self.config.etcd is not None and self.config.store.port == 0:
            with answering(self.config.etcd):
                where = self.access.find_group_store()
            self.config = self.pool.config = self.access.config = dataclasses.replace(
                self.config, store=where, master_addr=where.host)
        while True:
            early = self._start_group()  # waits for the fork server: it serves the store too
            if early is not None:  # Ctrl-C during the start: no worker was started, none is waited for
                self.console.notice(f"ftrun: received {signal_name(early)} before the workers started; stopped")
                self.log.write(events.END, outcome="interrupted", signal=early)
                return EXIT_SIGNAL_BASE + early
            if self.store is None:  # registered once it answers
                with answering(self.config.etcd):
                    self._serve_store(mail_w)
            started = self.pool.all()
            pids = " ".join(str(w.pid) for w in started)
            self.console.notice(f"ftrun: run {self.config.run_id}, attempt {self.restart_count}: {len(started)} "
                                f"worker{'s' if len(started) != 1 else ''} (pids {pids}); events in "
                                f"{self.run_dir}/events.jsonl", style="dim")
            self.coordination = self._coordination()
            self.status.coordination, self.status.attempt = self.coordination, self.restart_count
            for worker in self.pool.all():
                self.coordination.on_start(worker)
            result = self._watch()
            self.console.progress(None)
            self.log.write(events.ATTEMPT_END, attempt=self.restart_count, succeeded=result.succeeded,
                           signal=result.signal, reason=result.reason,
                           last_step=max(self.coordination.last_step.values(), default=None))
            self.rescued = self.rescued or self.coordination.saved_step >= 0
            if self.leader and self.restarts.leader_restarts(result, self.restart_count, self.fenced,
                                                             self.coordination) and self._serve_attempt_store(result):
                self.restart_count += 1
                self.restarted_after = min((f.when for f in result.failures), default=time.time())
                # after: the others start theirs
                self.coordination.close(result.reason, restart=Restart(self.restart_count, self.pool.rendezvous))
                self.console.notice(f"ftrun: {result.reason}; restarting the group "
                                    f"(restart {self.restart_count} of {self.config.max_restarts})", style="bold yellow")
                continue
            stopped = f"stopped by {signal_name(result.signal)}" if result.signal is not None else None
            self.coordination.close(None if result.succeeded else stopped or result.reason)
            if isinstance(self.coordination, Leader) and self.coordination.nodes is not None:
                await_followers(self.config, self.store, self.coordination.nodes.present())
            if result.succeeded:
                self.log.write(events.END, outcome="succeeded")
                self._summarise()
                return EXIT_OK
            if result.signal is not None:
                self.console.notice(f"ftrun: {stopped}; all workers stopped")
                self.log.write(events.END, outcome="interrupted", signal=result.signal)
                return EXIT_SIGNAL_BASE + result.signal
            if not self.leader:
                restart = self.restarts.follower_restart(result, self.coordination)
                if restart is not None:
                    self.restart_count, self.pool.rendezvous = restart
                    continue
                self.console.notice(f"ftrun: node {self.config.node_rank}: {result.reason}", style="bold red")
                self.log.write(events.END, outcome="failed", reason=result.reason)
                return EXIT_WORKERS_FAILED
            self.console.notice(format_report(self.config.script, result.reason, result.failures), style="bold red")
            self.log.write(events.END, outcome="failed", reason=result.reason)
            self._summarise()
            return EXIT_WORKERS_FAILED

    def _serve_attempt_store(self, result: AttemptResult) -> bool:
        """Serve the store the restarted attempt's workers rendezvous in; whether it is served (if not, the
        attempt's reason says why there is no restart)."""
        try:
            self.pool.rendezvous = self.access.serve_attempt_store(self.pool.fork_server)
        except (OSError, RuntimeError, UsageError) as exc:  # no address, no port, or torch's server failed
            result.reason = f"{result.reason}; no group restart: its workers' store could not be served: {exc}"
            return False
        return True

    def _summarise(self) -> None:
        """The leader's last line: steps, faults, recoveries, time lost, goodput."""
        if self.leader:
            self.console.notice(run_summary(self.status.tally, time.time()), style="bold")

    def _serve_store(self, mail_w: int) -> None:
        """Serve or reach the job's store, and say what start-up found (NCCL's version)."""
        self.store = self._open_store(mail_w)
        server = self.pool.fork_server  # torch is loaded, here or there: nothing is imported for this
        for text, style in startup_notices(server.torch if server is not None else None):
            self.console.notice(text, style=style)

    def _open_store(self, mail_w: int) -> JobStore:
        """Serve the store (or connect to it), and start this node's mailbox reader and lease."""
        config = self.config
        store = self.access.open(self.leader, self.pool.fork_server)
        if self.leader:
            store.write_job({"run_id": self.run_dir.name, "rdzv_id": config.run_id, "nnodes": config.min_nodes,
                             "world_size": config.world_size, "run_dir": str(self.run_dir)})
        if not config.under_launcher:  # only now: `ftrun status` and `inject` find a job whose store answers
            self.registered = register_launch(config, self.run_dir, self.console)
        self.links = start_links(config, self.leader, store, self.access, mail_w)
        self.status.store, self.status.dropped = store, self._dropped
        return store

    def _dropped(self) -> dict[str, Any]:
        """Messages this agent refused: from its mailbox (unsigned, forged, malformed) and its workers' channels."""
        mail = self.links.mail if self.links is not None else None
        return {"mail": mail.dropped if mail else 0, "channel": self.pool.dropped,
                "last": mail.last_dropped if mail else None}

    def _coordination(self) -> Coordination:
        """The current attempt's coordination: the leader's, or this follower's."""
        config, links = self.config, self.links
        if not self.leader:
            return Follower(config.node_rank, protocol.Plan(0, protocol.initial_members(self.sizes)),
                            config.recovery.hang_timeout, links.outbox, self.log, self.console, self, self.pool,
                            links.lease, links.leader_lease, config.max_nodes)
        recovery = config.recovery
        options = RecoveryOptions(recovery.enabled, recovery.min_nproc, recovery.recovery_timeout,
                                  recovery.join_timeout)
        setup = LeaderSetup(self.restart_count, self.sizes, options, recovery.respawn, recovery.hang_timeout,
                            config.multinode, self.restarted_after)
        leader = Leader(setup, self.store, self.log, self.console, self, self.pool, self.gpu_health)
        if links.node_leases is not None:
            leader.nodes = RemoteNodes(links.outbox, links.node_leases, config.max_nodes, self.restart_count, self.log,
                                       self.console, self, leader, config.node_rank,
                                       late=(config.min_nodes, config.nproc_per_node))
        return leader

    # ----------------------------------------------------------- workers
    def _start_group(self) -> int | None:
        """Start one worker per usable local rank (and the spares) for a new attempt; a signal that came before
        (while the fork server imported torch, say) starts none, and its number is returned.

        A local rank whose GPU was evicted gets no worker: the group is smaller, its ranks stay contiguous
        and WORLD_SIZE says so.
        """
        self.attempt_failure = None
        self.coordination = None  # the last attempt's: the new one is told of these workers once it is made
        self.gpu_health.restarts.clear()  # uids are numbered per attempt
        # Workers started now would each import torch: the fork server, importing it once, is done sooner.
        self.pool.await_fork_server(FORK_SERVER_WAIT, self.signals.fd)
        early = self.signals.received()
        if early:
            return early[0]
        local_ranks = self.gpu_health.usable_ranks(self.config.nproc_per_node)
        self.local_world = len(local_ranks)
        resume_from = self.config.resume_from
        resumed = resumed_rescue(resume_from, self.config.node_rank) if resume_from is not None else None
        self.pool.new_attempt(self.restart_count, self.sizes,
                              rescue_source(self.restart_count, self.rescued, self.run_dir, resumed))
        late = self.config.joins_late  # a node of --nnodes MIN:MAX's optional ones: every worker joins
        for index, local_rank in enumerate(local_ranks):
            self.start_worker(local_rank, rank=None if late else self.config.rank_offset + index)
        for index in range(self.config.recovery.spares):
            if self.gpu_health.usable(self.config.nproc_per_node + index):
                self.start_worker(self.config.nproc_per_node + index, rank=None)

    @property
    def sizes(self) -> tuple[int, ...]:
        """Training workers per node in the current attempt: this node's less its evicted GPUs'."""
        sizes = list(self.config.sizes)
        if not self.config.joins_late:
            sizes[self.config.node_rank] = self.local_world
        return tuple(sizes)

    def start_worker(self, local_rank: int, rank: int | None, respawn_of: WorkerSlot | None = None) -> Worker:
        """Start one worker of this node; ``rank`` None makes it a joiner (a spare, or ``respawn_of``'s
        replacement)."""
        worker = self.pool.start(local_rank, rank, respawn_of)
        if self.coordination is not None:
            self.coordination.on_start(worker)
        return worker

    def job_workers(self) -> list[WorkerHandle]:
        """Every live worker this agent answers for: its own and, on the leader, the other nodes' (those it
        gave up on as unkillable left out; none once it is fenced: it cannot reach them, and they are their own
        agents' to stop)."""
        remote = self.coordination.remote_workers() if self.coordination is not None and not self.fenced else []
        return [*self.pool.live(), *(w for w in remote if w.uid not in self.result.abandoned)]

    def ranked_workers(self) -> dict[int, Worker]:
        """Live workers that hold a rank, by the rank they were started as: idle spares and joiners
        waiting to be placed are left out; a placed joiner (a respawned worker) counts."""
        members = set(self.coordination.plan.members) if self.coordination is not None else set()
        return {w.slot.rank: w for w in self.pool.live() if not w.slot.joiner or w.uid in members}

    def stop_all(self, sig: int = signal.SIGTERM) -> None:
        """Signal every live worker and give them --shutdown-timeout seconds before SIGKILL; SIGKILL at once
        when ``sig`` is SIGKILL (also when a stop is under way)."""
        now = time.monotonic()
        if self.stopper is None:
            self._stop(sig, now)
        elif sig == signal.SIGKILL:
            self.stopper.kill_now(now)

    def _fenced_leader(self, now: float) -> str | None:
        """With etcd, the leader renews a lease too: when it cannot, it stops its own workers at once and ends
        (the other nodes, which see its lease run out, elect another); why, or None."""
        lease = self.links.lease
        fence = lease.fence_reason(now) if self.leader and lease is not None else None
        if fence is not None and not self.stopping():
            self.fenced = True
            self.log.write(events.FENCED, reason=fence)
            self.stop_all(signal.SIGKILL)
        return fence

    def leader_lost(self, lost: int, silent: float) -> str | None:
        """The leader's lease ran out (etcd): elect another through etcd; this node leads (it serves the process
        groups' store from now on, and plans without the lost leader's workers) or follows the one elected.
        None once one leads, else why this node stops."""
        config = self.config
        why = (f"node {lost}, the leader, let its lease run out (last seen renewed {silent:.1f} s ago: its agent is "
               "gone or cut off)")
        try:
            won = elect(self.store, self.term + 1, config.node_rank, lost, config.max_nodes, self._serve_group_store,
                        config.node_timeout)
        except (RuntimeError, OSError, UsageError) as exc:
            return f"{why}, and no other leader could be elected: {exc}; stopping this node's workers, their " \
                   "committed state saved"
        if won is None:
            return f"{why}, and the node elected after it did not say where it serves the store within " \
                   f"{config.node_timeout:g} s: stopping this node's workers, their committed state saved"
        self.term = won.term
        self.config = self.pool.config = self.access.config = dataclasses.replace(
            config, store=Endpoint(won.host, won.port), master_addr=won.host)  # for workers started later
        self.pool.rendezvous = None  # theirs too, rather than a restarted attempt's store
        self.log.write(events.LEADER, node=won.node, term=won.term, store=won.store, reason=why)
        if won.node != config.node_rank:
            follow_elected(won, lost, self.links, self.coordination, self.store, config.node_timeout)
            self.console.notice(f"ftrun: node {config.node_rank}: {why}; node {won.node} was elected leader",
                                style="bold yellow")
            return None
        others = [n for n in range(config.min_nodes) if n not in (lost, config.node_rank)]
        watch_followers(self.links, self.store, lost, others, config.node_timeout)
        follower, self.leader, self.status.leads = self.coordination, True, True
        self.coordination = self.status.coordination = self._coordination()
        start_leading(self.coordination, follower, won, Takeover(lost, why, time.time() - silent, set(others),
                                                                 time.monotonic() + config.node_timeout))
        self.console.notice(f"ftrun: node {config.node_rank}: {why}; this node was elected leader (term {won.term}) "
                            f"and serves the process groups' store at {won.store}", style="bold yellow")
        return None

    def _serve_group_store(self) -> tuple[str, int]:
        """Serve the process groups' store on this node (it was elected leader): its host and port."""
        return serve_group_store(self.access, self.pool.fork_server, self.config.store)

    def worker_message(self, worker: WorkerHandle, message: dict[str, Any]) -> None:
        """A control message from a worker of the job: an answer to a stop's request to save, and news for the
        coordination."""
        if self.stopper is not None:
            self.stopper.on_message(worker.uid, message)
        self.coordination.on_message(worker, message)

    def save_and_stop(self) -> None:
        """The API's workers save their committed state (to ``<run dir>/rescue``), then every worker stops."""
        if self.stopper is None:  # the leader is lost, its workers with it: sharded state saves their shards' copies
            self._stop(signal.SIGTERM, time.monotonic(), self._savers(), copies=True)

    def _stop(self, sig: int, now: float, savers: Sequence[WorkerHandle] = (), copies: bool = False) -> None:
        """Begin stopping the workers: ``savers`` save their state first (a preemption; with ``copies``, sharded
        state also the copies of other ranks' shards), then ``sig``."""
        stop = schedule(sig, now, self.config.shutdown_timeout, save=bool(savers))
        self.stopper = Stopper(stop, self.job_workers, self.abandon, self.log, self.console, self.run_dir, savers,
                               self.config.node_rank, copies)

    def stopping(self) -> bool:
        """Whether the attempt is being stopped."""
        return self.stopper is not None

    def abandon(self, worker: WorkerHandle, waited: float) -> None:
        """Stop waiting for a worker still there ``waited`` s after SIGKILL: report it (pid and process state),
        and count it lost; outside a stop, the others recover without it."""
        local = self.pool.get(worker.uid) is worker
        state = _process_state(worker.pid) if local else "unknown (another node's)"
        self.log.write(events.UNKILLABLE, uid=worker.uid, rank=worker.slot.rank, pid=worker.pid, state=state,
                       waited=waited)
        what = f"rank {worker.slot.rank} (pid {worker.pid}) is still there {waited:.0f} s after SIGKILL (state: {state})"
        self.console.notice(f"ftrun: {what}; no longer waiting for it", style="bold red")
        self.result.abandoned[worker.uid] = what
        if local:
            self.pool.abandon(worker.uid)
        if not self.stopping():
            self.workers_failed([(worker, WorkerFailure(worker.slot.rank, worker.slot.local_rank, worker.pid,
                                                        -signal.SIGKILL, time.time(), what, ""))])

    def end_attempt(self, reason: str) -> None:
        """Kill every worker of this node now (SIGKILL): the attempt fails with ``reason`` (the first one given)."""
        if self.attempt_failure is None:
            self.attempt_failure = reason
            self.log.write(events.GROUP_FAILURE, reason=reason)
        self.stop_all(signal.SIGKILL)

    def workers_failed(self, faults: list[tuple[WorkerHandle, WorkerFailure]]) -> None:
        """Recover in place from failed workers, or end the attempt."""
        if self.coordination.on_faults(faults):
            return
        self.result.failures.extend(failure for _, failure in faults)
        self.result.reason = f"worker failure: {faults[0][1].summary()}"
        self.log.write(events.GROUP_FAILURE, reason=self.result.reason)
        self.stop_all()

    # -------------------------------------------------------------- loop
    def _watch(self) -> AttemptResult:
        """The event loop of one attempt: output, exits, control messages, mail, signals, deadlines."""
        result = self.result = AttemptResult()
        self.stopper = None
        next_tick = 0.0
        while self.job_workers() or self.coordination.awaiting(time.monotonic()):
            # A wake for output lines and progress alone leaves the deadlines to the monitor interval: a training
            # job wakes the agent at every step, and each pass over the deadlines is CPU its workers lose.
            routine = True
            for key, _ in self.selector.select(self.config.monitor_interval):
                kind, data = key.data
                routine = routine and kind in (OUTPUT, CHANNEL)
                if kind == OUTPUT:
                    self.pool.read_output(key.fileobj, *data)
                elif kind == CHANNEL:
                    for message in self.pool.read_channel(data):
                        routine = routine and message.get("t") == protocol.PROGRESS
                        self.worker_message(self.pool.get(data), message)
                elif kind == EXIT:
                    self._on_exit(data)
                elif kind == SIGNAL:
                    self._on_signals(data.received(), result)
                elif kind == MAIL:
                    self._read_mail(data)
                elif kind == GPU:
                    self.gpu_health.drain()
            now = time.monotonic()
            if routine and now < next_tick:
                continue
            next_tick = now + self.config.monitor_interval
            fenced = self._fenced_leader(now)  # first: cut off, each store call below hangs until its timeout
            if self.stopper is not None:
                self.stopper.tick(now)
            fallback = self.coordination.tick(now) or fenced
            self.status.tick(now)  # its writes hang as well: after the lease's and the nodes' checks
            if fallback:
                result.reason = fallback
                self.stop_all()
        self.pool.close_all()
        result.reason = self.attempt_failure or result.reason
        result.succeeded = result.signal is None and not result.reason and self.coordination.succeeded()
        return result

    def _read_mail(self, mail_r: int) -> None:
        """Handle what arrived in this node's mailbox: commands (answered), and the other nodes' news."""
        try:
            os.read(mail_r, 4096)
        except BlockingIOError:
            pass
        for message in self.links.mail.take():
            if "cmd" in message:
                handler = self.commands.get(message["cmd"])
                if handler is None:
                    answer = {"ok": False, "error": f"this agent does not know the command {message['cmd']!r}"}
                else:
                    answer = handler(message)
                try:
                    self.store.reply(message, answer)
                except RuntimeError:
                    pass  # the asker's store went away: nobody to answer
            else:
                self.coordination.on_mail(message)

    def _ping(self, message: dict[str, Any]) -> dict[str, Any]:
        """Answer ``ping``: who this agent is and which ranks it runs."""
        return {"ok": True, "run": self.run_name, "node_rank": self.config.node_rank, "pid": os.getpid(),
                "attempt": self.restart_count, "ranks": {str(rank): w.pid for rank, w in self.ranked_workers().items()}}

    def _on_exit(self, uid: int) -> None:
        code = self.pool.reap(uid)
        worker = self.pool.get(uid)
        if worker.abandoned:
            return  # given up on and counted lost already: it ended at last
        if code == 0 or self.stopping():
            if code == 0:
                self.coordination.on_finished(worker)
            return
        failure = describe_failure(worker.slot.rank, worker.slot.local_rank, worker.pid, code, worker.error_file,
                                   self.pool.stderr_tail(uid))
        self.workers_failed([(worker, failure)])

    def _on_signals(self, received: list[int], result: AttemptResult) -> None:
        for sig in received:
            act, why = on_signal(result.signal is not None, self.stopping(), len(self._savers()))
            if result.signal is None:
                result.signal = sig
                self.console.notice(f"ftrun: received {signal_name(sig)}, stopping the workers: {why}")
            else:
                self.console.notice(f"ftrun: received {signal_name(sig)} again: {why}")
            if act is OnSignal.KILL:
                self.stop_all(signal.SIGKILL)
            elif act is OnSignal.SAVE_THEN_STOP:  # copies of shards only where a member may be lost
                self._stop(sig, time.monotonic(), self._savers(), copies=self.coordination.recovering)
            else:
                self.stop_all(sig)

    def _savers(self) -> list[WorkerHandle]:
        """The live training workers that use the worker API this agent answers for (on the leader, the other
        nodes' too: a node that was not signalled itself saves only when asked): they can save their state
        before they stop (an idle spare has none of its own)."""
        c = self.coordination
        live = [*self.pool.live(), *(c.remote_workers() if c is not None and not self.fenced else [])]
        return [w for w in live if c is not None and c.adopted(w.uid) and w.uid in c.plan.members]


def _process_state(pid: int) -> str:
    """A process's state as ps shows it (``disk-sleep`` for uninterruptible sleep), or why it is not known."""
    try:
        return psutil.Process(pid).status()
    except psutil.Error as exc:
        return f"unknown ({type(exc).__name__})"
