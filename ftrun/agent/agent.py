"""The node agent: starts the workers, watches them, recovers in place or restarts the group, reports."""

from __future__ import annotations

import json
import os
import selectors
import signal
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ftrun.agent.drills import Drills
from ftrun.agent.env import worker_env
from ftrun.agent.failures import WorkerFailure, describe_failure, format_report
from ftrun.agent.output import Console2, WorkerOutput, render_prefix
from ftrun.agent.recovery import Coordinator
from ftrun.agent.workers import Worker, WorkerSlot, spawn_worker
from ftrun import control, registry
from ftrun.config import STDERR, STDOUT, LaunchConfig
from ftrun.errors import EXIT_OK, EXIT_SIGNAL_BASE, EXIT_WORKERS_FAILED
from ftrun.events import EventLog
from ftrun.store import StoreHost


def default_runs_root() -> Path:
    """Where runs without --log-dir keep their event log and error files."""
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    root = Path(cache) / "ftrun" / "runs"
    try:
        root.mkdir(parents=True, exist_ok=True)
        return root
    except OSError:
        return Path(tempfile.mkdtemp(prefix="ftrun_"))


MAIL_INTERVAL = 0.2
"""Seconds between two looks at this node's mailbox in the store."""


@dataclass
class AttemptResult:
    """How one attempt (one start of the worker group) ended."""

    succeeded: bool = False
    signal: int | None = None
    failures: list[WorkerFailure] = field(default_factory=list)
    reason: str = ""


