"""The node agent: starts the workers, watches them, recovers in place or restarts the group, reports."""

from __future__ import annotations

import json
import os
import selectors
import signal
import time
import uuid
from collections.abc import Callable
from typing import Any

from ftrun import control, registry
from ftrun.agent.cluster import Followers, LeaseKeeper, Relay, RemoteWorker, node_of
from ftrun.agent.drills import Drills
from ftrun.agent.env import worker_env
from ftrun.agent.failures import AttemptResult, WorkerFailure, describe_failure, format_report
from ftrun.agent.gpu_health import WAKE, GpuHealth
from ftrun.agent.output import Console2, WorkerOutput, render_prefix
from ftrun.agent.recovery import Coordinator
from ftrun.agent.status_record import StatusPublisher
from ftrun.agent.workers import Worker, WorkerSlot, spawn_worker
from ftrun.config import STDERR, STDOUT, LaunchConfig
from ftrun.errors import EXIT_OK, EXIT_SIGNAL_BASE, EXIT_WORKERS_FAILED
from ftrun.events import EventLog
from ftrun.nccl import startup_notices
from ftrun.protocol import UID_STRIDE
from ftrun.store import StoreHost


STORE_TIMEOUT = 300.0
"""Seconds an agent's store calls may wait (a follower waits this long for node 0 to serve the store)."""


