"""What went wrong with a worker: exit code or signal, and its traceback from the error file or stderr."""

from __future__ import annotations

import json
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from ftrun.processes import signal_name


@dataclass(frozen=True)
class WorkerFailure:
    """One worker that ended badly; ``exitcode`` < 0 means killed by signal ``-exitcode``."""

    rank: int
    local_rank: int
    pid: int
    exitcode: int
    when: float  # wall-clock time (time.time()) the agent saw it end
    message: str
    traceback: str

    @property
    def how(self) -> str:
        """``exit code 1`` or ``signal SIGKILL``."""
        if self.exitcode < 0:
            name = signal_name(-self.exitcode)
            return name if name.startswith("signal ") else f"signal {name}"
        return f"exit code {self.exitcode}"

    def summary(self) -> str:
        """One line naming the worker and how it ended."""
        return f"rank {self.rank} (local rank {self.local_rank}, pid {self.pid}) ended with {self.how}"


@dataclass
class AttemptResult:
    """How one attempt (one start of the worker group) ended."""

    succeeded: bool = False
    signal: int | None = None
    failures: list[WorkerFailure] = field(default_factory=list)
    reason: str = ""
    abandoned: dict[int, str] = field(default_factory=dict)  # uid -> the worker that would not die, in words

    def why_no_restart(self) -> str | None:
        """Why the group must not restart after this attempt, or None: a worker that would not die may
        still hold its GPU and its files."""
        if not self.abandoned:
            return None
        return f"{next(iter(self.abandoned.values()))}, and a new group would run beside it"


def traceback_from_error_file(path: Path) -> tuple[str, str] | None:
    """Read torch's ``@record`` error file: (message, traceback), or None when absent or unreadable."""
    try:
        data = json.loads(path.read_text())
        message = data["message"]
        if isinstance(message, str):
            return message, ""
        return message.get("message", ""), message.get("extraInfo", {}).get("py_callstack", "")
    except (OSError, ValueError, KeyError, AttributeError, TypeError):
        return None


def traceback_from_stderr(lines: Iterable[str]) -> tuple[str, str]:
    """The last Python traceback in a worker's stderr tail: (last line, traceback text)."""
    lines = list(lines)
    starts = [i for i, line in enumerate(lines) if "Traceback (most recent call last)" in line]
    if not starts:
        return "", ""
    block = lines[starts[-1] :]
    message = next((line.strip() for line in reversed(block) if line.strip()), "")
    return message, "\n".join(block)


def describe_failure(
    rank: int, local_rank: int, pid: int, exitcode: int, error_file: Path, stderr_tail: Iterable[str]
) -> WorkerFailure:
    """Build the :class:`WorkerFailure` for a worker: error file first, then the tail of its stderr."""
    found = traceback_from_error_file(error_file) or traceback_from_stderr(stderr_tail)
    message, tb = found
    if not message and exitcode < 0:
        message = f"killed by {WorkerFailure(rank, local_rank, pid, exitcode, 0, '', '').how}"
    return WorkerFailure(rank, local_rank, pid, exitcode, time.time(), message, tb)


def format_report(script: str, reason: str, failures: list[WorkerFailure]) -> str:
    """The final report: why, then the root cause (first failure) with its traceback, then the others."""
    if not failures:
        return f"ftrun: {script} failed: {reason}"
    root, *others = sorted(failures, key=lambda f: f.when)
    lines = [
        f"ftrun: {script} failed",
        f"root cause (first failure): {root.summary()}",
        f"  at {time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(root.when))}",
    ]
    if root.message:
        lines.append(f"  error: {root.message}")
    if root.traceback:
        lines += ["  " + line for line in root.traceback.rstrip().splitlines()]
    for other in others:
        lines.append(f"also: {other.summary()}")
    return "\n".join(lines)
