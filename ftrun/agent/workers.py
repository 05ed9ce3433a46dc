"""Worker processes: start one with torchrun's environment, watch it through a pidfd, stop it."""

from __future__ import annotations

import os
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

from ftrun.lines import LineBuffer
from ftrun.processes import die_with_parent


@dataclass
class WorkerSlot:
    """A worker's place in the launch: its stable id, local rank, initial global rank."""

    uid: int  # incarnation id, unique within an attempt: the worker's identity in generation plans
    worker_id: str  # node:uid, unique across nodes
    local_rank: int
    rank: int  # rank the process was started with (its console prefix); the plan may renumber it
    joiner: bool = False  # started to join later (a spare, or a replacement): placed by a plan, not at the start


@dataclass
class Worker:
    """One running worker process and the agent's ends of its pipes and control channel."""

    slot: WorkerSlot
    proc: subprocess.Popen
    pidfd: int
    channel: socket.socket
    error_file: Path
    started_at: float
    exitcode: int | None = None
    exited_at: float | None = None
    channel_lines: LineBuffer = field(default_factory=LineBuffer)
    abandoned: bool = False  # still there after SIGKILL and given up on: counted lost, no longer waited for

    @property
    def uid(self) -> int:
        """The worker's incarnation id."""
        return self.slot.uid

    @property
    def pid(self) -> int:
        """The worker's process id."""
        return self.proc.pid

    def reap(self) -> int:
        """Collect the exit status once the pidfd says the process ended; negative means killed by signal."""
        self.exitcode = self.proc.wait()
        self.exited_at = time.monotonic()
        return self.exitcode

    def close(self) -> None:
        """Release the agent's file descriptors for this worker (after it has been reaped)."""
        os.close(self.pidfd)
        self.channel.close()
        for pipe in (self.proc.stdout, self.proc.stderr):
            if pipe is not None:
                pipe.close()

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
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                pass


def spawn_worker(slot: WorkerSlot, command: list[str], env: dict[str, str], error_file: Path) -> Worker:
    """Start one worker in its own session with a control socket inherited as FTRUN_CHANNEL_FD."""
    agent_end, worker_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        error_file.parent.mkdir(parents=True, exist_ok=True)
    except OSError:
        pass  # a full disk: the worker cannot leave an error file, its failure is told from its stderr instead
    env = dict(env, FTRUN_CHANNEL_FD=str(worker_end.fileno()), TORCHELASTIC_ERROR_FILE=str(error_file))
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
    agent_end.setblocking(False)
    return Worker(
        slot=slot,
        proc=proc,
        pidfd=os.pidfd_open(proc.pid),
        channel=agent_end,
        error_file=error_file,
        started_at=time.monotonic(),
    )
