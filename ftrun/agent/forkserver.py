"""The agent's fork server: a process that imports torch once, so that workers started later start warm.

A worker started the usual way spends seconds importing torch and, at its first optimizer step,
torch._dynamo; a group restart or a respawned worker pays that again. The fork server (the process in
``fork_site/sitecustomize.py``) is started with the worker's own command line and environment (less the
per-worker variables), imports :data:`PRELOAD` as the script would, and then forks a worker per request.
The child finishes Python's start-up from where the server paused it and runs the script with that
command line's sys.argv, sys.path[0] and ``__main__``, so the script sees a worker started with
``python -u script.py args``; see the README, "How workers start", for what differs.

The agent talks to the server over a SOCK_SEQPACKET socket: one JSON message per request or answer, the
worker's descriptors passed along with a request and a pidfd of the forked child with its answer (SCM_RIGHTS). The server is the forked workers' parent and reaps them;
it writes each one's wait status to a pipe the agent gave with the request, which the agent's event loop
watches as it watches a spawned worker's pidfd. The server also forks the process that serves the job's store
(:meth:`ForkServer.fork_store`), so that the agent never imports torch.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import select
import socket
import struct
import subprocess
import sys
from pathlib import Path
from typing import Any

from ftrun import events
from ftrun.events import EventSink
from ftrun.processes import die_with_parent

PRELOAD = ("torch", "torch.distributed", "torch.nn.parallel", "torch._dynamo")
"""What the server imports: what a DDP script has imported by its first optimizer step (DDP's constructor
imports torch._dynamo, and with it sympy). After these, scripts/bench_workloads/plain_ddp.py imports only its
own modules on its way to its first step."""
WORKER_API = ("ftrun.worker.session", "ftrun.worker.data")
"""What the server imports as well for a script that imports ftrun: the worker API ``ftrun.init`` and
``ftrun.GlobalBatches`` import on first use, so that a forked worker neither reads nor runs them again."""
SITE_DIR = Path(__file__).resolve().parent / "fork_site"
"""The directory put first on the server's PYTHONPATH: it holds only the server's ``sitecustomize.py``."""
VARIABLE = "FTRUN_FORK_SERVER"
"""The server's setup, in its environment (sitecustomize.VARIABLE)."""
STATUS = struct.Struct("i")
"""A forked worker's wait status as the server writes it (sitecustomize.STATUS)."""
REPLY_TIMEOUT = 30.0
"""Seconds a fork request may take before the server is declared unusable (a fork takes milliseconds)."""
REAP_TIMEOUT = 10.0
"""Seconds the agent waits for the server to end once killed: one stuck in the kernel (uninterruptible sleep)
is left to end on its own rather than hold the agent."""
OUTPUT_PIPE_SIZE = 1 << 20
"""Room for what the imports print before the server reads it back (a full pipe would stall it)."""
STARTING, READY, UNUSABLE, GONE = "starting", "ready", "unusable", "gone"
"""The server's states, as the agent knows them."""


class ForkRefused(Exception):
    """The server did not fork this worker (the worker is started the usual way); ``gone``: nor will it again."""

    def __init__(self, reason: str, gone: bool) -> None:
        super().__init__(reason)
        self.gone = gone

    def notice(self, instead: str) -> str:
        """The line that says so, with what ftrun does ``instead`` (the server gone: what it does from now on)."""
        return f"ftrun: {self}; {'workers start as new processes from now on' if self.gone else instead}"


def can_serve(command: list[str]) -> bool:
    """Whether workers of this command line can come from a fork server: this Python running ``-u`` and a
    script, or --run-path's ``-c``. ``-m module`` and --no-python's program start as new processes, as
    torchrun starts them."""
    return len(command) >= 3 and command[0] == sys.executable and command[1] == "-u" and command[2] != "-m"


def preload_for(packages: frozenset[str]) -> tuple[str, ...]:
    """What the server imports for a script that imports ``packages`` (of torch and ftrun)."""
    return PRELOAD + WORKER_API if "ftrun" in packages else PRELOAD


