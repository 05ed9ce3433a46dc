"""Compare recovering from a killed worker: torchrun + disk checkpoint vs ftrun in place; and per-step cost.

Recovery drills (``--drills`` each, alternating; every drill is a separate run of ``--workers`` CPU workers,
4 by default, with ``--standalone --nproc-per-node <workers> --max-restarts 3`` under both launchers) run
scripts/bench_workloads/train_ckpt.py: examples/train_ddp.py's training through the ftrun worker API,
which under torchrun also saves a checkpoint every ``--ckpt-every`` steps and resumes from it after a
group restart. When the job's output shows step ``--kill-at`` committed, this process finds the worker
with RANK=1 (bench_runs.worker_with_rank), takes time.time() and sends it
SIGKILL. Per drill:

* recovery latency: from that time.time() to the ``t=`` (the worker's time.time()) of the first step
  committed by the recovered job (a new attempt under torchrun, a smaller world under ftrun);
* time to new progress: from the kill to the first committed step beyond the last one committed before;
* steps recomputed: steps committed before the fault and committed again after it (torchrun: those
  after the last checkpoint; ftrun: should be 0), and for ftrun its events.jsonl "recovery" event
  (its own latency, from when it noticed the exit, and steps_lost).

Steady state (``--overhead-runs`` rounds of one run of each configuration, no faults, ``--overhead-steps``
steps; each round starts one configuration later than the one before, so that every configuration takes each
place in a round equally often over a multiple of three rounds):
the median of the differences between consecutive steps' ``t=`` over steps 10..N-1 for train_ckpt.py
(no checkpoints) under ftrun (the worker API's step protocol) and under torchrun (the API degraded to
DDP with its summing hook), and for scripts/bench_workloads/plain_ddp.py under torchrun (stock DDP
without ftrun, same model and batch). This machine's step times drift by 10% and more from one run to the
next, so each configuration is also reported as the median of its ratios to the plain-DDP run of the same
round (runs next to each other in time), and as the CPU time the whole job (launcher, agent, fork server,
workers) spent per step over the same steps: on a machine whose cores the workers keep busy, what ftrun
adds to a step is CPU time taken from them.

Comm hook cost (in this process, a Gloo group of one rank, the example's model in DDP with 1 MB buckets,
``--hook-steps`` steps): the time ftrun's comm hook takes per bucket, from DDP's call to its return (what
stands between DDP and the all-reduce's launch on any backend), median and 90th percentile in µs, next to
the least a Python hook can do (issue the all-reduce, chain its future) in the same process.

Output lines are read as they arrive; a run is stopped (SIGTERM to the launcher, then SIGKILL to any
of its descendants left) once its measurement is taken. Medians, ratios and the targets are printed.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil

from bench_runs import Run, command_line, ended, ftrun_run_dir, lines, machine, start, stop, worker_with_rank

ROOT = Path(__file__).resolve().parents[1]
TRAIN = ROOT / "scripts" / "bench_workloads" / "train_ckpt.py"
PLAIN = ROOT / "scripts" / "bench_workloads" / "plain_ddp.py"
LAUNCHERS = {
    "torchrun": [sys.executable, "-m", "torch.distributed.run"],
    "ftrun": [sys.executable, "-m", "ftrun"],
}
TRAIN_LINE = re.compile(r"\bstep=(\d+) loss=\S+ t=([\d.]+) world=(\d+) attempt=(\d+)")
ANY_STEP = re.compile(r"\bstep=(\d+)\b.*\bt=([\d.]+)")
TARGET_LATENCY, TARGET_SPEEDUP, TARGET_OVERHEAD, TARGET_OWN_LATENCY = 0.5, 20.0, 0.03, 0.05


def parse_args() -> argparse.Namespace:
    """The benchmark's flags."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--drills", type=int, default=3, help="Recovery drills per launcher (default 3; 0: only the per-step cost).")
    parser.add_argument("--ckpt-every", type=int, default=20, help="torchrun checkpoint interval in steps (20).")
    parser.add_argument("--kill-at", type=int, default=30, help="Kill RANK 1 once this step is committed (30).")
    parser.add_argument("--overhead-steps", type=int, default=150, help="Steps per steady-state run (150).")
    parser.add_argument("--overhead-runs", type=int, default=3, help="Steady-state rounds, one run of each "
                        "configuration in each (3; over a multiple of 3 each takes each place equally often).")
    parser.add_argument("--timeout", type=float, default=180.0, help="Seconds one run may take (180).")
    parser.add_argument("--hook-steps", type=int, default=100, help="Steps of the comm hook measurement (100).")
    parser.add_argument("--workers", type=int, default=4, help="Workers of every run (4).")
    parser.add_argument("--data-reconfigure", choices=["fresh", "native"], default="fresh",
                        help="ftrun's --data-reconfigure in the drills (fresh).")
    args = parser.parse_args()
    if args.workers < 2:
        parser.error("--workers must be at least 2 (a drill kills RANK 1)")
    return args


