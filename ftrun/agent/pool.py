"""This node's workers of one attempt: starting them with their environment, their pipes, channels and exits."""

from __future__ import annotations

import json
import os
import selectors
from pathlib import Path
from typing import Any

from ftrun import events
from ftrun.agent.env import launch_env, worker_env
from ftrun.agent.forkserver import STARTING, UNUSABLE, ForkRefused, ForkServer, can_serve, preload_for
from ftrun.agent.output import LogFiles, WorkerOutput, render_prefix
from ftrun.agent.script_imports import script_imports
from ftrun.agent.workers import Worker, WorkerSlot, fork_worker, spawn_worker
from ftrun.config import Endpoint, LaunchConfig
from ftrun.console import STDERR, STDOUT, Console
from ftrun.events import EventSink
from ftrun.protocol import UID_STRIDE, worker_message_problem

OUTPUT, CHANNEL, EXIT = "output", "channel", "exit"
"""The tags of a worker's registrations in the agent's selector: ``(tag, (uid, stream))`` / ``(tag, uid)``."""


class WorkerPool:
    """Starts this node's workers and owns their processes, output, control channels and selector entries.

    Worker uids of node ``n`` are numbered from ``n * UID_STRIDE`` in each attempt, in start order.
    """

    def __init__(self, config: LaunchConfig, selector: selectors.BaseSelector, console: Console, events: EventSink,
                 run_dir: Path) -> None:
        self.config = config
        self.selector = selector
        self.console = console
        self.events = events
        self.run_dir = run_dir
        self.workers: dict[int, Worker] = {}
        self.outputs: dict[int, WorkerOutput] = {}
        self.attempt = 0
        self.sizes = config.sizes
        self.rescue_from: Path | None = None
        self.first_uid = config.node_rank * UID_STRIDE
        self.next_uid = self.first_uid
        self.dropped = 0
        """Lines on the workers' control channels that were not a message the agent knows (and ignored)."""
        self.log_files = LogFiles(console, events, run_dir)
        self.fork_server: ForkServer | None = None
        self.rendezvous: Endpoint | None = None
        """Where this attempt's workers' process groups rendezvous (MASTER_ADDR, MASTER_PORT): a restarted
        attempt's own store; None: the configuration's (the job's store, or node 0's)."""

    # ------------------------------------------------------------ the ports' side
    def get(self, uid: int) -> Worker | None:
        """This node's worker ``uid`` of the current attempt (ended or not), or None."""
        return self.workers.get(uid)

    def all(self) -> list[Worker]:
        """This node's workers of the current attempt, ended ones included, in start order."""
        return list(self.workers.values())

    def live(self) -> list[Worker]:
        """This node's workers that have not ended (those given up on as unkillable left out)."""
        return [w for w in self.workers.values() if w.exitcode is None and not w.abandoned]

    def abandon(self, uid: int) -> None:
        """Give up on worker ``uid``, which will not die: it no longer counts as live."""
        self.workers[uid].abandoned = True

    # ------------------------------------------------------------ attempts
    def new_attempt(self, attempt: int, sizes: tuple[int, ...], rescue_from: Path | None) -> None:
        """Forget the workers of the previous attempt (all closed); ``sizes``: training workers per node;
        ``rescue_from``: the rescue directory the new workers start from, if any."""
        self.workers.clear()
        self.attempt = attempt
        self.sizes = sizes
        self.rescue_from = rescue_from
        self.next_uid = self.first_uid

    def start(self, local_rank: int, rank: int | None, respawn_of: WorkerSlot | None = None) -> Worker:
        """Start one worker on ``local_rank``; ``rank`` None makes it a joiner (a spare, or a replacement)."""
        config = self.config
        uid = self.next_uid
        self.next_uid += 1
        joiner = rank is None
        shown_rank = respawn_of.rank if respawn_of else (uid if joiner else rank)
        slot = WorkerSlot(uid=uid, worker_id=f"{config.node_rank}:{uid}", local_rank=local_rank, rank=shown_rank,
                          joiner=joiner)
        first = uid - self.first_uid == local_rank
        attempt_dir = self.run_dir / f"attempt_{self.attempt}" / (str(local_rank) if first
                                                                  else f"{local_rank}.{uid - self.first_uid}")
        env = worker_env(config, rank=shown_rank, local_rank=local_rank, uid=uid, restart_count=self.attempt,
                         store=self.rendezvous or Endpoint(config.master_addr, config.store.port),
                         run_dir=str(self.run_dir), joiner=joiner,
                         node_sizes=self.sizes, rescue_from=self.rescue_from)
        worker = self._start_process(slot, env, attempt_dir / "error.json")
        prefix = render_prefix(config.log_line_prefix_template, config.role, shown_rank, local_rank, config.node_name)
        if joiner and respawn_of is None:
            prefix = f"[spare{uid}]: "
        console_mask = 0 if (config.local_ranks_filter is not None and local_rank not in config.local_ranks_filter) else 3
        console_mask &= ~config.redirects.get(local_rank, 0)
        self.workers[uid] = worker
        self.outputs[uid] = WorkerOutput(self.console, prefix, shown_rank, console_mask,
                                         attempt_dir if config.log_dir else None, self.log_files)
        for stream, pipe in ((STDOUT, worker.stdout), (STDERR, worker.stderr)):
            os.set_blocking(pipe.fileno(), False)
            self.selector.register(pipe, selectors.EVENT_READ, (OUTPUT, (uid, stream)))
        self.selector.register(worker.exit.fd, selectors.EVENT_READ, (EXIT, uid))
        self.selector.register(worker.channel, selectors.EVENT_READ, (CHANNEL, uid))
        self.events.write(events.WORKER_START, uid=uid, rank=shown_rank, local_rank=local_rank, pid=worker.pid,
                          joiner=joiner, attempt=self.attempt, node=config.node_rank, forked=worker.forked)
        return worker

    def _start_process(self, slot: WorkerSlot, env: dict[str, str], error_file: Path) -> Worker:
        """Fork the worker from the fork server when it is ready; otherwise start it as a new process."""
        server = self.fork_server
        if server is not None and server.ready():
            try:
                return fork_worker(server, slot, env, error_file)
            except ForkRefused as refused:
                if refused.gone:  # a refusal of this worker alone is not worth a line
                    self.console.notice(refused.notice("this worker starts as a new process"), style="yellow")
        return spawn_worker(slot, self.config.command, env, error_file)

    # ------------------------------------------------------------ the fork server
    def start_fork_server(self) -> bool:
        """Start this node's fork server where it helps (a Python script that imports torch, and no
        --no-fork-server); whether one was started. It imports in the background."""
        config = self.config
        packages = script_imports(config.script) if config.fork_server and can_serve(config.command) else frozenset()
        if not packages:
            return False
        try:
            self.fork_server = ForkServer(config.command, launch_env(config), self.run_dir / "fork_server.log",
                                          self.events, config.node_rank, preload_for(packages))
        except OSError as error:
            self.console.notice(f"ftrun: no fork server ({error}); workers start as new processes", style="yellow")
            return False
        return True

    def await_fork_server(self, timeout: float, interrupt: int | None) -> None:
        """Wait up to ``timeout`` seconds for a fork server still importing, or until ``interrupt`` is
        readable (a signal came); the wait is shown as progress, a server found unusable in one line."""
        server = self.fork_server
        if server is not None and server.state == STARTING:
            self.console.progress(f"importing torch once for every worker (fork server): up to {timeout:.0f} s")
            server.ready(wait=timeout, interrupt=interrupt)
            self.console.progress(None)
            if server.state == UNUSABLE:
                self.console.notice(f"ftrun: fork server unusable: {server.reason}; workers start as new "
                                    f"processes (its log: {self.run_dir / 'fork_server.log'})", style="yellow")

    def stop_fork_server(self) -> None:
        """Stop the fork server (at the end of the run: no worker of this node is left)."""
        if self.fork_server is not None:
            self.fork_server.close()
            self.fork_server = None

    # ------------------------------------------------------------ what the selector reports
    def read_output(self, pipe: Any, uid: int, stream: int) -> bool:
        """Move one chunk of a worker's pipe to its output; False when nothing more is ready, or at EOF."""
        if pipe not in self.selector.get_map():  # drained to EOF by reap() earlier in the same select batch
            return False
        try:
            data = os.read(pipe.fileno(), 65536)
        except BlockingIOError:
            return False
        self.outputs[uid].feed(stream, data)
        if not data:
            self.selector.unregister(pipe)
        return bool(data)

    def read_channel(self, uid: int) -> list[dict[str, Any]]:
        """The control messages a worker sent (complete lines); a closed channel is unregistered."""
        worker = self.workers[uid]
        try:
            data = worker.channel.recv(65536)
        except (BlockingIOError, InterruptedError):
            return []
        except OSError:
            data = b""
        if not data:
            self.selector.unregister(worker.channel)
            return []
        messages = []
        for line in filter(None, worker.channel_lines.feed(data)):
            try:
                message = json.loads(line)
            except (ValueError, RecursionError):
                message = line
            if worker_message_problem(message) is None:
                messages.append(message)
            else:
                self.dropped += 1  # the worker's own program wrote on the channel, or another ftrun version
        return messages

    def reap(self, uid: int) -> int:
        """A worker's exit descriptor said it ended: collect its exit code, read what it left in its pipes, record it."""
        worker = self.workers[uid]
        self.selector.unregister(worker.exit.fd)
        code = worker.reap()
        self._drain(uid)
        self.events.write(events.WORKER_EXIT, uid=uid, rank=worker.slot.rank, pid=worker.pid, exitcode=code,
                          node=self.config.node_rank)
        return code

    def stderr_tail(self, uid: int) -> list[str]:
        """The last lines worker ``uid`` wrote to stderr."""
        return list(self.outputs[uid].stderr_tail)

    def close_all(self) -> None:
        """After the attempt: read what every worker left, close its output and release its descriptors."""
        for uid, worker in list(self.workers.items()):
            self._drain(uid)
            self.outputs.pop(uid).close()
            for obj in (worker.stdout, worker.stderr, worker.exit.fd, worker.channel):
                try:
                    self.selector.unregister(obj)
                except (KeyError, ValueError):
                    pass
            worker.close()

    def _drain(self, uid: int) -> None:
        """Read what an ended worker left in its pipes, so its last words reach the log and the report."""
        worker = self.workers[uid]
        for stream, pipe in ((STDOUT, worker.stdout), (STDERR, worker.stderr)):
            while self.read_output(pipe, uid, stream):
                pass

