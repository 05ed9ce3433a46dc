"""Node 0 lost: its agent and workers SIGKILLed together in a two-node job (scheduler mode, both nodes on this
machine). There is no leader failover yet, so the job cannot go on; what must hold is that node 1 notices
within about --node-timeout, stops its workers, and ends with one line that says what happened: with the
embedded store (gone with node 0) it fences; with etcd (which outlives node 0) it sees the leader's lease
run out."""

from __future__ import annotations

import os
import signal
import subprocess

import pytest

from conftest import FTRUN
from runs import TIMEOUT

NODE_TIMEOUT = "2"


@pytest.mark.parametrize("backend", ["embedded", "etcd"])
def test_node_1_ends_in_one_line_when_node_0_is_killed(backend, request, launcher_env, workload, free_port,
                                                       secret_file, tmp_path):
    if backend == "etcd":
        cluster = request.getfixturevalue("etcd_cluster")
        store = ["--rdzv-backend", "etcd-v2", "--rdzv-endpoint", cluster.endpoints, "--rdzv-id", "leader-loss"]
        node0_store = ["--master-addr", "127.0.0.1"]
    else:
        store, node0_store = ["--rdzv-endpoint", f"127.0.0.1:{free_port()}"], []
    env = {**launcher_env, "FTRUN_SECRET_FILE": secret_file}
    common = ["--nnodes", "2", "--nproc-per-node", "2", "--node-timeout", NODE_TIMEOUT, *store]
    training = [workload("faulty_train.py"), "--steps", "100000", "--width", "64"]
    node1 = subprocess.Popen([*FTRUN, *common, "--node-rank", "1", "--log-dir", str(tmp_path / "node1"), *training],
                             env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    node0 = subprocess.Popen([*FTRUN, *common, "--node-rank", "0", *node0_store, "--log-dir", str(tmp_path / "node0"),
                              *training], env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                             start_new_session=True)
    try:
        for line in node0.stdout:  # training is under way on both nodes
            if " step=3 " in line:
                break
        else:
            pytest.fail(f"node 0 ended before step 3 (exit {node0.wait()})")
        os.killpg(node0.pid, signal.SIGKILL)  # the agent and its workers (and the store it serves), at once
        node0.wait()
        _, err = node1.communicate(timeout=TIMEOUT)
    finally:
        for proc in (node0, node1):
            if proc.poll() is None:
                proc.kill()
    ended = [line for line in err.splitlines() if line.startswith("ftrun: node 1: ")]
    assert node1.returncode == 1 and len(ended) == 1, err[-3000:]
    if backend == "etcd":
        assert "node 0, the leader, has not renewed its lease" in ended[0], err[-3000:]
        # stopped, not fenced: its workers saved their committed state for a later --resume-from
        assert list((tmp_path / "node1").glob("**/rescue/*.pt")), err[-3000:]
    else:
        assert "could not renew this node's lease in node 0's store" in ended[0], err[-3000:]