class Agent:
    """Runs the job on this node: attempts, group restarts within --max-restarts, the final report."""

    def __init__(self, config: LaunchConfig, store_host: StoreHost, console: Console2) -> None:
        self.config = config
        self.store_host = store_host
        self.console = console
        root = config.log_dir or default_runs_root()
        self.run_dir = root / f"{config.run_id}_{uuid.uuid4().hex[:8]}"
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.events = EventLog(self.run_dir / "events.jsonl")
        self.selector = selectors.DefaultSelector()
        self.workers: dict[int, Worker] = {}
        self.outputs: dict[int, WorkerOutput] = {}
        self.next_uid = 0
        self.restart_count = 0
        self.stop_deadline: float | None = None
        self.pending_signal: int | None = None
        self.coordinator: Coordinator  # one per attempt, made before its event loop starts
        self.store = None  # the agent's own store handle, once the store is served
        self.mailbox: control.Mailbox | None = None
        self.next_mail_check = 0.0
        self.commands: dict[str, Callable[[dict[str, Any]], dict[str, Any]]] = {"ping": self._ping}
        """Handlers of the commands posted to this node's mailbox (``ftrun inject``...), by their ``cmd``."""
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
        self.events.write("start", run_id=self.config.run_id, command=self.config.command,
                          nproc=self.config.nproc_per_node, store_port=self.store_host.port)
        entry = registry.register(registry.new_entry(self.run_dir.name, self.config.run_id,
                                                     self.config.master_addr, self.store_host.port, self.run_dir))
        try:
            return self._run_attempts(wake_r)
        finally:
            registry.unregister(entry)
            signal.set_wakeup_fd(previous_wakeup)
            for sig, handler in previous.items():
                signal.signal(sig, handler)
            self.selector.unregister(wake_r)
            os.close(wake_r)
            os.close(wake_w)
            self.events.close()

    def _run_attempts(self, wake_r: int) -> int:
        store = None
        while True:
            self._start_group()
            pids = " ".join(str(w.pid) for w in self.workers.values())
            self.console.notice(f"ftrun: run {self.config.run_id}, attempt {self.restart_count}: "
                                f"{len(self.workers)} workers (pids {pids}); events in {self.run_dir}/events.jsonl",
                                style="dim")
            if store is None:
                store = self.store = self.store_host.start()
                store.set(control.JOB_KEY, json.dumps({"run_id": self.run_dir.name, "rdzv_id": self.config.run_id,
                                                       "nnodes": self.config.min_nodes,
                                                       "world_size": self.config.world_size,
                                                       "run_dir": str(self.run_dir)}))
                self.mailbox = control.Mailbox(store, control.node_box(self.config.node_rank))
            self.coordinator = Coordinator(self, store)
            result = self._watch(wake_r)
            self.events.write("attempt_end", attempt=self.restart_count, succeeded=result.succeeded,
                              signal=result.signal, reason=result.reason)
            if result.succeeded:
                self.events.write("end", outcome="succeeded")
                return EXIT_OK
            if result.signal is not None:
                self.console.notice(f"ftrun: stopped by {signal.Signals(result.signal).name}; all workers stopped")
                self.events.write("end", outcome="interrupted", signal=result.signal)
                return EXIT_SIGNAL_BASE + result.signal
            if self.restart_count < self.config.max_restarts:
                self.restart_count += 1
                self.store_host.clear_worker_keys()  # the new group must not read the old one's addresses
                self.console.notice(
                    f"ftrun: {result.reason}; restarting the group "
                    f"(restart {self.restart_count} of {self.config.max_restarts})", style="bold yellow")
                continue
            self.console.notice(format_report(self.config.script, result.reason, result.failures), style="bold red")
            self.events.write("end", outcome="failed", reason=result.reason)
            return EXIT_WORKERS_FAILED

    # ----------------------------------------------------------- workers
    def _start_group(self) -> None:
        """Start nproc workers (and the spares) for a new attempt."""
        self.workers.clear()
        self.next_uid = 0
        for local_rank in range(self.config.nproc_per_node):
            self.start_worker(local_rank, rank=local_rank)
        for index in range(self.config.recovery.spares):
            self.start_worker(self.config.nproc_per_node + index, rank=None)

    def start_worker(self, local_rank: int, rank: int | None, respawn_of: WorkerSlot | None = None) -> Worker:
        """Start one worker; ``rank`` None makes it a joiner (a spare, or ``respawn_of``'s replacement)."""
        uid = self.next_uid
        self.next_uid += 1
        joiner = rank is None
        shown_rank = respawn_of.rank if respawn_of else (uid if joiner else rank)
        slot = WorkerSlot(uid=uid, worker_id=f"{self.config.node_rank}:{uid}", local_rank=local_rank,
                          rank=shown_rank, spare=joiner)
        attempt_dir = self.run_dir / f"attempt_{self.restart_count}" / (str(local_rank) if uid == local_rank
                                                                          else f"{local_rank}.{uid}")
        env = worker_env(self.config, rank=shown_rank, local_rank=local_rank, uid=uid,
                         restart_count=self.restart_count, store_port=self.store_host.port,
                         run_dir=str(self.run_dir), spare=joiner)
        worker = spawn_worker(slot, self.config.command, env, attempt_dir / "error.json")
        prefix = render_prefix(self.config.log_line_prefix_template, self.config.role, shown_rank, local_rank)
        if joiner and respawn_of is None:
            prefix = f"[spare{uid}]:"
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
                          joiner=joiner, attempt=self.restart_count)
        return worker

    def live_workers(self) -> list[Worker]:
        """Workers that have not ended."""
        return [w for w in self.workers.values() if w.exitcode is None]

    def stop_all(self, sig: int = signal.SIGTERM) -> None:
        """Signal every live worker and give them --shutdown-timeout seconds before SIGKILL."""
        for worker in self.live_workers():
            worker.send_signal(sig)
        if self.stop_deadline is None:
            self.stop_deadline = time.monotonic() + self.config.shutdown_timeout

    # -------------------------------------------------------------- loop
    def _watch(self, wake_r: int) -> AttemptResult:
        """The event loop of one attempt: output, exits, control messages, signals, deadlines."""
        result = AttemptResult()
        self.stop_deadline = None
        while self.live_workers():
            timeout = self.config.monitor_interval
            for key, _ in self.selector.select(timeout):
                kind, data = key.data
                if kind == "output":
                    self._read_output(key.fileobj, *data)
                elif kind == "channel":
                    self._read_channel(data)
                elif kind == "exit":
                    self._on_exit(data, result)
                elif kind == "signal":
                    self._on_signal(wake_r, result)
            now = time.monotonic()
            if self.stop_deadline is not None and now > self.stop_deadline:
                for worker in self.live_workers():
                    worker.send_signal(signal.SIGKILL)
                self.stop_deadline = now + 3600
            if now >= self.next_mail_check:
                self._read_mail()
                self.next_mail_check = now + MAIL_INTERVAL
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
        result.succeeded = result.signal is None and not result.reason and self.coordinator.succeeded()
        return result

    def _read_mail(self) -> None:
        """Run the commands posted to this node's mailbox and answer each."""
        for message in self.mailbox.poll():
            handler = self.commands.get(message.get("cmd", ""))
            if handler is None:
                answer = {"ok": False, "error": f"this agent does not know the command {message.get('cmd')!r}"}
            else:
                answer = handler(message)
            control.reply(self.store, message, answer)

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

    def _on_exit(self, uid: int, result: AttemptResult) -> None:
        worker = self.workers[uid]
        self.selector.unregister(worker.pidfd)
        code = worker.reap()
        self._drain(uid)
        self.events.write("worker_exit", uid=uid, rank=worker.slot.rank, pid=worker.pid, exitcode=code)
        if code == 0 or self.stop_deadline is not None:
            if code == 0:
                self.coordinator.on_finished(worker)
            return
        failure = describe_failure(worker.slot.rank, worker.slot.local_rank, worker.pid, code, worker.error_file,
                                   self.outputs[uid].stderr_tail)
        if self.coordinator.on_fault(worker, failure):
            return
        result.failures.append(failure)
        result.reason = f"worker failure: {failure.summary()}"
        self.events.write("group_failure", reason=result.reason)
        self.stop_all()

    def _on_signal(self, wake_r: int, result: AttemptResult) -> None:
        try:
            received = os.read(wake_r, 64)
        except BlockingIOError:
            return
        for sig in received:
            if result.signal is not None:
                for worker in self.live_workers():  # a second signal: no more waiting
                    worker.send_signal(signal.SIGKILL)
                continue
            result.signal = sig
            self.console.notice(f"ftrun: received {signal.Signals(sig).name}, stopping the workers")
            self.stop_all(sig)
