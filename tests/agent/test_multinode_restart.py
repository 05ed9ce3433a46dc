"""Group restarts across nodes (torchrun's --max-restarts, with several nodes) and how a follower ends: two
nodes in scheduler mode on this machine, each with 2 workers of the example's training."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from conftest import FTRUN
from runs import RTOL, STEPS, TIMEOUT, TRAINING, Run, read_run


def two_nodes(launcher_env: dict[str, str], secret_file: str, store: list[str], tmp_path: Path, script: str,
              faults: str, *flags: str) -> tuple[Run, Run]:
    """Run a 2-node job (node 1 started first) to its end, its store named by the flags ``store``: node 0's run
    and node 1's."""
    env = {**launcher_env, "FTRUN_SECRET_FILE": secret_file, "FAULTS": faults}
    common = ["--nnodes", "2", "--nproc-per-node", "2", "--master-addr", "127.0.0.1", *store, *flags]
    nodes = [subprocess.Popen([*FTRUN, *common, "--node-rank", str(node), "--log-dir", str(tmp_path / f"node{node}"),
                               script, *TRAINING], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for node in (1, 0)]
    try:
        outputs = [node.communicate(timeout=TIMEOUT) for node in nodes]
    finally:
        for node in nodes:
            if node.poll() is None:
                node.kill()
    follower, leader = (subprocess.CompletedProcess(node.args, node.returncode, *out) for node, out in zip(nodes, outputs))
    node1 = read_run(follower, tmp_path / "node1" / next((tmp_path / "node1").iterdir()).name)
    return read_run(leader, tmp_path / "node0"), node1


@pytest.mark.parametrize("backend", ["embedded", "etcd"])
def test_a_group_restart_spans_every_node_and_resumes_from_the_state_saved_on_one(
        launcher_env, secret_file, free_port, tmp_path, workload, baseline, backend, request):
    # both of node 1's workers die at step 5: 2 of 4 left, below --min-nproc 4, and no joiner comes, so the
    # live workers (node 0's) save step 4 and the group restarts on both nodes. Node 1 has nothing saved:
    # its new workers must take node 0's state, not start from scratch. On both stores: with etcd the
    # verdict and the next attempt's plans go through etcd, the process groups through node 0's TCPStore.
    if backend == "etcd":
        store = ["--rdzv-backend", "etcd-v2", "--rdzv-endpoint", request.getfixturevalue("etcd_cluster").endpoints,
                 "--rdzv-id", f"restart-{free_port()}"]
    else:
        store = ["--rdzv-endpoint", f"127.0.0.1:{free_port()}"]
    leader, node1 = two_nodes(launcher_env, secret_file, store, tmp_path, workload("faulty_train.py"),
                              "kill:5:100000,kill:5:100001", "--min-nproc", "4", "--join-timeout", "1",
                              "--max-restarts", "1")
    why = f"{leader.explain()}\n--- node 1\n{node1.explain()}"
    assert (leader.returncode, node1.returncode) == (0, 0), why
    assert [(e["attempt"], e["succeeded"]) for e in leader.of("attempt_end")] == [(0, False), (1, True)], why
    assert [(e["attempt"], e["succeeded"]) for e in node1.of("attempt_end")] == [(0, False), (1, True)], why
    assert "ftrun: node 1: the leader restarts the group (restart 1 of 1)" in node1.stderr, why
    (rescue,) = leader.of("rescue")
    assert rescue["best_step"] == 4, why  # the last step committed before the fault: nothing committed is lost
    assert not list(node1.run_dir.glob("rescue/*.pt")), why  # node 1's workers died before they could save
    # the survivors of attempt 0 kept running until the rescue; attempt 1 has new processes everywhere
    starts = {(e["attempt"], e["uid"]): e["pid"] for run in (leader, node1) for e in run.of("worker_start")}
    assert {uid for attempt, uid in starts if attempt == 1} == {0, 1, 100000, 100001}, why
    assert not {pid for (attempt, _), pid in starts.items() if attempt == 1} & \
        {pid for (attempt, _), pid in starts.items() if attempt == 0}, why
    # every rank of attempt 1 resumes at step 5 and trains on with the fault-free run's losses
    for run, uids in ((leader, (0, 1)), (node1, (100000, 100001))):
        commits = run.commits(attempt=1)
        for uid in uids:
            assert [c.step for c in commits[uid]] == list(range(5, STEPS)), why
            assert all(c.world == 4 and c.loss == pytest.approx(baseline[c.step], rel=RTOL)
                       for c in commits[uid]), why
    (resumed,) = leader.of("resumed")
    assert (resumed["attempt"], resumed["step"]) == (1, 5), why


def test_every_node_ends_with_exit_1_and_one_line_when_the_job_fails(launcher_env, secret_file, free_port, tmp_path,
                                                                   workload):
    # a node 1 worker dies and nothing may recover it: the leader's failure is node 1's too (it used to end
    # with exit code 0, its own workers having only been stopped)
    leader, node1 = two_nodes(launcher_env, secret_file, ["--rdzv-endpoint", f"127.0.0.1:{free_port()}"], tmp_path,
                              workload("faulty_train.py"), "kill:3:100001", "--no-recovery")
    why = f"{leader.explain()}\n--- node 1\n{node1.explain()}"
    assert (leader.returncode, node1.returncode) == (1, 1), why
    ended = [line for line in node1.stderr.splitlines() if line.startswith("ftrun: node 1: ")]
    pid = next(e["pid"] for e in node1.of("worker_start") if e["uid"] == 100001)
    assert ended == [f"ftrun: node 1: the leader stopped: worker failure: rank 3 (local rank 1, pid {pid}) ended "
                     "with signal SIGKILL"], why
    assert [e["outcome"] for e in node1.of("end")] == ["failed"], why