def launch_flags(workers: int) -> list[str]:
    """The flags every run is launched with, under either launcher."""
    return ["--standalone", "--nproc-per-node", str(workers), "--max-restarts", "3"]


# ------------------------------------------------------------------ recovery drills
@dataclass
class Drill:
    """What one drill measured."""

    launcher: str
    killed_after: int  # the committed step whose line triggered the kill
    last_before: int  # highest step committed by the job before recovery
    resumed_at: int  # first step committed after recovery
    latency: float  # kill -> first step committed after recovery
    progress: float  # kill -> first step beyond last_before
    event: dict[str, Any] | None  # ftrun's "recovery" event

    @property
    def recomputed(self) -> int:
        """Steps committed before the fault and again after it."""
        return max(0, self.last_before - self.resumed_at + 1)


def recovery_event(run_dir: Path, timeout: float = 10.0) -> dict[str, Any]:
    """ftrun's "recovery" event from <run dir>/events.jsonl, waiting for it to be written."""
    deadline = time.monotonic() + timeout
    path = run_dir / "events.jsonl"
    while time.monotonic() < deadline:
        if path.exists():
            events = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
            found = [e for e in events if e["event"] == "recovery"]
            if found:
                return found[0]
        time.sleep(0.05)
    raise RuntimeError(f"no recovery event in {path} within {timeout:.0f} s")


def drill(launcher: str, args: argparse.Namespace) -> Drill:
    """One run: kill RANK 1 after step --kill-at, follow the job until it makes new progress."""
    with tempfile.TemporaryDirectory(prefix="bench_recovery_") as ckpt_dir:
        own = ["--data-reconfigure", args.data_reconfigure] if launcher == "ftrun" else []
        run = start([*LAUNCHERS[launcher], *own, *launch_flags(args.workers), str(TRAIN), "--steps", "100000",
                     "--ckpt-every", str(args.ckpt_every), "--ckpt-dir", ckpt_dir])
        try:
            return follow(run, launcher, args)
        finally:
            stop(run)


def follow(run: Run, launcher: str, args: argparse.Namespace) -> Drill:
    """Read the drill's output: kill at the target step, then time the recovery from the step lines."""
    killed_at = killed_after = last_before = -1
    resumed: tuple[int, float] | None = None
    run_dir: Path | None = None
    for _, line in lines(run, args.timeout):
        match = TRAIN_LINE.search(line)
        if not match:
            continue
        step, stamp, world, attempt = int(match[1]), float(match[2]), int(match[3]), int(match[4])
        recovered = world < args.workers or attempt > 0
        if killed_at < 0 and step >= args.kill_at:
            worker = worker_with_rank(run.proc.pid, 1, TRAIN.name)
            run_dir = ftrun_run_dir(run.proc.pid)
            killed_at, killed_after = time.time(), step
            os.kill(worker.pid, signal.SIGKILL)
        if not recovered:
            last_before = max(last_before, step)
            continue
        if resumed is None:
            resumed = (step, stamp - killed_at)
        if step > last_before:
            event = recovery_event(run_dir) if run_dir else None
            return Drill(launcher, killed_after, last_before, resumed[0], resumed[1], stamp - killed_at, event)
    raise ended(run)


