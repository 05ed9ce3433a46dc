"""Worker processes: start one with torchrun's environment (a new process, or forked by the fork server),
watch it end, stop it."""

from __future__ import annotations

import os
import select
import signal
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO

from ftrun.agent.forkserver import STATUS, ForkRefused, ForkServer
from ftrun.lines import LineBuffer
from ftrun.processes import die_with_parent

CHANNEL_VARIABLE = "FTRUN_CHANNEL_FD"
"""The worker's variable that holds its control socket's descriptor number."""
ORPHAN_WAIT = 5.0
"""Seconds to wait for a forked worker to die after its fork server ended without reporting it."""


@dataclass
class WorkerSlot:
    """A worker's place in the launch: its stable id, local rank, initial global rank."""

    uid: int  # incarnation id, unique within an attempt: the worker's identity in generation plans
    worker_id: str  # node:uid, unique across nodes
    local_rank: int
    rank: int  # rank the process was started with (its console prefix); the plan may renumber it
    joiner: bool = False  # started to join later (a spare, or a replacement): placed by a plan, not at the start


class OwnExit:
    """How the agent learns that a worker it started itself ended: its pidfd, then the wait status."""

    def __init__(self, proc: subprocess.Popen, pidfd: int) -> None:
        self.proc, self.fd = proc, pidfd

    def collect(self) -> int:
        """The exit code (negative: killed by that signal), once ``fd`` is readable."""
        return self.proc.wait()

    def close(self) -> None:
        """Nothing of its own to release (the pidfd is the worker's)."""


class ReportedExit:
    """How the agent learns that a worker the fork server forked ended: the server, its parent, reaps it and
    writes its wait status to this pipe, which becomes readable as a spawned worker's pidfd does."""

    def __init__(self, pipe: int, pidfd: int) -> None:
        self.fd, self.pidfd = pipe, pidfd

    def collect(self) -> int:
        """The exit code (negative: killed by that signal), once ``fd`` is readable."""
        data = os.read(self.fd, STATUS.size)
        if len(data) == STATUS.size:
            return os.waitstatus_to_exitcode(STATUS.unpack(data)[0])
        # The server ended without a word: PR_SET_PDEATHSIG kills its children; make sure, and wait for it.
        try:
            signal.pidfd_send_signal(self.pidfd, signal.SIGKILL)
        except ProcessLookupError:
            pass
        select.select([self.pidfd], [], [], ORPHAN_WAIT)
        return -signal.SIGKILL

    def close(self) -> None:
        """Close the status pipe."""
        os.close(self.fd)


@dataclass
class Worker:
    """One running worker process and the agent's ends of its pipes, control channel and exit status."""

    slot: WorkerSlot
    pid: int
    pidfd: int
    stdout: BinaryIO
    stderr: BinaryIO
    channel: socket.socket
    error_file: Path
    started_at: float
    exit: OwnExit | ReportedExit
    exitcode: int | None = None
    exited_at: float | None = None
    channel_lines: LineBuffer = field(default_factory=LineBuffer)
    abandoned: bool = False  # still there after SIGKILL and given up on: counted lost, no longer waited for

    @property
    def uid(self) -> int:
        """The worker's incarnation id."""
        return self.slot.uid

    @property
    def forked(self) -> bool:
        """Whether the fork server started it (else the agent did, as a new process)."""
        return isinstance(self.exit, ReportedExit)

    def reap(self) -> int:
        """Collect the exit status once ``exit.fd`` says the process ended; negative means killed by signal."""
        self.exitcode = self.exit.collect()
        self.exited_at = time.monotonic()
        return self.exitcode

    def close(self) -> None:
        """Release the agent's file descriptors for this worker (after it has been reaped)."""
        os.close(self.pidfd)
        self.exit.close()
        self.channel.close()
        self.stdout.close()
        self.stderr.close()

    def send(self, data: bytes) -> None:
        """Write control messages to the worker; one that is ending is left alone (its exit comes anyway)."""
        try:
            self.channel.sendall(data)
        except OSError:
            pass

    def send_signal(self, sig: int) -> None:
        """Signal the worker's whole process group (its own children included); ignore a finished one."""
        if self.exitcode is None:
            try:
                os.killpg(self.pid, sig)
            except ProcessLookupError:
                pass


def spawn_worker(slot: WorkerSlot, command: list[str], env: dict[str, str], error_file: Path) -> Worker:
    """Start one worker as a new process in its own session, a control socket inherited as FTRUN_CHANNEL_FD."""
    agent_end, worker_end = _channel(error_file)
    env = dict(env, TORCHELASTIC_ERROR_FILE=str(error_file), **{CHANNEL_VARIABLE: str(worker_end.fileno())})
    proc = subprocess.Popen(
        command,
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        pass_fds=(worker_end.fileno(),),
        start_new_session=True,
        preexec_fn=die_with_parent,
    )
    worker_end.close()
    pidfd = os.pidfd_open(proc.pid)
    return Worker(slot=slot, pid=proc.pid, pidfd=pidfd, stdout=proc.stdout, stderr=proc.stderr, channel=agent_end,
                  error_file=error_file, started_at=time.monotonic(), exit=OwnExit(proc, pidfd))


def fork_worker(server: ForkServer, slot: WorkerSlot, env: dict[str, str], error_file: Path) -> Worker:
    """Have the fork server fork one worker, set up as :func:`spawn_worker` sets up a new process (its own
    session, stdin from /dev/null, its output on pipes, the control socket as FTRUN_CHANNEL_FD, dying with
    the agent). Raises :class:`ForkRefused` (nothing is left running then)."""
    agent_end, worker_end = _channel(error_file)
    pipes = [os.pipe(), os.pipe(), os.pipe()]  # stdout, stderr, exit status
    (out_r, out_w), (err_r, err_w), (status_r, status_w) = pipes
    env = dict(env, TORCHELASTIC_ERROR_FILE=str(error_file))
    try:
        pid, pidfd = server.fork(env, CHANNEL_VARIABLE, (out_w, err_w, worker_end.fileno(), status_w))
    except ForkRefused:
        agent_end.close()
        for fd in (out_r, err_r, status_r):
            os.close(fd)
        raise
    finally:  # the server has its own copies now
        worker_end.close()
        for fd in (out_w, err_w, status_w):
            os.close(fd)
    return Worker(slot=slot, pid=pid, pidfd=pidfd, stdout=open(out_r, "rb"), stderr=open(err_r, "rb"),
                  channel=agent_end, error_file=error_file, started_at=time.monotonic(),
                  exit=ReportedExit(status_r, pidfd))


def _channel(error_file: Path) -> tuple[socket.socket, socket.socket]:
    """A new worker's control socket pair (the agent's end non-blocking); its error file's directory made."""
    agent_end, worker_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    agent_end.setblocking(False)
    try:
        error_file.parent.mkdir(parents=True, exist_ok=True)
    except OSError:
        pass  # a full disk: the worker cannot leave an error file, its failure is told from its stderr instead
    return agent_end, worker_end
