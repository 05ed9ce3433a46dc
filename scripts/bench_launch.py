"""Compare ftrun's launch and group-restart latency with torchrun's, 4 CPU workers on this node.

Both launchers run scripts/bench_workloads/plain_ddp.py (stock DDP, no ftrun API: neither launcher can
recover it in place, so both restart the whole group) with the same flags, ``--standalone
--nproc-per-node 4 --max-restarts 1``, alternating, ``--repeats`` runs each. In every run the worker
of RANK 1 prints ``fail ...`` and exits with code 1 before step ``--fail-at`` of attempt 0 only
(TORCHELASTIC_RESTART_COUNT == 0). Per run:

* time to first step: from just before the launcher process is started to the arrival of the first
  ``step=... attempt=0`` line;
* group-restart latency: from the arrival of the ``fail`` line to the arrival of the first
  ``step=... attempt=1`` line (the launcher notices the exit, stops the other workers, starts and
  rendezvouses new ones, which import torch, form the Gloo group and run a step).

The launchers' output (stdout and stderr together) is read line by line as it arrives, each line
stamped with time.perf_counter() on arrival; a run is stopped (SIGTERM to the launcher, then SIGKILL
to any of its descendants left) as soon as its measurement is taken. Medians, ranges and the
ftrun/torchrun ratio are printed.
"""

from __future__ import annotations

import argparse
import os
import queue
import re
import shlex
import statistics
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
PLAIN = ROOT / "scripts" / "bench_workloads" / "plain_ddp.py"
LAUNCHERS = {
    "torchrun": [sys.executable, "-m", "torch.distributed.run"],
    "ftrun": [sys.executable, "-m", "ftrun"],
}
LAUNCH_FLAGS = ["--standalone", "--nproc-per-node", "4"]
FIRST_ATTEMPT = re.compile(r"\bstep=\d+ attempt=0\b")
RESTARTED = re.compile(r"\bstep=\d+ attempt=[1-9]")
FAIL = re.compile(r"\bfail attempt=0\b")
METRICS = {"first_step": "time to first step (launcher start ->)", "restart": "group restart: failure -> first step"}


def parse_args() -> argparse.Namespace:
    """The benchmark's flags."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5, help="Runs per launcher and measurement (default 5).")
    parser.add_argument("--fail-at", type=int, default=5, help="Step before which RANK 1 fails (default 5).")
    parser.add_argument("--timeout", type=float, default=120.0,
                        help="Seconds one run may take before the benchmark gives up (default 120).")
    return parser.parse_args()


@dataclass
class Run:
    """One launcher process, its output arriving as (perf_counter stamp, line) on a queue."""

    proc: subprocess.Popen[str]
    started: float
    lines: queue.Queue[tuple[float, str | None]] = field(default_factory=queue.Queue)
    tail: deque[str] = field(default_factory=lambda: deque(maxlen=30))


def start(command: list[str]) -> Run:
    """Start ``command`` and a thread that stamps each of its output lines as it arrives."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("FTRUN_", "TORCHELASTIC_"))}
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


def first_match(run: Run, pattern: re.Pattern[str], timeout: float) -> float:
    """The arrival stamp of the run's next output line that matches ``pattern``."""
    for stamp, line in lines(run, timeout):
        if pattern.search(line):
            return stamp
    raise RuntimeError(f"the launcher ended (exit {run.proc.wait()}) before the measurement; last output:\n"
                       + "\n".join(run.tail))


def group_restart(launcher: str, fail_at: int, timeout: float) -> tuple[float, float]:
    """Run plain_ddp.py with a planted failure: (time to its first step, failure-to-first-step-of-attempt-1)."""
    run = start([*LAUNCHERS[launcher], *LAUNCH_FLAGS, "--max-restarts", "1", str(PLAIN), "--steps", "100000",
                 "--fail-at", str(fail_at)])
    try:
        first_step = first_match(run, FIRST_ATTEMPT, timeout) - run.started
        failed = first_match(run, FAIL, timeout)
        return first_step, first_match(run, RESTARTED, timeout) - failed
    finally:
        stop(run)


def measure(repeats: int, fail_at: int, timeout: float) -> dict[str, dict[str, list[float]]]:
    """Both measurements, per metric and launcher, alternating the launchers run by run."""
    results: dict[str, dict[str, list[float]]] = {metric: {name: [] for name in LAUNCHERS} for metric in METRICS}
    for repeat in range(repeats):
        for launcher in LAUNCHERS:
            first, restart = group_restart(launcher, fail_at, timeout)
            results["first_step"][launcher].append(first)
            results["restart"][launcher].append(restart)
            print(f"  run {repeat + 1}/{repeats} {launcher:8s} first step {first:6.2f} s, "
                  f"group restart {restart:6.2f} s", flush=True)
    return results


def cell(values: list[float]) -> str:
    """``median [min-max]``."""
    return f"{statistics.median(values):.2f} [{min(values):.2f}-{max(values):.2f}]"


def report(results: dict[str, dict[str, list[float]]]) -> None:
    """Print the table of medians and ratios, and the command line that produced it."""
    print(f"\n{'seconds: median [min-max]':40s} {'torchrun':>20s} {'ftrun':>20s} {'ftrun/torchrun':>15s}")
    for metric, label in METRICS.items():
        torch_values, ft_values = results[metric]["torchrun"], results[metric]["ftrun"]
        ratio = statistics.median(ft_values) / statistics.median(torch_values)
        print(f"{label:40s} {cell(torch_values):>20s} {cell(ft_values):>20s} {ratio:15.2f}")
    print(f"\ncommand: python {shlex.join(sys.argv)}")


def main() -> None:
    args = parse_args()
    print(f"4 workers, launchers alternating, {args.repeats} runs each "
          f"({os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f})", flush=True)
    report(measure(args.repeats, args.fail_at, args.timeout))


if __name__ == "__main__":
    main()
