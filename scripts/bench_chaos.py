"""Goodput under chaos: ftrun recovering in place against torchrun restarting from disk checkpoints.

Each launcher runs scripts/bench_workloads/train_ckpt.py (examples/train_ddp.py's training; under torchrun
with a disk checkpoint every ``--ckpt-every`` steps) on 4 CPU workers with ``--standalone``, while this
process injects the same seeded fault schedule into both: ftrun.inject.ChaosSchedule draws, for each fault,
an uptime gap (exponential, mean ``--mtbf`` seconds), a kind among ``--kinds`` and a rank among 0..3. A gap
runs while the job is at full strength (4 workers training; ftrun runs with ``--respawn``, so it refills);
each launcher trains for ``--duration`` seconds of such uptime, so both get exactly the same faults and
differ in the time they spend recovering. (While a respawned worker starts, ftrun trains on with 3 workers:
useful time that is not uptime, so its wall time can be the longer one.) Faults:

* kill: SIGKILL the rank (ftrun: `inject kill` through the agent; torchrun: SIGKILL its pid);
* hang: SIGSTOP the rank (ftrun: `inject hang`, found by its watchdog, ``--hang-timeout``; torchrun: SIGSTOP,
  then SIGKILL after the same timeout plus ftrun's stack-dump grace, as a watchdog would);
* xid: ftrun: `inject xid 13` into the agent's GPU health policy (needs GPU health in the agent); torchrun:
  SIGKILL the rank, as the driver forces a process off a faulted GPU.

Per launcher, from rank 0's ``step=<n> loss=<x> t=<time> world=<w> attempt=<a>`` lines:

* goodput (ETTR): useful committed step time / wall time, from the first committed step to the end. Useful
  time is the time of each step's last commit (a step recomputed after a restart counts once), measured as
  the gap to the previous commit, or the median step time for the first commit after a recovery;
* faults survived: faults after which the job committed steps again;
* steps recomputed: steps committed before a fault and again after it;
* recovery latency per kind (median and max): from the fault (the agent's inject event; torchrun: the
  signal) to the first step committed after it by the recovered job (a smaller world or a new attempt).
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from bench_runs import Run, command_line, lines, machine, start, stop, worker_with_rank

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from ftrun import inject, registry  # noqa: E402
from ftrun.agent.watchdog import DUMP_GRACE  # noqa: E402
from ftrun.errors import UsageError  # noqa: E402
from ftrun.store.client import STORE_START_WAIT, connect_job  # noqa: E402

TRAIN = ROOT / "scripts" / "bench_workloads" / "train_ckpt.py"
WORLD = 4
TRAIN_LINE = re.compile(r"\bstep=(\d+) loss=\S+ t=([\d.]+) world=(\d+) attempt=(\d+)")
LAUNCHERS = ("ftrun", "torchrun")  # ftrun first: a drill it refuses (xid without GPU health) stops the run early


def parse_args() -> argparse.Namespace:
    """The benchmark's flags."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--duration", type=float, default=45.0, help="Seconds of uptime per launcher (45).")
    parser.add_argument("--mtbf", type=float, default=15.0, help="Mean seconds of uptime between faults (15).")
    parser.add_argument("--kinds", default="kill,hang,xid", help="Faults to draw from (kill,hang,xid).")
    parser.add_argument("--seed", type=int, default=1, help="Seed of the fault schedule (1).")
    parser.add_argument("--hang-timeout", type=float, default=3.0, help="Seconds before a hang is acted on (3).")
    parser.add_argument("--ckpt-every", type=int, default=20, help="torchrun checkpoint interval in steps (20).")
    parser.add_argument("--timeout", type=float, default=900.0, help="Seconds one launcher's run may take (900).")
    args = parser.parse_args()
    args.kinds = tuple(k for k in args.kinds.split(",") if k)
    if not set(args.kinds) <= {"kill", "hang", "xid"}:
        parser.error("--kinds: choose among kill, hang, xid")
    return args


@dataclass
class Commit:
    """One step committed, as rank 0 printed it."""

    step: int
    t: float
    world: int
    attempt: int


@dataclass
class Fault:
    """One injected fault and what followed it."""

    kind: str
    rank: int
    at: float  # time.time() of the fault
    last_before: int  # highest step committed before it
    resumed_at: int | None = None  # first step committed after recovery
    recovered_at: float | None = None  # t of that commit

    @property
    def latency(self) -> float | None:
        """Fault to first step committed after recovery, seconds."""
        return None if self.recovered_at is None else self.recovered_at - self.at

    @property
    def recomputed(self) -> int:
        """Steps committed before the fault and again after it."""
        return 0 if self.resumed_at is None else max(0, self.last_before - self.resumed_at + 1)


