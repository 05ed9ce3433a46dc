"""What keeping FSDP2 state redundant in host memory costs, and how fast a lost shard comes back from it.

Every run is ftrun with 4 CPU workers (``--standalone --nproc-per-node 4``) over examples/train_fsdp.py
(the MLP of train_ddp.py, ``fully_shard`` per layer, AdamW), in one invocation:

* Step time (``--runs`` fault-free runs of each configuration, alternating, ``--steps`` steps): the median
  of the intervals between the arrivals of rank 0's consecutive ``step=`` lines over steps 10..N-1, with
  copies to the buddy after every step (``--refresh-every 1``), every 10 steps, and none
  (``--refresh-every 0``: no redundancy, the reference). Overhead = median / the reference's median - 1.
* Extra host memory per rank: the bytes rank 0 reports holding for redundancy (two snapshots of its shard
  and two copies of its buddy's), next to the size of one shard of model + AdamW state.
* Recovery latency (``--drills`` runs each): the worker with RANK=1 is sent SIGKILL once step ``--kill-at``
  is committed, with a spare (``--spares 1``: the world stays 4) and without (a shrink to 3). Reported:
  ftrun's own latency (its "recovery" event: from the fault to the first step committed after it) and
  this process's (from the kill to the arrival of the first step line after it), and steps replayed.

Not measured here (yet): torchrun with a torch.distributed.checkpoint every 20 steps on the same model.
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
from typing import Any

from bench_recovery import recovery_event
from bench_runs import command_line, ended, lines, machine, start, stop, worker_with_rank

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "train_fsdp.py"
FTRUN = [sys.executable, "-m", "ftrun", "--standalone", "--nproc-per-node", "4"]
STEP = re.compile(r"^(?:\[\w+\]: )?step=(\d+) loss=")
EXTRA = re.compile(r"every \d+ step\(s\): (\d+) extra bytes on rank 0")
TARGET_OVERHEAD_EVERY_10 = 0.05


def parse_args() -> argparse.Namespace:
    """The benchmark's flags."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=60, help="Steps per step-time run (60).")
    parser.add_argument("--runs", type=int, default=2, help="Step-time runs per configuration (2).")
    parser.add_argument("--drills", type=int, default=2, help="Recovery drills per kind (2).")
    parser.add_argument("--kill-at", type=int, default=10, help="Kill RANK 1 once this step is committed (10).")
    parser.add_argument("--width", type=int, default=1024, help="The MLP's width (1024: 4 layers, 4.2 M params).")
    parser.add_argument("--timeout", type=float, default=300.0, help="Seconds one run may take (300).")
    return parser.parse_args()


def step_times(refresh_every: int, args: argparse.Namespace) -> tuple[list[float], int | None]:
    """Intervals between step lines 10..N-1 of one fault-free run, and the extra bytes it reported."""
    run = start([*FTRUN, str(EXAMPLE), "--steps", str(args.steps), "--width", str(args.width),
                 "--refresh-every", str(refresh_every)])
    stamps: dict[int, float] = {}
    extra = None
    try:
        for stamp, line in lines(run, args.timeout):
            found = EXTRA.search(line)
            if found:
                extra = int(found[1])
            match = STEP.search(line)
            if match:
                stamps[int(match[1])] = stamp
            if args.steps - 1 in stamps:
                return [stamps[s] - stamps[s - 1] for s in range(10, args.steps)], extra
        raise ended(run)
    finally:
        stop(run)


def drill(spare: bool, args: argparse.Namespace) -> dict[str, Any]:
    """Kill RANK 1 after step --kill-at; the latencies of the recovery and the steps it replayed."""
    run = start([*FTRUN, *(["--spares", "1"] if spare else []), str(EXAMPLE), "--steps", "100000",
                 "--width", str(args.width)])
    killed_at, last_before, run_dir = None, -1, None
    try:
        for stamp, line in lines(run, args.timeout):
            match = STEP.search(line)
            if not match:
                continue
            step = int(match[1])
            if killed_at is None:
                last_before = step
                if step >= args.kill_at:
                    worker = worker_with_rank(run.proc.pid, 1, EXAMPLE.name)
                    run_dir = Path(worker.environ()["FTRUN_RUN_DIR"])
                    killed_at = time.perf_counter()
                    os.kill(worker.pid, signal.SIGKILL)
                continue
            event = recovery_event(run_dir)
            return {"latency": event["latency"], "seen": stamp - killed_at, "steps_lost": event["steps_lost"],
                    "world": (event["world_before"], event["world_after"]), "resumed": step, "last": last_before}
        raise ended(run)
    finally:
        stop(run)


def main() -> None:
    args = parse_args()
    print(f"bench_sharded: {machine()}; examples/train_fsdp.py --width {args.width}, 4 workers")
    print(command_line())
    configs = {"none (--refresh-every 0)": 0, "every step": 1, "every 10 steps": 10}
    times: dict[str, list[float]] = {name: [] for name in configs}
    extra: int | None = None
    for _ in range(args.runs):
        for name, every in configs.items():
            intervals, reported = step_times(every, args)
            times[name] += intervals
            extra = extra or reported
    reference = statistics.median(times["none (--refresh-every 0)"])
    print("\nstep time (median over steps 10..N-1 of every run):")
    for name, values in times.items():
        median = statistics.median(values)
        print(f"  {name:26s} {median * 1000:8.1f} ms  overhead {median / reference - 1:+.1%}")
    overhead_10 = statistics.median(times["every 10 steps"]) / reference - 1
    print(f"  target: <= {TARGET_OVERHEAD_EVERY_10:.0%} at every 10 steps: "
          f"{'met' if overhead_10 <= TARGET_OVERHEAD_EVERY_10 else 'NOT met'}")
    if extra is not None:
        print(f"\nextra host memory on rank 0: {extra / 2**20:.1f} MiB = 4 x its shard of model + AdamW state "
              f"({extra / 4 / 2**20:.1f} MiB): 2 snapshots of its own, 2 copies of its buddy's")
    print("\nrecovery from SIGKILL of RANK 1 (ftrun's latency: fault to first step committed after it):")
    for name, spare in (("with a spare (world 4 -> 4)", True), ("shrink (world 4 -> 3)", False)):
        results = [drill(spare, args) for _ in range(args.drills)]
        latency = statistics.median(r["latency"] for r in results)
        seen = statistics.median(r["seen"] for r in results)
        lost = [r["steps_lost"] for r in results]
        print(f"  {name:28s} ftrun {latency:6.2f} s   kill -> next step line {seen:6.2f} s   steps replayed {lost}")


if __name__ == "__main__":
    main()
