"""Recovery from the loss of a whole node: two nodes x 2 workers on this machine, node 1's agent SIGKILLed.

Two ways the leader learns of it, ``--drills`` runs of each:

* ``hostfile``: ``ftrun -H localhost:2,127.0.0.1:2`` starts both agents; the launcher sees node 1's agent
  end and tells the leader through the store at once.
* ``lease``: scheduler mode (one ftrun per node, ``--node-timeout T``); nobody tells the leader, node 1's
  lease runs out after T seconds.

Each run trains examples/train_ddp.py; once rank 0 prints step ``--kill-at``, node 1's agent is SIGKILLed
(its workers die with it). The leader's ``recovery`` event gives the latency (the agent seen gone, or its
last lease renewal, to the first step committed without it), its phases and the steps lost. The run is
then stopped. torchrun has no in-place path to compare with: its answer to a lost node is a restart of
every worker from the last checkpoint (scripts/bench_recovery.py measures that for one lost worker).
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import sys
import tempfile
from pathlib import Path

import psutil

from bench_runs import ROOT, command_line, ended, lines, machine, start, stop

sys.path.insert(0, str(ROOT))

from ftrun.store.auth import new_secret, write_secret_file  # noqa: E402

EXAMPLE = str(ROOT / "examples" / "train_ddp.py")
FTRUN = [sys.executable, "-m", "ftrun"]


def parse_args() -> argparse.Namespace:
    """The benchmark's flags."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--drills", type=int, default=3, help="Runs per way of detection (3).")
    parser.add_argument("--kill-at", type=int, default=50, help="Kill node 1 once rank 0 printed this step (50).")
    parser.add_argument("--node-timeout", type=float, default=3.0, help="--node-timeout of the lease runs (3).")
    parser.add_argument("--timeout", type=float, default=180.0, help="Seconds one run may take (180).")
    return parser.parse_args()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def node_1_agent() -> psutil.Process:
    """The agent process of node 1 (an ftrun run with --node-rank 1)."""
    for process in psutil.process_iter(["cmdline"]):
        cmdline = process.info["cmdline"] or []
        if cmdline[1:3] == ["-m", "ftrun"] and "--node-rank" in cmdline \
                and cmdline[cmdline.index("--node-rank") + 1] == "1":
            return process
    raise RuntimeError("node 1's agent is not running")


def drill(how: str, args: argparse.Namespace) -> dict:
    """One run: kill node 1 at --kill-at, return the leader's recovery event."""
    with tempfile.TemporaryDirectory() as logs:
        training = ["--log-dir", logs, EXAMPLE, "--steps", "100000"]
        if how == "hostfile":
            runs = [start([*FTRUN, "-H", "localhost:2,127.0.0.1:2", *training])]
        else:
            port, timeout, secret = free_port(), str(args.node_timeout), Path(logs) / "secret"
            write_secret_file(secret, new_secret())  # the nodes of a job started one by one share it
            runs = [start([*FTRUN, "--nnodes", "2", "--node-rank", str(rank), "--rdzv-endpoint", f"localhost:{port}",
                           "--nproc-per-node", "2", "--node-timeout", timeout, *training],
                          {"FTRUN_SECRET_FILE": str(secret)}) for rank in (0, 1)]
        try:
            killed = False
            for _, line in lines(runs[0], args.timeout):
                if not killed and f"step={args.kill_at} " in line:
                    node_1_agent().kill()
                    killed = True
                elif killed and "ftrun: recovered from" in line:
                    break
            else:
                raise ended(runs[0])
        finally:
            for run in runs:
                stop(run)
        (log,) = [p for p in Path(logs).glob("*/events.jsonl")]
        return next(e for e in map(json.loads, log.read_text().splitlines()) if e["event"] == "recovery")


def main() -> None:
    """Run the drills and print one line per drill and the medians."""
    args = parse_args()
    print(f"{command_line()}\n{machine()}; node 1 of 2 (2 workers each) SIGKILLed at step {args.kill_at}")
    for how in ("hostfile", "lease"):
        events = [drill(how, args) for _ in range(args.drills)]
        for event in events:
            phases = " ".join(f"{k} {v * 1000:.0f}" for k, v in event["phases"].items())
            print(f"  {how:8} latency {event['latency']:.3f} s, world {event['world_before']} -> "
                  f"{event['world_after']}, {event['steps_lost']} steps lost (ms: {phases})")
        latency = statistics.median(e["latency"] for e in events)
        detect = statistics.median(e["phases"]["detect"] for e in events)
        lost = sum(e["steps_lost"] for e in events)
        print(f"{how}: median latency {latency:.3f} s (of which detection {detect:.3f} s), steps lost in all: {lost}")
    print(f"{machine()} at the end")


if __name__ == "__main__":
    main()