class ForkServer:
    """One running fork server, from the agent's side: start it, learn when it is ready, ask it to fork."""

    def __init__(self, command: list[str], env: dict[str, str], log_path: Path, sink: EventSink, node: int,
                 preload: tuple[str, ...] = PRELOAD) -> None:
        """Start the server with the workers' ``command`` and their common ``env``; its own output goes to
        ``log_path``. Returns at once: the server imports in the background."""
        self.events, self.node, self.preload = sink, node, preload
        self.state, self.reason = STARTING, None
        self.torch: dict[str, Any] | None = None  # what the server's torch is: version, CUDA, NCCL (once ready)
        self.control, server_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        pipes = [os.pipe(), os.pipe()]
        for _, write_end in pipes:
            try:
                fcntl.fcntl(write_end, fcntl.F_SETPIPE_SZ, OUTPUT_PIPE_SIZE)
            except OSError:  # above /proc/sys/fs/pipe-max-size: the default room will do
                pass
        log_fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        setup = {"control": server_end.fileno(), "output": [read for read, _ in pipes], "log": log_fd,
                 "preload": list(preload), "pythonpath": env.get("PYTHONPATH")}
        path = [str(SITE_DIR), env["PYTHONPATH"]] if env.get("PYTHONPATH") else [str(SITE_DIR)]
        try:
            self.proc = subprocess.Popen(
                command, env={**env, "PYTHONPATH": os.pathsep.join(path), VARIABLE: json.dumps(setup)},
                stdin=subprocess.DEVNULL, stdout=pipes[0][1], stderr=pipes[1][1],
                pass_fds=(server_end.fileno(), log_fd, pipes[0][0], pipes[1][0]),
                start_new_session=True, preexec_fn=die_with_parent)
        finally:
            server_end.close()
            for fd in (log_fd, *pipes[0], *pipes[1]):
                os.close(fd)
        self.pid = self.proc.pid

    def ready(self, wait: float = 0.0, interrupt: int | None = None) -> bool:
        """Whether it forks workers now, waiting up to ``wait`` seconds for a server still importing (less if
        ``interrupt`` becomes readable first; it is not read)."""
        if self.state == STARTING:
            watched = [self.control] if interrupt is None else [self.control, interrupt]
            if self.control in select.select(watched, [], [], wait)[0]:
                self._read_state()
        return self.state == READY

    def fork(self, env: dict[str, str], channel_variable: str, fds: tuple[int, int, int, int]) -> tuple[int, int]:
        """Fork a worker with environment ``env`` (its channel's descriptor number set in ``channel_variable``)
        and the descriptors (stdout, stderr, channel, status pipe); its pid and a pidfd of it (the caller's to
        close). Raises :class:`ForkRefused`."""
        return self._request({"env": env, "cwd": os.getcwd(), "channel_variable": channel_variable}, fds)

    def fork_store(self, host: str, port: int, listen_fd: int) -> tuple[int, int]:
        """Fork the process that serves the job's TCPStore on the listening socket ``listen_fd`` (``host:port``),
        for as long as the agent lives: it ends when the write end of its lifeline pipe closes, which happens
        when the agent exits, however it exits. Returns its pid and that write end (the caller's to close).
        Raises :class:`ForkRefused`."""
        lifeline, held = os.pipe()
        try:
            pid, pidfd = self._request({"store": {"host": host, "port": port}}, (listen_fd, lifeline))
        except ForkRefused:
            os.close(held)
            raise
        finally:
            os.close(lifeline)
        os.close(pidfd)
        return pid, held

    def close(self) -> None:
        """Stop the server (its forked workers, if any are left, die with it) and collect it."""
        self.control.close()
        self._stop()

    # ------------------------------------------------------------------ internals
    def _request(self, payload: dict[str, Any], fds: tuple[int, ...]) -> tuple[int, int]:
        """Send one fork request with its descriptors; the child's pid and a pidfd of it."""
        request = json.dumps(payload).encode()
        self.control.settimeout(REPLY_TIMEOUT)
        try:
            socket.send_fds(self.control, [request], list(fds))
        except OSError as error:
            if error.errno == errno.EMSGSIZE:  # this request only: another worker's may fit
                raise ForkRefused(f"a request of {len(request)} bytes is too large for the fork server",
                                  gone=False) from None
            self._give_up(GONE, f"stopped taking requests: {error}")
            raise ForkRefused(f"the fork server {self.reason}", gone=True) from None
        try:
            reply, pidfds = self._receive()
        except OSError as error:  # TimeoutError, or the server ended
            self._give_up(GONE, f"did not answer a request: {error}")
            raise ForkRefused(f"the fork server {self.reason}", gone=True) from None
        if "pid" not in reply or len(pidfds) != 1:
            for fd in pidfds:
                os.close(fd)
            raise ForkRefused(f"the fork server could not fork: {reply.get('error')}", gone=False)
        return int(reply["pid"]), pidfds[0]

    def _receive(self) -> tuple[dict[str, Any], list[int]]:
        """The server's next message and the descriptors it carries; OSError (ConnectionError at EOF) when there
        is none to come."""
        data, fds, _, _ = socket.recv_fds(self.control, 65536, 1)
        if not data:
            for fd in fds:
                os.close(fd)
            raise ConnectionResetError("the fork server ended")
        return json.loads(data), fds

    def _read_state(self) -> None:
        """Take the server's first message (ready, or why not; it has come), or learn that the server ended
        before sending one."""
        try:
            message, _ = self._receive()  # carries no descriptor
        except ConnectionError:
            self._give_up(UNUSABLE, f"ended while importing (exit {self._stop()}; see its log)")
            return
        if message.get("ready"):
            self.state, self.torch = READY, message.get("torch")
            self.events.write(events.FORK_SERVER, pid=self.pid, state=READY, reason=None, node=self.node,
                           seconds=message.get("seconds"), modules=message.get("modules"),
                           preloaded=list(self.preload))
        else:
            self._give_up(UNUSABLE, message.get("reason") or "no reason given")

    def _give_up(self, state: str, reason: str) -> None:
        """Stop using the server: record why once, and stop it."""
        if self.state in (UNUSABLE, GONE):
            return
        self.state, self.reason = state, reason
        self.events.write(events.FORK_SERVER, pid=self.pid, state=state, reason=reason, node=self.node)
        self._stop()

    def _stop(self) -> int | None:
        """Kill the server if it still runs, and collect it: its exit code, or None if it did not end within
        :data:`REAP_TIMEOUT`."""
        if self.proc.poll() is None:
            self.proc.kill()
        try:
            return self.proc.wait(timeout=REAP_TIMEOUT)
        except subprocess.TimeoutExpired:
            return None