class Agent:
    """Runs the job on this node: attempts, group restarts within --max-restarts, the final report."""

    def __init__(self, config: LaunchConfig, store_host: StoreHost | None, console: Console2) -> None:
        self.config = config
        self.store_host = store_host  # None: another process serves the store (node 0, or the hostfile launcher)
        self.console = console
        root = config.log_dir or registry.default_runs_root()
        self.run_dir = root / (config.run_name or f"{config.run_id}_{uuid.uuid4().hex[:8]}")
        if config.node_rank > 0:
            self.run_dir = self.run_dir / f"node{config.node_rank}"
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.events = EventLog(self.run_dir / "events.jsonl")
        self.selector = selectors.DefaultSelector()
        self.workers: dict[int, Worker] = {}
        self.outputs: dict[int, WorkerOutput] = {}
        self.first_uid = config.node_rank * UID_STRIDE
        self.next_uid = self.first_uid
        self.leader = config.node_rank == 0
        self.restart_count = 0
        self.stop_deadline: float | None = None
        self.pending_signal: int | None = None
        self.coordinator: Coordinator | Relay | None = None  # one per attempt, made before its event loop starts
        self.result = AttemptResult()  # how the current attempt is going
        self.store = None  # the agent's own store handle, once the store is served
        self.mail: control.MailReader | None = None
        self.followers: Followers | None = None  # the leader's view of the other nodes
        self.lease: LeaseKeeper | None = None  # a follower's own lease
        self.commands: dict[str, Callable[[dict[str, Any]], dict[str, Any]]] = {"ping": self._ping}
        """Handlers of the commands posted to this node's mailbox (``ftrun inject``...), by their ``cmd``."""
        self.gpu_health = GpuHealth(self, config.xid_table)
        self.status = StatusPublisher(self, self.gpu_health.gpu_status)
        self.local_world = config.nproc_per_node
        """Training workers this attempt starts on this node: fewer than --nproc-per-node after a GPU eviction."""
        self.attempt_failure: str | None = None  # set by end_attempt: why the current attempt is being ended
        Drills(self).install()

    # ----------------------------------------------------------------- run
    def run(self) -> int:
        """Run attempts until success, a signal, or restarts run out; return ftrun's exit code."""
        wake_r, wake_w = os.pipe()
        os.set_blocking(wake_r, False)
        os.set_blocking(wake_w, False)
        previous_wakeup = signal.set_wakeup_fd(wake_w)
        handled = set(self.config.signals_to_handle) | {signal.SIGINT, signal.SIGTERM, signal.SIGHUP}
        previous = {sig: signal.signal(sig, lambda *_: None) for sig in handled}
        self.selector.register(wake_r, selectors.EVENT_READ, ("signal", None))
        self.gpu_health.start()
        mail_r, self.mail_w = os.pipe()
        os.set_blocking(mail_r, False)
        os.set_blocking(self.mail_w, False)
        self.selector.register(mail_r, selectors.EVENT_READ, ("mail", None))
        self.events.write("start", run_id=self.config.run_id, command=self.config.command, node=self.config.node_rank,
                          nproc=self.config.nproc_per_node, world_size=self.config.world_size,
                          store_port=self.store_port)
        entry = None
        if not self.config.under_launcher:
            entry = registry.register(registry.new_entry(self.run_dir.name, self.config.run_id,
                                                         self.config.master_addr, self.store_port, self.run_dir))
        try:
            return self._run_attempts(wake_r, mail_r)
        finally:
            self.gpu_health.stop()
            for service in (self.mail, self.lease):
                if service is not None:
                    service.stop()
            if entry is not None:
                registry.unregister(entry)
            self.selector.unregister(mail_r)
            os.close(mail_r)
            os.close(self.mail_w)
            signal.set_wakeup_fd(previous_wakeup)
            for sig, handler in previous.items():
                signal.signal(sig, handler)
            self.selector.unregister(wake_r)
            os.close(wake_r)
            os.close(wake_w)
            self.events.close()

    @property
    def store_port(self) -> int:
        """The port of the job's store."""
        return self.store_host.port if self.store_host is not None else self.config.store.port

    def _connect_store(self, timeout: float = STORE_TIMEOUT) -> Any:
        """A new client connection to the job's store."""
        host = "127.0.0.1" if self.store_host is not None else self.config.store.host
        return control.open_store(host, self.store_port, timeout)

    def _open_store(self) -> Any:
        """Serve the store (or connect to it), and start this node's mailbox reader and lease."""
        if self.store_host is not None:
            store = self.store_host.start()
        elif self.leader:
            store = self._connect_store()
        else:  # short calls, so that its loop goes on to fence itself if the store stops answering
            host, port = self.config.store.host, self.store_port
            store = control.open_store_retrying(host, port, self.config.node_timeout / 2, STORE_TIMEOUT)
        if self.leader:
            store.set(control.JOB_KEY, json.dumps({"run_id": self.run_dir.name, "rdzv_id": self.config.run_id,
                                                   "nnodes": self.config.min_nodes,
                                                   "world_size": self.config.world_size,
                                                   "run_dir": str(self.run_dir)}))
        self.mail = control.MailReader(self._connect_store, control.node_box(self.config.node_rank), self.mail_w)
        self.mail.start()
        if self.config.multinode and self.leader:
            self.followers = Followers(self, store)
        elif self.config.multinode:
            self.lease = LeaseKeeper(lambda: self._connect_store(self.config.node_timeout / 2),
                                     self.config.node_rank, self.config.node_timeout)
            self.lease.start()
        return store

    def _run_attempts(self, wake_r: int, mail_r: int) -> int:
        store = None
        while True:
            self._start_group()
            pids = " ".join(str(w.pid) for w in self.workers.values())
            self.console.notice(f"ftrun: run {self.config.run_id}, attempt {self.restart_count}: "
                                f"{len(self.workers)} workers (pids {pids}); events in {self.run_dir}/events.jsonl",
                                style="dim")
            if store is None:
                store = self.store = self._open_store()
                for text, style in startup_notices():  # torch is loaded now (for the store): nothing imported for this
                    self.console.notice(text, style=style)
            self.coordinator = Coordinator(self, store) if self.leader else Relay(self, store, self.lease)
            if isinstance(self.coordinator, Relay):
                for worker in self.workers.values():
                    self.coordinator.on_start(worker)
            result = self._watch(wake_r, mail_r)
            self.events.write("attempt_end", attempt=self.restart_count, succeeded=result.succeeded,
                              signal=result.signal, reason=result.reason,
                              last_step=max(self.coordinator.last_step.values(), default=None))
            if result.succeeded:
                self.events.write("end", outcome="succeeded")
                return EXIT_OK
            if result.signal is not None:
                self.console.notice(f"ftrun: stopped by {signal.Signals(result.signal).name}; all workers stopped")
                self.events.write("end", outcome="interrupted", signal=result.signal)
                return EXIT_SIGNAL_BASE + result.signal
            if not self.leader:
                self.console.notice(f"ftrun: node {self.config.node_rank}: {result.reason}", style="bold red")
                self.events.write("end", outcome="failed", reason=result.reason)
                return EXIT_WORKERS_FAILED
            if self.config.multinode:
                self.followers.stop(result.reason)
            elif self.restart_count < self.config.max_restarts:
                refused = self.gpu_health.why_no_restart()
                if refused is None:
                    self.restart_count += 1
                    self.store_host.clear_worker_keys()  # the new group must not read the old one's addresses
                    self.console.notice(
                        f"ftrun: {result.reason}; restarting the group "
                        f"(restart {self.restart_count} of {self.config.max_restarts})", style="bold yellow")
                    continue
                result.reason = f"{result.reason}; no group restart: {refused}"
            self.console.notice(format_report(self.config.script, result.reason, result.failures), style="bold red")
            self.events.write("end", outcome="failed", reason=result.reason)
            return EXIT_WORKERS_FAILED

    # ----------------------------------------------------------- workers
    def _start_group(self) -> None:
        """Start one worker per usable local rank (and the spares) for a new attempt.

        A local rank whose GPU was evicted gets no worker: the group is smaller, its ranks stay contiguous
        and WORLD_SIZE says so.
        """
        self.workers.clear()
        self.next_uid = self.first_uid
        self.attempt_failure = None
        self.gpu_health.restarts.clear()  # uids are numbered per attempt
        local_ranks = [r for r in range(self.config.nproc_per_node) if self.gpu_health.usable(r)]
        self.local_world = len(local_ranks)
        for index, local_rank in enumerate(local_ranks):
            self.start_worker(local_rank, rank=self.config.rank_offset + index)
        for index in range(self.config.recovery.spares):
            if self.gpu_health.usable(self.config.nproc_per_node + index):
                self.start_worker(self.config.nproc_per_node + index, rank=None)

    @property
    def sizes(self) -> tuple[int, ...]:
        """Training workers per node in the current attempt: this node's less its evicted GPUs'."""
        sizes = list(self.config.sizes)
        sizes[self.config.node_rank] = self.local_world
        return tuple(sizes)

    @property
    def world_size(self) -> int:
        """Training workers of the current attempt, all nodes."""
        return sum(self.sizes)

    def start_worker(self, local_rank: int, rank: int | None, respawn_of: WorkerSlot | None = None) -> Worker | None:
        """Start one worker; ``rank`` None makes it a joiner (a spare, or ``respawn_of``'s replacement).

        The replacement of another node's worker is started by that node's agent (None is returned).
        """
        if respawn_of is not None and node_of(respawn_of.uid) != self.config.node_rank:
            control.post(self.store, control.node_box(node_of(respawn_of.uid)),
                         {"t": "start_worker", "uid": respawn_of.uid, "local_rank": local_rank,
                          "rank": respawn_of.rank})
            return None
        uid = self.next_uid
        self.next_uid += 1
        joiner = rank is None
        shown_rank = respawn_of.rank if respawn_of else (uid if joiner else rank)
        slot = WorkerSlot(uid=uid, worker_id=f"{self.config.node_rank}:{uid}", local_rank=local_rank,
                          rank=shown_rank, spare=joiner)
        first = uid - self.first_uid == local_rank
        attempt_dir = self.run_dir / f"attempt_{self.restart_count}" / (str(local_rank) if first
                                                                          else f"{local_rank}.{uid - self.first_uid}")
        env = worker_env(self.config, rank=shown_rank, local_rank=local_rank, uid=uid,
                         restart_count=self.restart_count, store_port=self.store_port,
                         run_dir=str(self.run_dir), spare=joiner, node_sizes=self.sizes)
        worker = spawn_worker(slot, self.config.command, env, attempt_dir / "error.json")
        prefix = render_prefix(self.config.log_line_prefix_template, self.config.role, shown_rank, local_rank,
                               self.config.node_name)
        if joiner and respawn_of is None:
            prefix = f"[spare{uid}]: "
        console_mask = 0 if (self.config.local_ranks_filter is not None
                             and local_rank not in self.config.local_ranks_filter) else 3
        console_mask &= ~self.config.redirects.get(local_rank, 0)
        log_dir = attempt_dir if self.config.log_dir else None
        self.workers[uid] = worker
        self.outputs[uid] = WorkerOutput(self.console, prefix, shown_rank, console_mask, log_dir)
        for stream, pipe in ((STDOUT, worker.proc.stdout), (STDERR, worker.proc.stderr)):
            os.set_blocking(pipe.fileno(), False)
            self.selector.register(pipe, selectors.EVENT_READ, ("output", (uid, stream)))
        self.selector.register(worker.pidfd, selectors.EVENT_READ, ("exit", uid))
        self.selector.register(worker.channel, selectors.EVENT_READ, ("channel", uid))
        self.events.write("worker_start", uid=uid, rank=shown_rank, local_rank=local_rank, pid=worker.pid,
                          joiner=joiner, attempt=self.restart_count, node=self.config.node_rank)
        if isinstance(self.coordinator, Relay):
            self.coordinator.on_start(worker)
        return worker

    def live_workers(self) -> list[Worker]:
        """This node's workers that have not ended."""
        return [w for w in self.workers.values() if w.exitcode is None]

    def job_workers(self) -> list[Worker | RemoteWorker]:
        """Every live worker this agent answers for: its own and, on the leader, the other nodes'."""
        return [*self.live_workers(), *(self.followers.live() if self.followers is not None else [])]

    def stop_all(self, sig: int = signal.SIGTERM) -> None:
        """Signal every live worker and give them --shutdown-timeout seconds before SIGKILL."""
        for worker in self.job_workers():
            worker.send_signal(sig)
        if self.stop_deadline is None:
            self.stop_deadline = time.monotonic() + self.config.shutdown_timeout

    def end_attempt(self, reason: str) -> None:
        """Kill every worker of this node now (SIGKILL): the attempt fails with ``reason`` (the first one given)."""
        if self.attempt_failure is None:
            self.attempt_failure = reason
            self.events.write("group_failure", reason=reason)
        self.stop_all(signal.SIGKILL)

    # -------------------------------------------------------------- loop
    def _watch(self, wake_r: int, mail_r: int) -> AttemptResult:
        """The event loop of one attempt: output, exits, control messages, mail, signals, deadlines."""
        result = self.result = AttemptResult()
        self.stop_deadline = None
        while self.job_workers():
            timeout = self.config.monitor_interval
            for key, _ in self.selector.select(timeout):
                kind, data = key.data
                if kind == "output":
                    self._read_output(key.fileobj, *data)
                elif kind == "channel":
                    self._read_channel(data)
                elif kind == "exit":
                    self._on_exit(data)
                elif kind == "signal":
                    self._on_signal(wake_r, result)
                elif kind == "mail":
                    self._read_mail(mail_r)
                elif kind == WAKE:
                    self.gpu_health.drain()
            now = time.monotonic()
            if self.followers is not None:
                self.followers.tick(now)
            if self.stop_deadline is not None and now > self.stop_deadline:
                for worker in self.job_workers():
                    worker.send_signal(signal.SIGKILL)
                self.stop_deadline = now + 3600
            self.status.tick(now)
            if self.stop_deadline is None:
                fallback = self.coordinator.tick(now)
                if fallback:
                    result.reason = fallback
                    self.stop_all()
        for uid, worker in list(self.workers.items()):
            self._drain(uid)
            self.outputs.pop(uid).close()
            self._unregister(worker)
            worker.close()
        result.reason = self.attempt_failure or result.reason
        result.succeeded = result.signal is None and not result.reason and self.coordinator.succeeded()
        return result

    def _read_mail(self, mail_r: int) -> None:
        """Handle what arrived in this node's mailbox: commands (answered), and the other nodes' news."""
        try:
            os.read(mail_r, 4096)
        except BlockingIOError:
            pass
        for message in self.mail.take():
            if "cmd" in message:
                handler = self.commands.get(message["cmd"])
                if handler is None:
                    answer = {"ok": False, "error": f"this agent does not know the command {message['cmd']!r}"}
                else:
                    answer = handler(message)
                try:
                    control.reply(self.store, message, answer)
                except RuntimeError:
                    pass  # the asker's store went away: nobody to answer
            elif self.followers is not None:
                self.followers.on_message(message)
            else:
                self.coordinator.on_leader_message(message)

    def _ping(self, message: dict[str, Any]) -> dict[str, Any]:
        """Answer ``ping``: who this agent is and which ranks it runs."""
        return {"ok": True, "node_rank": self.config.node_rank, "pid": os.getpid(), "attempt": self.restart_count,
                "ranks": {str(rank): w.pid for rank, w in self.ranked_workers().items()}}

    def ranked_workers(self) -> dict[int, Worker]:
        """Live workers that hold a rank, by the rank they were started as: idle spares and joiners
        waiting to be placed are left out; a placed joiner (a respawned worker) counts."""
        members = set(self.coordinator.plan.members)
        return {w.slot.rank: w for w in self.live_workers() if not w.slot.spare or w.uid in members}

    def _unregister(self, worker: Worker) -> None:
        for obj in (worker.proc.stdout, worker.proc.stderr, worker.pidfd, worker.channel):
            try:
                self.selector.unregister(obj)
            except (KeyError, ValueError):
                pass

    def _read_output(self, pipe, uid: int, stream: int) -> bool:
        """Move one chunk of a worker's pipe to its output; False when nothing more is ready, or at EOF."""
        if pipe not in self.selector.get_map():  # drained to EOF by _on_exit earlier in the same select batch
            return False
        try:
            data = os.read(pipe.fileno(), 65536)
        except BlockingIOError:
            return False
        self.outputs[uid].feed(stream, data)
        if not data:
            self.selector.unregister(pipe)
        return bool(data)

    def _drain(self, uid: int) -> None:
        """Read what an ended worker left in its pipes, so its last words reach the log and the report."""
        worker = self.workers[uid]
        for stream, pipe in ((STDOUT, worker.proc.stdout), (STDERR, worker.proc.stderr)):
            while self._read_output(pipe, uid, stream):
                pass

    def _read_channel(self, uid: int) -> None:
        worker = self.workers[uid]
        try:
            data = worker.channel.recv(65536)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if not data:
            self.selector.unregister(worker.channel)
            return
        worker.channel_buffer += data
        *lines, worker.channel_buffer = worker.channel_buffer.split(b"\n")
        for line in lines:
            if line:
                self.coordinator.on_message(worker, json.loads(line))

    def _on_exit(self, uid: int) -> None:
        worker = self.workers[uid]
        self.selector.unregister(worker.pidfd)
        code = worker.reap()
        self._drain(uid)
        self.events.write("worker_exit", uid=uid, rank=worker.slot.rank, pid=worker.pid, exitcode=code,
                          node=self.config.node_rank)
        if code == 0 or self.stop_deadline is not None:
            if code == 0:
                self.coordinator.on_finished(worker)
            return
        failure = describe_failure(worker.slot.rank, worker.slot.local_rank, worker.pid, code, worker.error_file,
                                   self.outputs[uid].stderr_tail)
        self.workers_failed([(worker, failure)])

    def workers_failed(self, faults: list[tuple[Worker | RemoteWorker, WorkerFailure]]) -> None:
        """Recover in place from failed workers, or end the attempt."""
        if self.coordinator.on_faults(faults):
            return
        self.result.failures.extend(failure for _, failure in faults)
        self.result.reason = f"worker failure: {faults[0][1].summary()}"
        self.events.write("group_failure", reason=self.result.reason)
        self.stop_all()

    def _on_signal(self, wake_r: int, result: AttemptResult) -> None:
        try:
            received = os.read(wake_r, 64)
        except BlockingIOError:
            return
        for sig in received:
            if result.signal is not None:
                for worker in self.job_workers():  # a second signal: no more waiting
                    worker.send_signal(signal.SIGKILL)
                continue
            result.signal = sig
            self.console.notice(f"ftrun: received {signal.Signals(sig).name}, stopping the workers")
            self.stop_all(sig)
