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
import re
import statistics
import sys
from pathlib import Path

from bench_runs import Run, command_line, ended, lines, machine, start, stop

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
    print(f"\n{command_line()}")


def main() -> None:
    args = parse_args()
    print(f"4 workers, launchers alternating, {args.repeats} runs each ({machine()})", flush=True)
    report(measure(args.repeats, args.fail_at, args.timeout))


if __name__ == "__main__":
    main()