# ------------------------------------------------------------------ steady state
OVERHEAD_CONFIGS = {
    "plain DDP under torchrun (plain_ddp.py)": ("torchrun", PLAIN, []),
    "worker API degraded to DDP, torchrun (train_ckpt.py)": ("torchrun", TRAIN, ["--ckpt-every", "0"]),
    "worker API under ftrun (train_ckpt.py)": ("ftrun", TRAIN, ["--ckpt-every", "0"]),
}


@dataclass
class Steady:
    """One fault-free run: the durations of steps 11..N-1 and the job's CPU seconds per step over them."""

    times: list[float]
    cpu: float


def round_order(labels: list[str], number: int) -> list[str]:
    """The configurations of round ``number`` in the order they run: the list turned by one place a round.

    Where a run stands in its round moves its step time here (the configurations run in one fixed order, the
    last one's per-round ratios to the first were 1.08-1.11 over five rounds of 2 workers, and 0.85-1.08 with
    the same configuration run first), so no configuration keeps one place."""
    turn = number % len(labels)
    return labels[turn:] + labels[:turn]


def step_times(launcher: str, script: Path, extra: list[str], args: argparse.Namespace) -> Steady:
    """Durations of steps 11..N-1 (consecutive ``t=`` differences) of one fault-free run of
    ``--overhead-steps`` N, and the CPU time (user and system) of the launcher and all its descendants per
    step between step 10 and the last."""
    steps = args.overhead_steps
    run = start([*LAUNCHERS[launcher], *launch_flags(args.workers), str(script), "--steps", str(steps), *extra])
    stamps: dict[int, float] = {}
    cpu_at_10 = 0.0
    try:
        for _, line in lines(run, args.timeout):
            match = ANY_STEP.search(line)
            if match:
                stamps[int(match[1])] = float(match[2])
                if int(match[1]) == 10:
                    cpu_at_10 = job_cpu(run.proc.pid)
            if steps - 1 in stamps:
                cpu = (job_cpu(run.proc.pid) - cpu_at_10) / (steps - 11)
                return Steady([stamps[s] - stamps[s - 1] for s in range(11, steps)], cpu)
        raise ended(run)
    finally:
        stop(run)


def job_cpu(pid: int) -> float:
    """CPU seconds (user and system) that process ``pid`` and its live descendants have spent."""
    total = 0.0
    root = psutil.Process(pid)
    for process in [root, *root.children(recursive=True)]:
        try:
            times = process.cpu_times()
        except psutil.NoSuchProcess:
            continue
        total += times.user + times.system
    return total


