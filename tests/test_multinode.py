"""Several nodes on this machine: scheduler mode (one ftrun per node), -H with local hosts, a lost node."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import FTRUN

EXAMPLE = str(Path(__file__).resolve().parents[1] / "examples" / "train_ddp.py")
STEPS = 60
RTOL = 1e-5  # as in test_recovery: after a fault the sums run over fewer ranks, in another order
LOSS = re.compile(r"\]: step=(\d+) loss=(\S+)")


def losses(stdout: str) -> dict[int, float]:
    """Rank 0's loss per step, from the example's `step=N loss=X` lines."""
    return {int(m[1]): float(m[2]) for m in LOSS.finditer(stdout)}


def events(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines() if line.strip()]


@pytest.fixture(scope="module")
def baseline(run_ftrun) -> dict[int, float]:
    """The example on one node with 4 workers, fault-free."""
    result = run_ftrun("--nproc-per-node", "4", EXAMPLE, "--steps", STEPS, timeout=180)
    assert result.returncode == 0, result.stderr
    return losses(result.stdout)


def start_node(env: dict[str, str], node: int | None, port: int | None, *extra: str) -> subprocess.Popen:
    """One node of a 2-node job in scheduler mode, as a scheduler would start it (None: Slurm's defaults)."""
    where = [] if node is None else ["--node-rank", str(node), "--rdzv-endpoint", f"localhost:{port}"]
    return subprocess.Popen([*FTRUN, "--nnodes", "2", *where, "--nproc-per-node", "2", *extra, EXAMPLE,
                             "--steps", str(STEPS)], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_two_nodes_under_slurm_train_exactly_as_one_node_of_four(launcher_env, tmp_path, baseline):
    """Slurm's variables give each node its rank, and node 0's name for the store (on torchrun's port 29400)."""
    env = {**launcher_env, "XDG_CACHE_HOME": str(tmp_path), "SLURM_JOB_ID": "7",
           "SLURM_JOB_NODELIST": "localhost,127.0.0.1"}
    nodes = [start_node({**env, "SLURM_NODEID": str(rank)}, None, None) for rank in (1, 0)]  # follower first
    outputs = [node.communicate(timeout=180) for node in nodes]
    assert [node.returncode for node in nodes] == [0, 0], outputs
    follower, leader = (out for out, _ in outputs)
    assert losses(leader) == baseline  # same world size, same sums: bit for bit
    assert re.search(r"^\[\S+:2\]: ", follower, re.M)  # lines carry the host and the global rank
    assert not LOSS.search(follower)  # ranks 2 and 3 print nothing of their own in the example


def test_a_lost_node_is_evicted_and_the_other_nodes_workers_train_on(launcher_env, tmp_path, free_port, baseline):
    port = free_port()
    env = {**launcher_env, "XDG_CACHE_HOME": str(tmp_path)}
    follower = start_node(env, 1, port, "--node-timeout", "2")
    leader = start_node(env, 0, port, "--node-timeout", "2")
    lines = []
    for line in leader.stdout:
        lines.append(line)
        if "step=10 " in line and follower.poll() is None:
            follower.send_signal(signal.SIGKILL)  # the agent; its workers die with it (PDEATHSIG)
    assert leader.wait(timeout=120) == 0, leader.stderr.read()
    follower.wait()
    stderr = leader.stderr.read()
    assert "node 1 lost" in stderr and "0 steps lost" in stderr
    trained = losses("".join(lines))
    assert sorted(trained) == list(range(STEPS))
    assert all(trained[s] == pytest.approx(baseline[s], rel=RTOL) for s in range(STEPS))
    (run_dir,) = (tmp_path / "ftrun" / "runs").glob("none_*")
    log = events(run_dir)
    lost = next(e for e in log if e["event"] == "node_lost")
    assert lost["node"] == 1 and lost["ranks"] == [2, 3]
    (recovery,) = [e for e in log if e["event"] == "recovery"]
    assert recovery["lost_ranks"] == [2, 3] and recovery["world_after"] == 2 and recovery["steps_lost"] == 0
    assert recovery["phases"]["detect"] >= 1.0  # the lease had to run out first
    generations = [e for e in log if e["event"] == "generation"]
    assert len(generations) == 1  # both ranks of the node leave in one generation


def test_hostfile_with_local_hosts_starts_an_agent_per_host(run_ftrun, tmp_path, baseline):
    hostfile = tmp_path / "hosts"
    hostfile.write_text("localhost slots=2\n127.0.0.1 slots=2  # the same machine, by another name\n")
    result = run_ftrun("--hostfile", hostfile, EXAMPLE, "--steps", STEPS, timeout=180)
    assert result.returncode == 0, result.stderr
    assert losses(result.stdout) == baseline
    assert result.stderr.count(", attempt 0: 2 workers") == 2


@pytest.mark.parametrize("args, message", [
    (["--nnodes", "2"], "every node needs the store's address"),
    (["--nnodes", "1:2"], "a range of node counts is not supported"),
    (["--nnodes", "2", "--node-rank", "2", "--rdzv-endpoint", "h:1"], "--node-rank 2: must be between 0 and"),
    (["-H", "localhost", "--nnodes", "2"], "--hostfile/-H starts every node from here"),
    (["-H", "a,a"], "duplicate host 'a'"),
    (["--hostfile", "/nonexistent"], "cannot read hostfile /nonexistent"),
    (["--node-timeout", "0"], "--node-timeout must be a positive number"),
])
def test_bad_multinode_flags_get_one_line(run_ftrun, args, message):
    result = run_ftrun(*args, EXAMPLE)
    assert result.returncode == 2
    assert result.stderr.count("\n") == 1 and message in result.stderr, result.stderr


def test_slurm_node_lists_are_expanded():
    from ftrun.slurm import expand_nodelist, slurm_node

    assert expand_nodelist("gpu[01-03,07],login1") == ["gpu01", "gpu02", "gpu03", "gpu07", "login1"]
    assert expand_nodelist("a1,b[9-10]") == ["a1", "b9", "b10"]
    node = slurm_node({"SLURM_JOB_NODELIST": "n[1-4]", "SLURM_NODEID": "2"})
    assert (node.node_rank, node.nnodes, node.head) == (2, 4, "n1")
    assert slurm_node({"SLURM_NODEID": "2"}) is None
