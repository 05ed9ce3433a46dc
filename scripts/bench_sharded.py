"""What keeping FSDP2 state redundant in host memory costs, and how fast a lost shard comes back from it.

Every run is ftrun with 4 CPU workers (``--standalone --nproc-per-node 4``) over examples/train_fsdp.py
(the MLP of train_ddp.py, ``fully_shard`` per layer, AdamW), in one invocation:

* Step time (``--runs`` fault-free runs of each configuration, alternating, ``--steps`` steps): the median
  of the intervals between the arrivals of rank 0's consecutive ``step=`` lines over steps 10..N-1, with
  copies to the buddy after every step (``--refresh-every 1``), every 10 steps, and none
  (``--refresh-every 0``: no redundancy, the reference). Overhead = median / the reference's median - 1.
  The example runs through scripts/bench_workloads/timed_fsdp.py, which also times inside each rank the
  redundancy work on the step path (snapshot, start of the copy, the next step's wait for it): per step,
  median over ranks and runs; that over the reference's step time is the overhead a quiet machine sees.
* Extra host memory per rank: the bytes rank 0 reports holding for redundancy (two snapshots of its shard
  and two copies of its buddy's), next to the size of one shard of model + AdamW state.
* Recovery (``--drills`` runs each, over scripts/bench_workloads/train_fsdp_ckpt.py: the same training):
  the worker with RANK=1 is sent SIGKILL once step ``--kill-at`` is committed, under ftrun with a spare
  (``--spares 1``: the world stays 4) and without (a shrink to 3), and under torchrun (``--max-restarts 3``)
  with a ``torch.distributed.checkpoint`` of every rank's shards every ``--ckpt-every`` steps, from which the
  restarted group resumes. Reported: from the kill to the first step committed after it (the worker's
  ``t=``), steps computed again, and ftrun's own latency (its "recovery" event: fault seen to first step).
* Preemption (``--preemptions`` runs each, over the same workload): the launcher gets SIGTERM once step
  ``--kill-at`` is committed, then the job is launched again to resume: ftrun with ``--resume-from`` (each
  rank saved its shard's copies as it stopped), torchrun from the latest DCP checkpoint. Reported: the stop
  (SIGTERM to the launcher's exit), the bytes ftrun saved, the new launch to its first committed step, and
  the steps computed again (committed before the stop, computed anew after it).
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench_recovery import TRAIN_LINE, recovery_event
from bench_runs import command_line, ended, ftrun_run_dir, lines, machine, start, stop, worker_with_rank

ROOT = Path(__file__).resolve().parents[1]
TIMED = ROOT / "scripts" / "bench_workloads" / "timed_fsdp.py"
TRAIN = ROOT / "scripts" / "bench_workloads" / "train_fsdp_ckpt.py"
FTRUN = [sys.executable, "-m", "ftrun", "--standalone", "--nproc-per-node", "4"]
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4",
            "--max-restarts", "3"]
STEP = re.compile(r"^(?:\[\w+\]: )?step=(\d+) loss=")
SPENT = re.compile(r"redundancy rank=\d+ steps=\d+ ms_per_step=([\d.]+)")
EXTRA = re.compile(r"every \d+ step\(s\): (\d+) extra bytes on rank 0")
TARGET_OVERHEAD_EVERY_10 = 0.05


def parse_args() -> argparse.Namespace:
    """The benchmark's flags."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=60, help="Steps per step-time run (60).")
    parser.add_argument("--runs", type=int, default=2, help="Step-time runs per configuration (2).")
    parser.add_argument("--drills", type=int, default=2, help="Recovery drills per kind (2).")
    parser.add_argument("--kill-at", type=int, default=30, help="Kill RANK 1 once this step is committed (30).")
    parser.add_argument("--ckpt-every", type=int, default=20, help="torchrun's checkpoint interval in steps (20).")
    parser.add_argument("--width", type=int, default=1024, help="The MLP's width (1024: 4 layers, 4.2 M params).")
    parser.add_argument("--preemptions", type=int, default=1, help="Preemption drills per launcher (1).")
    parser.add_argument("--timeout", type=float, default=300.0, help="Seconds one run may take (300).")
    return parser.parse_args()