# ------------------------------------------------------------------ comm hook
def hook_costs(steps: int, backend: str = "gloo", device: str = "cpu") -> dict[str, list[float]]:
    """Microseconds per bucket call of ftrun's comm hook and of a minimal Python one (world of one, the model
    on ``device``, the group of ``backend``)."""
    import threading
    from datetime import timedelta

    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    sys.path.insert(0, str(ROOT / "examples"))
    import train_ddp

    from ftrun.worker.steps import StepCollectives

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    dist.init_process_group(backend, store=store, rank=0, world_size=1, timeout=timedelta(seconds=60))
    collectives = StepCollectives(threading.Condition(), None)
    hooks = {"ftrun": collectives.hook,
             "minimal": lambda group, bucket: group.allreduce([bucket.buffer()]).get_future().then(
                 lambda fut: fut.value()[0])}
    args = train_ddp.parse_args([])
    inputs = torch.randn(32, args.width, device=device)
    costs: dict[str, list[float]] = {}
    for name, hook in hooks.items():
        measured: list[float] = []

        def timed(state, bucket, hook=hook, measured=measured):  # noqa: ANN001, ANN202 -- DDP rejects string annotations
            start = time.perf_counter_ns()
            future = hook(state, bucket)
            measured.append((time.perf_counter_ns() - start) / 1000)
            return future

        model = DistributedDataParallel(train_ddp.make_model(args).to(device), bucket_cap_mb=1)
        model.register_comm_hook(dist.group.WORLD, timed)
        for _ in range(steps):
            collectives.begin()
            model(inputs).square().sum().backward()
            collectives.finish(None, lambda _: dist.group.WORLD)
        costs[name] = measured[len(measured) // 10:]  # past the first steps (bucket rebuild, warm-up)
    dist.destroy_process_group()
    return costs


# ------------------------------------------------------------------ report
def print_drills(drills: list[Drill]) -> None:
    """One line per drill."""
    print(f"\n{'launcher':9s} {'killed after':>12s} {'last before':>11s} {'resumed at':>10s} {'recomputed':>10s} "
          f"{'kill->next step':>15s} {'kill->new step':>14s}  ftrun event (latency, steps_lost)")
    for d in drills:
        event = f"{d.event['latency']:.3f} s, {d.event['steps_lost']}" if d.event else "-"
        print(f"{d.launcher:9s} {d.killed_after:12d} {d.last_before:11d} {d.resumed_at:10d} {d.recomputed:10d} "
              f"{d.latency:13.3f} s {d.progress:12.3f} s  {event}")


def print_summary(drills: list[Drill], overhead: dict[str, list[Steady]], hooks: dict[str, list[float]],
                  args: argparse.Namespace) -> None:
    """Medians, ratios and the targets (those of the drills, or of the steady state, only when they ran)."""
    targets = print_drill_summary(drills, args) if drills else []
    if args.overhead_runs:
        targets.append(print_steady_summary(overhead, args))
    for name, costs in hooks.items():
        if len(costs) > 1:
            print(f"comm hook per bucket call, {name:7s}: median {statistics.median(costs):7.1f} us, "
                  f"90th percentile {statistics.quantiles(costs, n=10)[-1]:8.1f} us ({len(costs)} calls)")
    print("\ntargets:")
    for label, ok in targets:
        print(f"  {'PASS' if ok else 'FAIL'}  {label}")
    print(f"\n{command_line()}")


def print_steady_summary(overhead: dict[str, list[Steady]], args: argparse.Namespace) -> tuple[str, bool]:
    """Each configuration's step time against plain DDP's (pooled, and per round) and its CPU per step; the
    step-time target, judged on the median of the per-round ratios (the pooled median moves with the drift)."""
    plain = overhead[next(iter(OVERHEAD_CONFIGS))]
    plain_median = statistics.median(t for run in plain for t in run.times)
    plain_cpu = statistics.median(run.cpu for run in plain)
    print(f"\n{'steady state, steps 11..' + str(args.overhead_steps - 1):55s} {'median ms':>10s} {'ratio':>6s} "
          f"{'per round':>22s} {'CPU ms/step':>11s} {'ratio':>6s}")
    rounds: dict[str, list[float]] = {}
    for label, runs in overhead.items():
        median = statistics.median(t for run in runs for t in run.times)
        rounds[label] = [statistics.median(run.times) / statistics.median(base.times) for run, base in zip(runs, plain)]
        cpu = statistics.median(run.cpu for run in runs)
        per_round = " ".join(f"{r:.3f}" for r in rounds[label])
        print(f"{label:55s} {median * 1000:10.2f} {median / plain_median:6.3f} "
              f"{statistics.median(rounds[label]):6.3f} ({per_round:>13s}) {cpu * 1000:11.1f} {cpu / plain_cpu:6.3f}")
    ratio = statistics.median(rounds[list(OVERHEAD_CONFIGS)[-1]]) - 1
    return (f"per-step overhead < {TARGET_OVERHEAD:.0%} vs plain DDP, median of the rounds' ratios ({ratio:+.1%})",
            ratio < TARGET_OVERHEAD)


def print_drill_summary(drills: list[Drill], args: argparse.Namespace) -> list[tuple[str, bool]]:
    """The drills' medians and ratios, and ftrun's own recovery phases; the drills' targets, met or not."""
    by = {name: [d for d in drills if d.launcher == name] for name in LAUNCHERS}
    latency = {name: statistics.median(d.latency for d in ds) for name, ds in by.items()}
    progress = {name: statistics.median(d.progress for d in ds) for name, ds in by.items()}
    recomputed = {name: statistics.median(d.recomputed for d in ds) for name, ds in by.items()}
    print(f"\n{'median over ' + str(args.drills) + ' drills':40s} {'torchrun':>10s} {'ftrun':>10s} "
          f"{'ftrun/torchrun':>15s}")
    for label, values in (("recovery latency: kill -> next step (s)", latency),
                          ("kill -> first new step (s)", progress)):
        print(f"{label:40s} {values['torchrun']:10.3f} {values['ftrun']:10.3f} "
              f"{values['ftrun'] / values['torchrun']:15.4f}")
    print(f"{'steps recomputed':40s} {recomputed['torchrun']:10g} {recomputed['ftrun']:10g}")
    ft_drills = by["ftrun"]
    own = [d.event["latency"] for d in ft_drills if d.event]
    own_median = statistics.median(own) if own else float("nan")
    print(f"\nftrun's own recovery latency (its event: fault seen -> first committed step), median of {len(own)}: "
          f"{own_median * 1000:.1f} ms; phases of each (ms): " + "; ".join(
              " ".join(f"{k} {v * 1000:.0f}" for k, v in d.event["phases"].items()) for d in ft_drills if d.event))
    lost = [d.recomputed for d in ft_drills] + [d.event["steps_lost"] for d in ft_drills if d.event]
    return [(f"ftrun median recovery < {TARGET_LATENCY} s ({latency['ftrun']:.3f} s)",
             latency["ftrun"] < TARGET_LATENCY),
            (f"at least {TARGET_SPEEDUP:g}x faster than torchrun ({latency['torchrun'] / latency['ftrun']:.1f}x)",
             latency["torchrun"] / latency["ftrun"] >= TARGET_SPEEDUP),
            (f"ftrun's own median recovery <= {TARGET_OWN_LATENCY * 1000:.0f} ms ({own_median * 1000:.1f} ms)",
             own_median <= TARGET_OWN_LATENCY),
            (f"0 steps lost in every ftrun drill (output and events: {lost})", not any(lost))]


def main() -> None:
    args = parse_args()
    print(f"{args.workers} workers, kill RANK 1 after step {args.kill_at}, torchrun checkpoint every {args.ckpt_every} "
          f"steps ({machine()})", flush=True)
    drills = []
    for number in range(args.drills):
        for launcher in LAUNCHERS:
            drills.append(drill(launcher, args))
            print(f"  drill {number + 1}/{args.drills} {launcher:8s} recovered in {drills[-1].latency:.3f} s, "
                  f"{drills[-1].recomputed} steps recomputed", flush=True)
    overhead: dict[str, list[Steady]] = {label: [] for label in OVERHEAD_CONFIGS}
    for number in range(args.overhead_runs):
        for label in round_order(list(OVERHEAD_CONFIGS), number):
            launcher, script, extra = OVERHEAD_CONFIGS[label]
            overhead[label].append(step_times(launcher, script, extra, args))
            print(f"  steady state {number + 1}/{args.overhead_runs}: {label}", flush=True)
    hooks = hook_costs(args.hook_steps)
    if drills:
        print_drills(drills)
    print_summary(drills, overhead, hooks, args)


if __name__ == "__main__":
    main()
