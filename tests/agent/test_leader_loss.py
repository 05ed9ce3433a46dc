"""Node 0 lost: its agent and workers SIGKILLed together (scheduler mode, every node on this machine), or node 0
cut off by the network (two namespace hosts). With the embedded store, which goes with node 0, the job cannot go
on: node 1 notices within about --node-timeout, stops its workers, and ends with one line that says what
happened. With etcd, which outlives node 0, the other nodes see the leader's lease run out, one is elected
leader through etcd and serves the process groups' store itself, and the workers recover in place without
node 0's: 0 steps lost, the fault-free run's losses."""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path

import psutil
import pytest

from conftest import FTRUN
from runs import RTOL, TIMEOUT, Run, read_run

NODE_TIMEOUT = "2"
STEPS = 40
TRAINING = ["--steps", str(STEPS), "--width", "256"]
"""held_train.py's training (HELD_TRAINING) cut short: its steps are the first 40 of the fault-free held run
(no schedule depends on the step count), so that run is the baseline."""


def kill_node_0(launcher_env: dict[str, str], secret_file: str, tmp_path: Path, store: list[str],
                node0_store: list[str], training: list[str], nnodes: int = 2,
                nproc: int = 2) -> list[subprocess.CompletedProcess]:
    """Start ``nnodes`` nodes of held_train.py's training, held (0.2 s a step) until node 0's agent and workers
    (and the store it serves) are SIGKILLed, once its workers have committed step 3; return the other nodes'
    finished processes."""
    hold = tmp_path / "hold"  # the job cannot run out of steps before node 0 is gone, however loaded the machine
    hold.touch()
    env = {**launcher_env, "FTRUN_SECRET_FILE": secret_file, "HOLD": str(hold)}
    common = ["--nnodes", str(nnodes), "--nproc-per-node", str(nproc), "--node-timeout", NODE_TIMEOUT, *store]
    others = [subprocess.Popen([*FTRUN, *common, "--node-rank", str(node), "--log-dir", str(tmp_path / f"node{node}"),
                                *training], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
              for node in range(1, nnodes)]
    node0 = subprocess.Popen([*FTRUN, *common, "--node-rank", "0", *node0_store, "--log-dir", str(tmp_path / "node0"),
                              *training], env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                             start_new_session=True)
    try:
        for line in node0.stdout:  # training is under way on every node
            if " step=3 " in line:
                break
        else:
            pytest.fail(f"node 0 ended before step 3 (exit {node0.wait()})")
        os.killpg(node0.pid, signal.SIGKILL)  # the agent and its workers (and the store it serves), at once
        node0.wait()
        hold.unlink()
        outputs = [proc.communicate(timeout=TIMEOUT) for proc in others]
    finally:
        for proc in (node0, *others):
            if proc.poll() is None:
                proc.kill()
    return [subprocess.CompletedProcess(proc.args, proc.returncode, *out) for proc, out in zip(others, outputs)]


def test_with_the_embedded_store_node_1_ends_in_one_line(launcher_env, workload, free_port, secret_file, tmp_path):
    (node1,) = kill_node_0(launcher_env, secret_file, tmp_path, ["--rdzv-endpoint", f"127.0.0.1:{free_port()}"], [],
                           [workload("held_train.py"), "--steps", "100000", "--width", "64"])
    ended = [line for line in node1.stderr.splitlines() if line.startswith("ftrun: node 1: ")]
    assert node1.returncode == 1 and len(ended) == 1, node1.stderr[-3000:]
    assert "could not renew this node's lease in node 0's store" in ended[0], node1.stderr[-3000:]


def test_with_etcd_another_node_is_elected_leader_and_the_workers_train_on_in_place(
        launcher_env, workload, secret_file, tmp_path, etcd_cluster, held_baseline):
    # three nodes of one worker: one of nodes 1 and 2 is elected, the other follows it (two nodes of two, where
    # node 1 can only elect itself, are drilled below with node 0 cut off instead of killed)
    nnodes, nproc = 3, 1
    store = ["--rdzv-backend", "etcd-v2", "--rdzv-endpoint", etcd_cluster.endpoints, "--rdzv-id", "leader-lost"]
    results = kill_node_0(launcher_env, secret_file, tmp_path, store, ["--master-addr", "127.0.0.1"],
                          [workload("held_train.py"), *TRAINING], nnodes, nproc)
    runs = [read_run(result, next((tmp_path / f"node{node}").iterdir())) for node, result in enumerate(results, 1)]
    why = "\n".join(f"--- node {node}\n{run.explain()}" for node, run in enumerate(runs, 1))
    assert [run.returncode for run in runs] == [0] * (nnodes - 1), why
    # one term, one leader: the node elected says so, every other follows it
    elections = [(node, e["node"], e["term"]) for node, run in enumerate(runs, 1) for e in run.of("leader")]
    (leader,) = {elected for _, elected, _ in elections}
    assert sorted(node for node, _, _ in elections) == list(range(1, nnodes)) and {t for *_, t in elections} == {1}, why
    new_leader = runs[leader - 1]
    assert "this node was elected leader (term 1)" in new_leader.stderr, why
    (lost,) = new_leader.of("node_lost")
    assert (lost["node"], sorted(lost["ranks"])) == (0, list(range(nproc))), why
    (recovery,) = new_leader.of("recovery")
    assert sorted(recovery["lost_uids"]) == list(range(nproc)) and recovery["steps_lost"] == 0, why
    world = nnodes * nproc
    assert (recovery["world_before"], recovery["world_after"]) == (world, world - nproc), why
    for node, run in enumerate(runs, 1):  # each node's workers are the ones it started: recovered in place
        starts = [(e["uid"], e["pid"]) for e in run.of("worker_start") if e["node"] == node]
        exits = {e["uid"]: (e["pid"], e["exitcode"]) for e in run.of("worker_exit") if e["node"] == node}
        assert len(starts) == nproc and exits == {uid: (pid, 0) for uid, pid in starts}, why
        check_survivors(run, held_baseline, recovery["resumed_at_step"], (world, world - nproc), exact=world == 4)


def check_survivors(run: Run, baseline: dict[int, float], resumed: int, worlds: tuple[int, int], exact: bool) -> None:
    """A node's workers committed every step of the training (STEPS) once (the step in flight at the fault
    may be missing: a peer had committed it, and its state came from there) in a group of ``worlds`` ranks
    (before the fault, after), with the fault-free run's losses (4 workers, the same global batches): bit for
    bit before the fault when ``exact`` (the same world), else within RTOL (other ranks sum the same global
    batch in another order)."""
    why = run.explain()
    for uid, commits in run.commits().items():
        steps = [c.step for c in commits]
        assert steps == sorted(set(steps)) and set(range(STEPS)) - set(steps) <= {resumed - 1}, \
            f"uid {uid}\n{why}"
        for c in commits:
            before = c.step < resumed
            assert c.world == worlds[0 if before else 1], f"{c}\n{why}"
            expected = baseline[c.step] if before and exact else pytest.approx(baseline[c.step], rel=RTOL)
            assert c.loss == expected, f"{c}\n{why}"


def test_with_etcd_a_node_0_cut_off_fences_itself_and_node_1_leads_on(netns_hosts, launcher_env, workload, secret_file,
                                                                      tmp_path, held_baseline):
    """Node 0 alive but unplugged (its packets dropped, to etcd and to node 1 alike) at step 3: it cannot renew
    its lease in etcd, so it kills its own workers (within 3/4 of --node-timeout) before node 1, which sees
    the lease run out at --node-timeout, is elected and plans without them: never two leaders training."""
    from etcd_members import Cluster
    from netns import HOST_IFNAME

    (tmp_path / "etcd").mkdir()
    cluster = Cluster(tmp_path / "etcd", host=netns_hosts.gateway)  # in the root namespace, on the bridge
    hold = tmp_path / "hold"  # held until node 0 is cut off: the job cannot end first
    hold.touch()
    env = {**launcher_env, "FTRUN_SECRET_FILE": secret_file, "GLOO_SOCKET_IFNAME": HOST_IFNAME, "HOLD": str(hold)}
    common = ["--nnodes", "2", "--nproc-per-node", "2", "--node-timeout", NODE_TIMEOUT, "--rdzv-backend", "etcd-v2",
              "--rdzv-endpoint", cluster.endpoints, "--rdzv-id", "cut-off"]
    training = [workload("held_train.py"), *TRAINING]
    host0, host1 = netns_hosts.hosts
    node1 = subprocess.Popen([*host1.prefix, *FTRUN, *common, "--node-rank", "1", "--log-dir", str(tmp_path / "node1"),
                              *training], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    node0 = subprocess.Popen([*host0.prefix, *FTRUN, *common, "--node-rank", "0", "--master-addr", host0.address,
                              "--log-dir", str(tmp_path / "node0"), *training], env=env, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
    try:
        for line in node0.stdout:
            if " step=3 " in line:
                netns_hosts.cut(host0)
                hold.unlink()
                break
        else:
            pytest.fail(f"node 0 ended before step 3 (exit {node0.wait()}): {node0.stderr.read()[-3000:]}")
        out1, err1 = node1.communicate(timeout=TIMEOUT)
        _, err0 = node0.communicate(timeout=TIMEOUT)
    finally:
        for proc in (node0, node1):
            if proc.poll() is None:
                proc.kill()
        cluster.stop()
    run1 = read_run(subprocess.CompletedProcess(node1.args, node1.returncode, out1, err1),
                    next((tmp_path / "node1").iterdir()))
    run0 = read_run(subprocess.CompletedProcess(node0.args, node0.returncode, "", err0), tmp_path / "node0")
    why = f"--- node 0\n{run0.explain()}\n--- node 1\n{run1.explain()}"
    assert run1.returncode == 0 and run0.returncode != 0, why
    (fenced,) = run0.of("fenced")
    assert "could not renew this node's lease in etcd" in fenced["reason"], why
    assert not any(psutil.pid_exists(e["pid"]) for e in run0.of("worker_start")), why
    (elected,) = run1.of("leader")
    assert elected["node"] == 1 and elected["time"] > fenced["time"], why  # node 0 had stopped training first
    (recovery,) = run1.of("recovery")
    assert sorted(recovery["lost_uids"]) == [0, 1] and recovery["steps_lost"] == 0, why
    check_survivors(run1, held_baseline, recovery["resumed_at_step"], (4, 2), exact=True)
