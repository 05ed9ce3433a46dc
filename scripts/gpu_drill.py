"""One GPU, four workers: a SIGKILLed worker recovered in place, with the model, its gradients and the loss on
CUDA; then the same with ``--respawn``, where the replacement receives the CUDA state from a peer.

Run by scripts/gpu_check.sh on a machine with a GPU. NCCL takes one rank per GPU, so the four workers share
the GPU on a data plane of Gloo for CUDA tensors only (``--backend cuda:gloo``: NCCL's device map, so a
collective on CPU tensors issued on the data plane raises, as it would on NCCL; Gloo moves CUDA tensors
point to point through host memory, ``transfer.via_host``). Three runs of examples/train_ddp.py under ftrun
(``--nproc-per-node 4``, ``--steps`` steps): one without faults, then two in which this script SIGKILLs the
worker of rank 2 once step ``--kill-at`` is committed: the survivors go on as three, and with ``--respawn`` a
replacement joins and takes the state from a peer (world 3 -> 4). Checked, as the CPU suite checks its
drills:

* the job succeeded in its first attempt; the killed worker died of SIGKILL, every other worker ran to the
  end in the process it started in;
* the recoveries recorded (4 -> 3; then 3 -> 4 with the replacement), each with 0 steps lost;
* every step committed once, with the fault-free run's loss (relative ``--rtol``: the survivors sum three
  shares of the gradient where the fault-free run summed four, in another order).

Prints each recovery's latency and phases, and one line: ``gpu drill: ok``.
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
REPLACEMENT = WORLD  # the uid of the respawned worker


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200, help="Steps of each run (200: time for a replacement "
                                                               "to start and join).")
    parser.add_argument("--kill-at", type=int, default=10, help="Kill rank 2 once this step is committed (10).")
    parser.add_argument("--rtol", type=float, default=1e-5, help="Relative loss tolerance (1e-5).")
    parser.add_argument("--backend", default="cuda:gloo", help="The data plane's backend (cuda:gloo).")
    parser.add_argument("--timeout", type=float, default=150.0, help="Seconds one run may take (150).")
    return parser.parse_args()


def train(args: argparse.Namespace, log_dir: Path, kill_at: int | None,
          flags: list[str]) -> tuple[dict[int, list[float]], list[dict]]:
    """One run, which must succeed: the losses rank 0 printed per step, and its event log."""
    run = start([sys.executable, "-m", "ftrun", "--nproc-per-node", str(WORLD), "--log-dir", str(log_dir), *flags,
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
          events: list[dict], respawned: bool) -> list[dict]:
    """The drill's assertions; returns its recovery events."""
    def of(kind: str) -> list[dict]:
        return [e for e in events if e["event"] == kind]

    steps = list(range(args.steps))
    assert sorted(baseline) == steps and all(len(v) == 1 for v in baseline.values()), baseline
    assert sorted(losses) == steps and all(len(v) == 1 for v in losses.values()), f"steps lost or repeated: {losses}"
    for step in steps:
        ours, theirs = losses[step][0], baseline[step][0]
        assert abs(ours - theirs) <= args.rtol * abs(theirs), f"step {step}: loss {ours!r} vs fault-free {theirs!r}"
    assert [(e["attempt"], e["succeeded"]) for e in of("attempt_end")] == [(0, True)], of("attempt_end")
    uids = [*range(WORLD), *([REPLACEMENT] if respawned else [])]
    starts = {e["uid"]: e["pid"] for e in of("worker_start")}
    assert sorted(starts) == uids and len(of("worker_start")) == len(uids), f"workers started: {of('worker_start')}"
    exits = {e["uid"]: (e["pid"], e["exitcode"]) for e in of("worker_exit")}
    for uid in uids:
        assert exits.get(uid) == (starts[uid], -9 if uid == KILLED_RANK else 0), (uid, exits.get(uid), starts[uid])
    recoveries = of("recovery")
    expected = [("fault", WORLD, WORLD - 1)] + ([("join", WORLD - 1, WORLD)] if respawned else [])
    assert [(r["kind"], r["world_before"], r["world_after"]) for r in recoveries] == expected, \
        f"recoveries {recoveries} (a replacement not placed before the end needs more --steps)"
    assert all(r["steps_lost"] == 0 for r in recoveries) and recoveries[0]["resumed_at_step"] > args.kill_at, recoveries
    return recoveries


def main() -> None:
    args = parse_args()
    results = []
    with tempfile.TemporaryDirectory(prefix="ftrun-gpu-drill-") as tmp:
        baseline, _ = train(args, Path(tmp) / "fault-free", None, [])
        for name, flags in (("shrink", []), ("respawn", ["--respawn"])):
            losses, events = train(args, Path(tmp) / name, args.kill_at, flags)
            results += check(args, baseline, losses, events, respawned=bool(flags))
    for recovery in results:
        phases = ", ".join(f"{k} {1000 * v:.1f} ms" for k, v in recovery["phases"].items())
        print(f"recovery ({recovery['kind']}, world {recovery['world_before']} -> {recovery['world_after']}), "
              f"data plane {args.backend}: {1000 * recovery['latency']:.1f} ms ({phases}); steps lost "
              f"{recovery['steps_lost']}", flush=True)
    print(f"losses of {args.steps} steps within {args.rtol:g} of the fault-free run in both drills", flush=True)
    print("gpu drill: ok", flush=True)


if __name__ == "__main__":
    main()
