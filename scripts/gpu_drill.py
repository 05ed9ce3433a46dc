"""One GPU, four workers: a SIGKILL recovered in place with the model, its gradients and the loss on CUDA.

Run by scripts/gpu_check.sh on a machine with a GPU. NCCL takes one rank per GPU, so the four workers share
the GPU on a data plane of Gloo for CUDA tensors only (``--backend cuda:gloo``: NCCL's device map, so a
collective on CPU tensors issued on the data plane raises, as it would on NCCL). Two runs of
examples/train_ddp.py under ftrun (``--nproc-per-node 4``, ``--steps`` steps): one without faults, one in
which this script SIGKILLs the worker of rank 2 once step ``--kill-at`` is committed. Checked, as the CPU
suite checks its drills:

* the job succeeded in its first attempt; the killed worker died of SIGKILL, every other worker ran to the
  end in the process it started in;
* one recovery event, from world 4 to 3, with 0 steps lost;
* every step committed once, with the fault-free run's loss (relative ``--rtol``: the survivors sum three
  shares of the gradient where the fault-free run summed four, in another order).

Prints the recovery's latency and phases, and one line: ``gpu drill: ok``.
"""

from __future__ import annotations

import argparse
import json
import re
import signal
import sys
import tempfile
from pathlib import Path

from bench_runs import ROOT, lines, start, stop, worker_with_rank

STEP = re.compile(r"\]: step=(\d+) loss=(\S+)$")
WORLD = 4
KILLED_RANK = 2


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30, help="Steps of each run (30).")
    parser.add_argument("--kill-at", type=int, default=10, help="Kill rank 2 once this step is committed (10).")
    parser.add_argument("--rtol", type=float, default=1e-5, help="Relative loss tolerance (1e-5).")
    parser.add_argument("--backend", default="cuda:gloo", help="The data plane's backend (cuda:gloo).")
    parser.add_argument("--timeout", type=float, default=150.0, help="Seconds one run may take (150).")
    return parser.parse_args()


def train(args: argparse.Namespace, log_dir: Path, kill_at: int | None) -> tuple[dict[int, list[float]], list[dict]]:
    """One run, which must succeed: the losses rank 0 printed per step, and its event log."""
    run = start([sys.executable, "-m", "ftrun", "--nproc-per-node", str(WORLD), "--log-dir", str(log_dir),
                 str(ROOT / "examples" / "train_ddp.py"), "--backend", args.backend, "--steps", str(args.steps)])
    losses: dict[int, list[float]] = {}
    try:
        for _, line in lines(run, args.timeout):
            if match := STEP.search(line):
                step = int(match.group(1))
                losses.setdefault(step, []).append(float(match.group(2)))
                if step == kill_at:
                    worker_with_rank(run.proc.pid, KILLED_RANK, "train_ddp.py").send_signal(signal.SIGKILL)
        code = run.proc.wait(timeout=30)
    finally:
        if run.proc.poll() is None:
            stop(run)
    (log,) = log_dir.glob("*/events.jsonl")
    events = [json.loads(line) for line in log.read_text().splitlines() if line.strip()]
    if code != 0:
        raise RuntimeError(f"exit {code}; last output:\n" + "\n".join(run.tail))
    return losses, events


def check(args: argparse.Namespace, baseline: dict[int, list[float]], losses: dict[int, list[float]],
          events: list[dict]) -> dict:
    """The drill's assertions; returns its recovery event."""
    def of(kind: str) -> list[dict]:
        return [e for e in events if e["event"] == kind]

    steps = list(range(args.steps))
    assert sorted(baseline) == steps and all(len(v) == 1 for v in baseline.values()), baseline
    assert sorted(losses) == steps and all(len(v) == 1 for v in losses.values()), f"steps lost or repeated: {losses}"
    for step in steps:
        ours, theirs = losses[step][0], baseline[step][0]
        assert abs(ours - theirs) <= args.rtol * abs(theirs), f"step {step}: loss {ours!r} vs fault-free {theirs!r}"
    assert [(e["attempt"], e["succeeded"]) for e in of("attempt_end")] == [(0, True)], of("attempt_end")
    starts = {e["uid"]: e["pid"] for e in of("worker_start")}
    exits = {e["uid"]: (e["pid"], e["exitcode"]) for e in of("worker_exit")}
    assert len(of("worker_start")) == WORLD, "a worker was restarted"
    for uid in range(WORLD):
        assert exits[uid] == (starts[uid], -9 if uid == KILLED_RANK else 0), (uid, exits[uid], starts[uid])
    (recovery,) = [r for r in of("recovery") if r["kind"] == "fault"]
    assert (recovery["world_before"], recovery["world_after"]) == (WORLD, WORLD - 1), recovery
    assert recovery["steps_lost"] == 0 and recovery["resumed_at_step"] > args.kill_at, recovery
    return recovery


def main() -> None:
    args = parse_args()
    with tempfile.TemporaryDirectory(prefix="ftrun-gpu-drill-") as tmp:
        baseline, _ = train(args, Path(tmp) / "fault-free", None)
        losses, events = train(args, Path(tmp) / "drill", args.kill_at)
    recovery = check(args, baseline, losses, events)
    phases = ", ".join(f"{k} {1000 * v:.1f} ms" for k, v in recovery["phases"].items())
    print(f"recovery of a SIGKILLed rank, model on a {args.backend} data plane: {1000 * recovery['latency']:.1f} ms"
          f" ({phases}); world 4 -> 3, steps lost {recovery['steps_lost']}, losses of {args.steps} steps within "
          f"{args.rtol:g} of the fault-free run", flush=True)
    print("gpu drill: ok", flush=True)


if __name__ == "__main__":
    main()