def step_times(refresh_every: int, args: argparse.Namespace) -> tuple[list[float], list[float], int | None]:
    """Intervals between step lines 10..N-1 of one fault-free run, each rank's redundancy milliseconds per
    step, and the extra bytes rank 0 reported."""
    run = start([*FTRUN, str(TIMED), "--steps", str(args.steps), "--width", str(args.width),
                 "--refresh-every", str(refresh_every)])
    stamps: dict[int, float] = {}
    spent: list[float] = []
    extra = None
    try:
        for stamp, line in lines(run, args.timeout):
            found = EXTRA.search(line)
            extra = int(found[1]) if found else extra
            found = SPENT.search(line)
            if found:
                spent.append(float(found[1]))
            match = STEP.search(line)
            if match:
                stamps[int(match[1])] = stamp
        if args.steps - 1 not in stamps:
            raise ended(run)
        return [stamps[s] - stamps[s - 1] for s in range(10, args.steps)], spent, extra
    finally:
        stop(run)


DRILLS = {"ftrun, a spare (world 4 -> 4)": [*FTRUN, "--spares", "1"], "ftrun, shrink (world 4 -> 3)": FTRUN,
          "torchrun, DCP checkpoint, restart": TORCHRUN}


def drill(launcher: list[str], args: argparse.Namespace) -> dict[str, Any]:
    """Kill RANK 1 after step --kill-at; the time to the next committed step and the steps computed again."""
    with tempfile.TemporaryDirectory(prefix="bench_sharded_") as ckpt_dir:
        run = start([*launcher, str(TRAIN), "--steps", "100000", "--width", str(args.width),
                     "--ckpt-every", str(args.ckpt_every), "--ckpt-dir", ckpt_dir])
        try:
            return follow(run, launcher is TORCHRUN, args)
        finally:
            stop(run)


def follow(run: Any, restarts: bool, args: argparse.Namespace) -> dict[str, Any]:
    """Read a drill's step lines: kill at the target step, then time the recovery."""
    killed_at, last_before, run_dir = None, -1, None
    for _, line in lines(run, args.timeout):
        match = TRAIN_LINE.search(line)
        if not match:
            continue
        step, stamp, attempt = int(match[1]), float(match[2]), int(match[4])
        if killed_at is None:
            last_before = step
            if step >= args.kill_at:
                worker = worker_with_rank(run.proc.pid, 1, TRAIN.name)
                run_dir = worker.environ().get("FTRUN_RUN_DIR")
                killed_at = time.time()
                os.kill(worker.pid, signal.SIGKILL)
            continue
        if restarts and attempt == 0:
            continue  # a line of the failing attempt
        event = recovery_event(Path(run_dir)) if run_dir else None
        return {"latency": stamp - killed_at, "again": max(0, last_before - step + 1),
                "own": event["latency"] if event else None}
    raise ended(run)


def preemption(launcher: list[str], args: argparse.Namespace) -> dict[str, Any]:
    """SIGTERM the launcher once step --kill-at is committed, then launch the job again to resume it."""
    with tempfile.TemporaryDirectory(prefix="bench_sharded_") as ckpt_dir:
        command = [str(TRAIN), "--steps", "100000", "--width", str(args.width), "--ckpt-every", str(args.ckpt_every),
                   "--ckpt-dir", ckpt_dir]
        first = start([*launcher, *command])
        try:
            last, signalled, run_dir = -1, None, None
            for _, line in lines(first, args.timeout):
                match = TRAIN_LINE.search(line)
                if match:
                    last = int(match[1])
                if signalled is None and last >= args.kill_at:
                    run_dir = ftrun_run_dir(first.proc.pid)
                    signalled = time.perf_counter()
                    first.proc.send_signal(signal.SIGTERM)
            if signalled is None:
                raise ended(first)
            first.proc.wait(args.timeout)
            stopped = time.perf_counter() - signalled
        finally:
            stop(first)
        saved = sum(p.stat().st_size for p in run_dir.glob("rescue/shards/*.pt")) if run_dir else 0
        resume = ["--resume-from", str(run_dir)] if run_dir else []
        again = start([*launcher, *resume, *command])
        try:
            for stamp, line in lines(again, args.timeout):
                match = TRAIN_LINE.search(line)
                if match:
                    return {"stop": stopped, "saved": saved, "first_step": stamp - again.started,
                            "again": max(0, last - int(match[1]) + 1)}
            raise ended(again)
        finally:
            stop(again)