@dataclass
class Result:
    """One launcher's run under the schedule."""

    launcher: str
    commits: list[Commit] = field(default_factory=list)
    faults: list[Fault] = field(default_factory=list)
    ended: float = 0.0  # time.time() the measurement stopped

    @property
    def useful(self) -> float:
        """Seconds of committed step time that count: each step's last commit, timed as the gap to the
        commit before it, or as the median step when a recovery or restart lies between them."""
        last_index = {c.step: i for i, c in enumerate(self.commits)}
        durations = [b.t - a.t for a, b in zip(self.commits, self.commits[1:]) if _same_run(a, b)]
        median = statistics.median(durations)
        useful = 0.0
        for i in sorted(last_index.values()):
            if i == 0:
                continue
            previous, commit = self.commits[i - 1], self.commits[i]
            useful += commit.t - previous.t if _same_run(previous, commit) else median
        return useful

    @property
    def ettr(self) -> float:
        """Goodput: useful committed step time / wall time from the first commit to the end."""
        return self.useful / self.wall

    @property
    def wall(self) -> float:
        """Seconds from the first committed step to the end of the measurement."""
        return self.ended - self.commits[0].t


def _same_run(a: Commit, b: Commit) -> bool:
    """Whether ``b`` is the step right after ``a`` in the same world and attempt (no recovery between)."""
    return (b.step, b.world, b.attempt) == (a.step + 1, a.world, a.attempt)


class Injector:
    """Delivers faults to one launcher's job."""

    def __init__(self, launcher: str, launcher_pid: int, hang_timeout: float) -> None:
        self.launcher = launcher
        self.launcher_pid = launcher_pid
        self.hang_timeout = hang_timeout
        self.job: inject.Job | None = None

    def inject(self, kind: str, rank: int) -> float:
        """Inject a fault of ``kind`` into ``rank``; the time.time() it took effect."""
        if self.launcher == "ftrun":
            return self._through_agent(kind, rank)
        pid = worker_with_rank(self.launcher_pid, rank, TRAIN.name).pid
        at = time.time()
        if kind == "hang":
            os.kill(pid, signal.SIGSTOP)
            threading.Timer(self.hang_timeout + DUMP_GRACE, _kill_quietly, (pid,)).start()
        else:  # kill, and xid: the driver forces the process off the faulted GPU
            os.kill(pid, signal.SIGKILL)
        return at

    def _through_agent(self, kind: str, rank: int) -> float:
        if self.job is None:
            (entry,) = [e for e in registry.running() if e.pid == self.launcher_pid]
            self.job = inject.Job.connect(connect_job(entry.endpoint, entry.secret, connect_timeout=STORE_START_WAIT))
        try:
            return self.job.inject(inject.chaos_message(kind, rank))["time"]
        except UsageError as exc:
            sys.exit(f"bench_chaos: ftrun refused the {kind} drill: {exc}")


