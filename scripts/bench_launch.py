"""Compare ftrun's launch and group-restart latency with torchrun's, 4 CPU workers on this node.

Three launchers run scripts/bench_workloads/plain_ddp.py (stock DDP, no ftrun API: none can recover it in
place, so each restarts the whole group) with the same flags, ``--standalone --nproc-per-node 4
--max-restarts 1``, in turn, ``--repeats`` runs each: torchrun; ftrun as it starts by default, its workers
forked from the fork server (a process that imported torch once); and ftrun with ``--no-fork-server``, its
workers new processes as torchrun's are. In every run the worker of RANK 1 prints ``fail ...`` and exits
with code 1 before step ``--fail-at`` of attempt 0 only (TORCHELASTIC_RESTART_COUNT == 0). Per run:

* time to first step: from just before the launcher process is started to the arrival of the first
  ``step=... attempt=0`` line;
* group-restart latency: from the arrival of the ``fail`` line to the arrival of the first
  ``step=... attempt=1`` line (the launcher notices the exit, stops the other workers, starts and
  rendezvouses new ones, which import torch (or are forked, having it), form the Gloo group and run a step).

Respawn (ftrun only: torchrun has no replacement for one worker), with and without the fork server:
scripts/bench_workloads/train_ckpt.py (the worker API) under ``--respawn``; when its output shows step
``--fail-at``, the worker of RANK 1 is found (bench_runs.worker_with_rank) and killed with SIGKILL. The
survivors recover in place with 3 workers while ftrun starts a replacement, which joins them:

* respawn latency: from just before the kill to the arrival of ftrun's ``recovered ... world N -> 4``
  line (printed once the generation with the replacement has committed its first step).

The launchers' output (stdout and stderr together) is read line by line as it arrives, each line
stamped with time.perf_counter() on arrival; a run is stopped (SIGTERM to the launcher, then SIGKILL
to any of its descendants left) as soon as its measurement is taken. Medians, ranges and each ftrun
variant's ratio to torchrun are printed.
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import statistics
import sys
import time
from pathlib import Path

from bench_runs import Run, command_line, ended, lines, machine, start, stop, worker_with_rank

ROOT = Path(__file__).resolve().parents[1]
PLAIN = ROOT / "scripts" / "bench_workloads" / "plain_ddp.py"
TRAIN = ROOT / "scripts" / "bench_workloads" / "train_ckpt.py"
BASELINE = "torchrun"
LAUNCHERS = {
    BASELINE: [sys.executable, "-m", "torch.distributed.run"],
    "ftrun": [sys.executable, "-m", "ftrun"],
    "ftrun --no-fork-server": [sys.executable, "-m", "ftrun", "--no-fork-server"],
}
LAUNCH_FLAGS = ["--standalone", "--nproc-per-node", "4"]
FIRST_ATTEMPT = re.compile(r"\bstep=\d+ attempt=0\b")
RESTARTED = re.compile(r"\bstep=\d+ attempt=[1-9]")
FAIL = re.compile(r"\bfail attempt=0\b")
TRAIN_STEP = re.compile(r"\bstep=(\d+) loss=\S+ t=\S+ world=4 ")
BACK_TO_4 = re.compile(r"^ftrun: recovered from .* world \d+ -> 4\b")
METRICS = {"first_step": "time to first step (launcher start ->)", "restart": "group restart: failure -> first step",
           "respawn": "--respawn: SIGKILL -> world of 4 again"}


def parse_args() -> argparse.Namespace:
    """The benchmark's flags."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5, help="Runs per launcher and measurement (default 5).")
    parser.add_argument("--fail-at", type=int, default=5, help="Step before which RANK 1 fails (default 5).")
    parser.add_argument("--timeout", type=float, default=120.0,
                        help="Seconds one run may take before the benchmark gives up (default 120).")
    return parser.parse_args()


def first_match(run: Run, pattern: re.Pattern[str], timeout: float) -> float:
    """The arrival stamp of the run's next output line that matches ``pattern``."""
    for stamp, line in lines(run, timeout):
        if pattern.search(line):
            return stamp
    raise ended(run)


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


def respawn(launcher: str, kill_at: int, timeout: float) -> float:
    """Run train_ckpt.py under ftrun --respawn, SIGKILL RANK 1 at step ``kill_at``: seconds from the kill to
    the arrival of the notice that the world is back to 4 workers."""
    run = start([*LAUNCHERS[launcher], *LAUNCH_FLAGS, "--respawn", str(TRAIN), "--steps", "100000",
                 "--ckpt-every", "0"])
    try:
        for _, line in lines(run, timeout):
            match = TRAIN_STEP.search(line)
            if match and int(match[1]) >= kill_at:
                break
        worker = worker_with_rank(run.proc.pid, 1, TRAIN.name)
        killed = time.perf_counter()
        os.kill(worker.pid, signal.SIGKILL)
        return first_match(run, BACK_TO_4, timeout) - killed
    finally:
        stop(run)


def measure(repeats: int, fail_at: int, timeout: float) -> dict[str, dict[str, list[float]]]:
    """Both measurements, per metric and launcher, the launchers taking turns run by run."""
    results: dict[str, dict[str, list[float]]] = {metric: {name: [] for name in LAUNCHERS} for metric in METRICS}
    for repeat in range(repeats):
        for launcher in LAUNCHERS:
            first, restart = group_restart(launcher, fail_at, timeout)
            results["first_step"][launcher].append(first)
            results["restart"][launcher].append(restart)
            line = f"  run {repeat + 1}/{repeats} {launcher:22s} first step {first:6.2f} s, group restart {restart:6.2f} s"
            if launcher != BASELINE:
                results["respawn"][launcher].append(respawn(launcher, fail_at, timeout))
                line += f", respawn {results['respawn'][launcher][-1]:6.2f} s"
            print(line, flush=True)
    return results


def cell(values: list[float]) -> str:
    """``median [min-max]``, or ``-`` where the launcher has no such measurement."""
    return f"{statistics.median(values):.2f} [{min(values):.2f}-{max(values):.2f}]" if values else "-"


def report(results: dict[str, dict[str, list[float]]]) -> None:
    """Print the table of medians, their ratios to torchrun (respawn: with the fork server to without), and
    the command line that produced it."""
    others = [name for name in LAUNCHERS if name != BASELINE]
    print(f"\n{'seconds: median [min-max]':40s}" + "".join(f" {name:>24s}" for name in LAUNCHERS))
    for metric, label in METRICS.items():
        print(f"{label:40s}" + "".join(f" {cell(results[metric][name]):>24s}" for name in LAUNCHERS))
    print(f"\n{'ratio of medians to ' + BASELINE:40s}" + " " * 25 + "".join(f" {name:>24s}" for name in others))
    for metric, label in METRICS.items():
        if results[metric][BASELINE]:
            baseline = statistics.median(results[metric][BASELINE])
            print(f"{label:40s}" + " " * 25
                  + "".join(f" {statistics.median(results[metric][name]) / baseline:24.2f}" for name in others))
    forked, new = (statistics.median(results["respawn"][name]) for name in others)
    print(f"{METRICS['respawn']:40s} {'with / without the fork server':>49s} {forked / new:24.2f}")
    print(f"\n{command_line()}")


def main() -> None:
    args = parse_args()
    print(f"4 workers, launchers taking turns, {args.repeats} runs each ({machine()})", flush=True)
    report(measure(args.repeats, args.fail_at, args.timeout))


if __name__ == "__main__":
    main()
