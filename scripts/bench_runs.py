"""Running a launcher as a subprocess for the benchmarks and reading its output as it arrives.

``start`` runs a command from the repository root (without any FTRUN_* or TORCHELASTIC_* variables of
this process) and stamps each of its output lines (stdout and stderr together) with time.perf_counter()
on arrival; ``lines`` yields them with a deadline; ``stop`` ends the launcher and whatever it started.
``worker_with_rank`` finds a launcher's worker by its rank; ``machine`` and ``command_line`` describe
where and how a benchmark ran, for its printed report.
"""

from __future__ import annotations

import json
import os
import queue
import shlex
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from ftrun import registry  # noqa: E402  (torch-free)


@dataclass
class Run:
    """One launcher process, its output arriving as (perf_counter stamp, line) on a queue (line None once closed)."""

    proc: subprocess.Popen[str]
    started: float
    lines: queue.Queue[tuple[float, str | None]] = field(default_factory=queue.Queue)
    tail: deque[str] = field(default_factory=lambda: deque(maxlen=30))


def start(command: list[str], extra_env: dict[str, str] | None = None) -> Run:
    """Start ``command`` in the repository root (with ``extra_env`` added to a clean environment) and a thread
    that stamps each of its output lines as it arrives."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("FTRUN_", "TORCHELASTIC_"))}
    env.update(extra_env or {})
    started = time.perf_counter()
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1,
                            env=env, cwd=ROOT)
    run = Run(proc, started)

    def read() -> None:
        for line in proc.stdout:
            run.lines.put((time.perf_counter(), line.rstrip("\n")))
        run.lines.put((time.perf_counter(), None))

    threading.Thread(target=read, daemon=True).start()
    return run


def lines(run: Run, timeout: float) -> Iterator[tuple[float, str]]:
    """The run's output lines with their arrival stamps until it closes its output; raises after ``timeout``."""
    deadline = run.started + timeout
    while True:
        try:
            stamp, line = run.lines.get(timeout=max(0.0, deadline - time.perf_counter()))
        except queue.Empty:
            raise RuntimeError(f"no result within {timeout:.0f} s; last output:\n" + "\n".join(run.tail)) from None
        if line is None:
            return
        run.tail.append(line)
        yield stamp, line


def ended(run: Run) -> RuntimeError:
    """The error for a launcher that ended before its measurement was taken."""
    return RuntimeError(f"the launcher ended (exit {run.proc.wait()}) before the measurement; last output:\n"
                        + "\n".join(run.tail))


def stop(run: Run) -> None:
    """SIGTERM the launcher (it stops its workers); SIGKILL it and any descendant still alive after 15 s."""
    try:
        family = psutil.Process(run.proc.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        family = []
    run.proc.terminate()
    try:
        run.proc.wait(timeout=15)
    except subprocess.TimeoutExpired:
        run.proc.kill()
        run.proc.wait()
    _, alive = psutil.wait_procs(family, timeout=5)
    for process in alive:
        process.kill()


def worker_with_rank(launcher_pid: int, rank: int, script: str) -> psutil.Process:
    """The launcher's live worker running ``script`` (a file name) as RANK ``rank``.

    torchrun's workers show RANK in /proc/<pid>/environ. A worker that ftrun's fork server forked shows the
    environment its process started with there, the server's: ftrun's workers are found in its event log.
    """
    run_dir = ftrun_run_dir(launcher_pid)
    if run_dir is not None:
        events = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines() if line]
        for event in reversed(events):
            if event["event"] == "worker_start" and event["rank"] == rank and psutil.pid_exists(event["pid"]):
                return psutil.Process(event["pid"])
    else:
        for process in psutil.Process(launcher_pid).children(recursive=True):
            try:
                if process.environ().get("RANK") == str(rank) and script in " ".join(process.cmdline()):
                    return process
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                continue
    raise RuntimeError(f"no worker with RANK={rank} found")


def ftrun_run_dir(launcher_pid: int) -> Path | None:
    """The run directory of the ftrun job that process ``launcher_pid`` launched (None: not an ftrun job)."""
    return next((Path(e.run_dir) for e in registry.running() if e.pid == launcher_pid), None)


def machine() -> str:
    """This machine's CPU count and 1-minute load average, e.g. ``2 CPUs, load average 1.7``."""
    return f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}"


def command_line() -> str:
    """The command line that ran this benchmark, as ``command: python ...``."""
    return f"command: python {shlex.join(sys.argv)}"