def _kill_quietly(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def measure(launcher: str, args: argparse.Namespace) -> Result:
    """Run the training under ``launcher`` with the schedule's faults for --duration seconds of uptime."""
    flags = (["--respawn", "--hang-timeout", str(args.hang_timeout)] if launcher == "ftrun"
             else ["--max-restarts", "1000"])
    module = "ftrun" if launcher == "ftrun" else "torch.distributed.run"
    with tempfile.TemporaryDirectory(prefix="bench_chaos_") as ckpt_dir:
        run = start([sys.executable, "-m", module, "--standalone", "--nproc-per-node", str(WORLD), *flags,
                     str(TRAIN), "--steps", "10000000", "--ckpt-every", str(args.ckpt_every), "--ckpt-dir", ckpt_dir])
        try:
            return follow(launcher, run, args)
        finally:
            stop(run)


def follow(launcher: str, run: Run, args: argparse.Namespace) -> Result:
    """Read the run's step lines; inject each fault after its uptime gap; stop after --duration of uptime."""
    result = Result(launcher)
    injector = Injector(launcher, run.proc.pid, args.hang_timeout)
    schedule = inject.ChaosSchedule(args.mtbf, args.kinds, args.seed)
    uptime, up_since = 0.0, None
    fault: Fault | None = None
    before: Commit | None = None  # the last commit before the current fault
    next_at, kind, rank = schedule.next(range(WORLD))  # the next fault: at this much uptime
    for _, line in lines(run, args.timeout):
        match = TRAIN_LINE.search(line)
        if not match:
            continue
        commit = Commit(int(match[1]), float(match[2]), int(match[3]), int(match[4]))
        result.commits.append(commit)
        now = time.time()
        if fault is not None and fault.resumed_at is None and commit.t > fault.at and (
                commit.world, commit.attempt) != (before.world, before.attempt):
            fault.resumed_at, fault.recovered_at = commit.step, commit.t
        if up_since is None:
            if commit.world == WORLD and (fault is None or fault.resumed_at is not None):
                up_since = now  # back at full strength: the uptime clock runs again
            continue
        if uptime + now - up_since >= args.duration:
            break
        if uptime + now - up_since >= next_at:
            uptime += now - up_since
            up_since, before = None, commit
            last = max(c.step for c in result.commits)
            fault = Fault(kind, rank, injector.inject(kind, rank), last)
            result.faults.append(fault)
            print(f"  {launcher:8s} {uptime:6.1f} s of uptime: {kind} rank {rank}", flush=True)
            gap, kind, rank = schedule.next(range(WORLD))
            next_at += gap
    result.ended = time.time()
    return result


def schedule_text(args: argparse.Namespace) -> str:
    """The faults that fall within --duration seconds of uptime, as ``+9.3 s kill rank 2, ...``."""
    schedule, at, faults = inject.ChaosSchedule(args.mtbf, args.kinds, args.seed), 0.0, []
    while True:
        gap, kind, rank = schedule.next(range(WORLD))
        at += gap
        if at >= args.duration:
            return ", ".join(faults) or "none"
        faults.append(f"+{at:.1f} s {kind} rank {rank}")


def report(results: dict[str, Result], args: argparse.Namespace) -> None:
    """The side-by-side table."""
    def ratio(a: float | None, b: float | None) -> str:
        return f"{a / b:14.3f}" if a is not None and b else f"{'-':>14s}"

    print(f"\n{'':38s} {'torchrun':>12s} {'ftrun':>12s} {'ftrun/torchrun':>14s}")
    for label, value, form in (("goodput (ETTR)", "ettr", "12.3f"), ("useful step time (s)", "useful", "12.1f"),
                               ("wall time from first step (s)", "wall", "12.1f")):
        values = {name: getattr(r, value) for name, r in results.items()}
        print(f"{label:38s} {values['torchrun']:{form}} {values['ftrun']:{form}} "
              f"{ratio(values['ftrun'], values['torchrun'])}")
    survived = {name: f"{sum(f.resumed_at is not None for f in r.faults)}/{len(r.faults)}"
                for name, r in results.items()}
    print(f"{'faults survived':38s} {survived['torchrun']:>12s} {survived['ftrun']:>12s}")
    lost = {name: sum(f.recomputed for f in r.faults) for name, r in results.items()}
    print(f"{'steps recomputed (total)':38s} {lost['torchrun']:12d} {lost['ftrun']:12d}")
    for kind in args.kinds:
        values = {}
        for name, r in results.items():
            latencies = [f.latency for f in r.faults if f.kind == kind and f.latency is not None]
            values[name] = (statistics.median(latencies), max(latencies)) if latencies else None
        cells = [f"{v[0]:.2f}/{v[1]:.2f}" if v else "-" for v in (values["torchrun"], values["ftrun"])]
        medians = [v[0] if v else None for v in (values["ftrun"], values["torchrun"])]
        print(f"{'recovery latency ' + kind + ', median/max (s)':38s} {cells[0]:>12s} {cells[1]:>12s} "
              f"{ratio(*medians)}")
    print("\nper fault (kind rank: latency s, steps recomputed):")
    for name, r in results.items():
        faults = ", ".join(f"{f.kind} {f.rank}: {f.latency:.2f}/{f.recomputed}" if f.latency is not None
                          else f"{f.kind} {f.rank}: not recovered" for f in r.faults)
        print(f"  {name:8s} {faults}")
    print(f"\n{command_line()}")


def main() -> None:
    args = parse_args()
    print(f"chaos: {WORLD} workers, MTBF {args.mtbf:g} s of uptime, {args.duration:g} s of uptime per launcher, "
          f"kinds {','.join(args.kinds)}, seed {args.seed}, hang timeout {args.hang_timeout:g} s, torchrun "
          f"checkpoint every {args.ckpt_every} steps ({machine()})", flush=True)
    print(f"schedule: {schedule_text(args)}", flush=True)
    results = {launcher: measure(launcher, args) for launcher in LAUNCHERS}
    report(results, args)


if __name__ == "__main__":
    main()
