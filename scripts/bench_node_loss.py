"""Recovery from the loss of a whole node: two nodes x 2 workers on this machine, node 1's agent SIGKILLed.

Two ways the leader learns of it, ``--drills`` runs of each:

* ``hostfile``: ``ftrun -H localhost:2,127.0.0.1:2`` starts both agents; the launcher sees node 1's agent
  end and tells the leader through the store at once.
* ``lease``: scheduler mode (one ftrun per node, ``--node-timeout T``); nobody tells the leader, node 1's
  lease runs out after T seconds.

* ``leader`` (with ``--etcd ENDPOINTS``): scheduler mode on the etcd backend, and the node lost is node 0,
  the leader, with its workers: the other node sees its etcd lease end, is elected leader, and its workers
  recover in place.

Each run trains examples/train_ddp.py; once rank 0 prints step ``--kill-at``, node 1's agent is SIGKILLed
(its workers die with it; ``leader``: node 0's agent and workers). The leader's ``recovery`` event gives the
latency (the agent seen gone, or its last lease renewal, to the first step committed without it), its phases
and the steps lost; ``kill->line`` is measured here, from the SIGKILL to the arrival of the leader's
``recovered`` line. The run is then stopped. torchrun has no in-place path to compare with: its answer to a lost node is a restart of
every worker from the last checkpoint (scripts/bench_recovery.py measures that for one lost worker).
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

import psutil

from bench_runs import ROOT, command_line, ended, lines, machine, start, stop

sys.path.insert(0, str(ROOT))

from ftrun.launcher import handoff  # noqa: E402
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
    parser.add_argument("--etcd", metavar="ENDPOINTS", help="Also drill the leader's loss on this etcd cluster.")
    return parser.parse_args()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def agent_of(node: int) -> psutil.Process:
    """The agent process of ``node``: an ftrun run with --node-rank ``node``, or a hostfile launcher's agent
    whose hand-off names it."""
    for process in psutil.process_iter(["cmdline"]):
        cmdline = process.info["cmdline"] or []
        if cmdline[1:3] != ["-m", "ftrun"]:
            continue
        if cmdline[3:4] == ["_agent"]:
            rank = handoff.decode(process.environ()[handoff.VARIABLE]).node_rank
        elif "--node-rank" in cmdline:
            rank = int(cmdline[cmdline.index("--node-rank") + 1])
        else:
            continue
        if rank == node:
            return process
    raise RuntimeError(f"node {node}'s agent is not running")


def kill_with_workers(agent: psutil.Process) -> float:
    """SIGKILL an agent and everything it started, at once; when (perf_counter)."""
    family = [agent, *agent.children(recursive=True)]
    killed = time.perf_counter()
    for process in family:
        process.kill()
    return killed


def drill(how: str, args: argparse.Namespace) -> tuple[dict, float]:
    """One run: kill node 1 (``leader``: node 0) at --kill-at; the leader's recovery event, and the seconds from
    the kill to the arrival of its ``recovered`` line."""
    with tempfile.TemporaryDirectory() as logs:
        training = ["--log-dir", logs, EXAMPLE, "--steps", "100000"]
        if how == "hostfile":
            runs = [start([*FTRUN, "-H", "localhost:2,127.0.0.1:2", *training])]
        else:
            port, timeout, secret = free_port(), str(args.node_timeout), Path(logs) / "secret"
            write_secret_file(secret, new_secret())  # the nodes of a job started one by one share it
            store = ["--rdzv-endpoint", f"localhost:{port}"] if how == "lease" else \
                ["--rdzv-backend", "etcd-v2", "--rdzv-endpoint", args.etcd, "--rdzv-id", f"bench-{port}",
                 "--master-addr", "127.0.0.1"]
            runs = [start([*FTRUN, "--nnodes", "2", "--node-rank", str(rank), *store, "--nproc-per-node", "2",
                           "--node-timeout", timeout, *training], {"FTRUN_SECRET_FILE": str(secret)})
                    for rank in (0, 1)]
        leader = runs[1] if how == "leader" else runs[0]  # the leader after the loss
        try:
            for _, line in lines(runs[0], args.timeout):  # rank 0 prints the steps
                if f"step={args.kill_at} " in line:
                    killed = kill_with_workers(agent_of(0 if how == "leader" else 1))
                    break
            else:
                raise ended(runs[0])
            for stamp, line in lines(leader, args.timeout):
                if "ftrun: recovered from" in line:
                    seen = stamp - killed
                    break
            else:
                raise ended(leader)
        finally:
            for run in runs:
                stop(run)
        log = next(Path(logs).glob("*/node1/events.jsonl" if how == "leader" else "*/events.jsonl"))
        event = next(e for e in map(json.loads, log.read_text().splitlines()) if e["event"] == "recovery")
        return event, seen


def main() -> None:
    """Run the drills and print one line per drill and the medians."""
    args = parse_args()
    print(f"{command_line()}\n{machine()}; node 1 of 2 (2 workers each) SIGKILLed at step {args.kill_at}")
    for how in ("hostfile", "lease", *(["leader"] if args.etcd else [])):
        results = [drill(how, args) for _ in range(args.drills)]
        events = [event for event, _ in results]
        for event, seen in results:
            phases = " ".join(f"{k} {v * 1000:.0f}" for k, v in event["phases"].items())
            print(f"  {how:8} latency {event['latency']:.3f} s, kill->line {seen:.3f} s, world "
                  f"{event['world_before']} -> {event['world_after']}, {event['steps_lost']} steps lost (ms: {phases})")
        latency = statistics.median(e["latency"] for e in events)
        detect = statistics.median(e["phases"]["detect"] for e in events)
        seen = statistics.median(seen for _, seen in results)
        lost = sum(e["steps_lost"] for e in events)
        print(f"{how}: median latency {latency:.3f} s (of which detection {detect:.3f} s), kill->line {seen:.3f} s, "
              f"steps lost in all: {lost}")
    print(f"{machine()} at the end")


if __name__ == "__main__":
    main()