def main() -> None:
    args = parse_args()
    print(f"bench_sharded: {machine()}; examples/train_fsdp.py --width {args.width}, 4 workers")
    print(command_line())
    if args.runs:
        report_step_times(args)
    if args.drills:
        report_drills(args)
    if args.preemptions:
        report_preemptions(args)


def report_step_times(args: argparse.Namespace) -> None:
    """The step time with copies every step, every 10 steps and none; the extra host memory."""
    configs = {"none (--refresh-every 0)": 0, "every step": 1, "every 10 steps": 10}
    times: dict[str, list[float]] = {name: [] for name in configs}
    spent: dict[str, list[float]] = {name: [] for name in configs}
    extra: int | None = None
    for _ in range(args.runs):
        for name, every in configs.items():
            intervals, ranks, reported = step_times(every, args)
            times[name] += intervals
            spent[name] += ranks
            extra = extra or reported
    reference = statistics.median(times["none (--refresh-every 0)"])
    print("\nstep time (median over steps 10..N-1 of every run):")
    for name, values in times.items():
        median = statistics.median(values)
        inside = statistics.median(spent[name]) / 1000 if spent[name] else 0.0
        print(f"  {name:26s} {median * 1000:8.1f} ms  overhead {median / reference - 1:+.1%}   "
              f"redundancy work on the step path {inside * 1000:6.1f} ms ({inside / reference:.1%} of the reference)")
    overhead_10 = statistics.median(spent["every 10 steps"]) / 1000 / reference
    print(f"  target: <= {TARGET_OVERHEAD_EVERY_10:.0%} at every 10 steps (timed inside the ranks): "
          f"{'met' if overhead_10 <= TARGET_OVERHEAD_EVERY_10 else 'NOT met'}")
    if extra is not None:
        print(f"\nextra host memory on rank 0: {extra / 2**20:.1f} MiB = 4 x its shard of model + AdamW state "
              f"({extra / 4 / 2**20:.1f} MiB): 2 snapshots of its own, 2 copies of its buddy's")


def report_drills(args: argparse.Namespace) -> None:
    """Recovery from the SIGKILL of RANK 1: ftrun with a spare, ftrun shrinking, torchrun from its checkpoint."""
    print(f"\nrecovery from SIGKILL of RANK 1 after step {args.kill_at} (kill -> next committed step, median):")
    results: dict[str, list[dict[str, Any]]] = {name: [] for name in DRILLS}
    for _ in range(args.drills):
        for name, launcher in DRILLS.items():
            results[name].append(drill(launcher, args))
    for name, drills in results.items():
        own = [r["own"] for r in drills if r["own"] is not None]
        print(f"  {name:36s} {statistics.median(r['latency'] for r in drills):7.2f} s   steps computed again "
              f"{[r['again'] for r in drills]}" + (f"   ftrun's event {statistics.median(own):.2f} s" if own else ""))


def report_preemptions(args: argparse.Namespace) -> None:
    """A preemption and the launch that resumes: ftrun from its saved shards, torchrun from its checkpoint."""
    print(f"\npreemption: SIGTERM to the launcher after step {args.kill_at}, then a new launch resumes (median):")
    for name, launcher in {"ftrun, its saved shards (--resume-from)": FTRUN,
                           "torchrun, the latest DCP checkpoint": TORCHRUN}.items():
        runs = [preemption(launcher, args) for _ in range(args.preemptions)]
        print(f"  {name:40s} stop {statistics.median(r['stop'] for r in runs):5.2f} s (saved "
              f"{statistics.median(r['saved'] for r in runs) / 2**20:6.1f} MiB)   new launch to its first step "
              f"{statistics.median(r['first_step'] for r in runs):5.2f} s   steps computed again "
              f"{[r['again'] for r in runs]}")


if __name__ == "__main__":
    main()
