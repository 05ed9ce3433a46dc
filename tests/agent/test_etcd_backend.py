"""Jobs whose store is an etcd cluster (``--rdzv-backend etcd-v2``), against a real etcd member: in-place
recovery across two nodes with ftrun's keys in etcd, ``ftrun status`` / ``ftrun inject`` reaching a job by its
etcd URL, an etcd that does not answer, and a one-node job that outlives its etcd."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import psutil
import pytest

from conftest import EXAMPLE, FTRUN
from etcd_members import Cluster
from ftrun import cli
from ftrun.store.etcd import EtcdKeyValue
from ftrun.store.etcd_config import etcd_options
from runs import STEPS, TIMEOUT, TRAINING, agent_of_node, communicate, read_run
from test_leader_loss import check_survivors

DEADLINE = 60.0
"""Seconds a live job has to show what a test waits for."""


def etcd_flags(cluster, run_id: str) -> list[str]:
    return ["--rdzv-backend", "etcd-v2", "--rdzv-endpoint", cluster.endpoints, "--rdzv-id", run_id]


def keys_of(cluster, run_id: str) -> list[str]:
    return list(EtcdKeyValue(etcd_options(cluster.endpoints, run_id, {})).read_prefix(""))


def test_two_nodes_on_etcd_find_the_group_store_there_and_survive_a_lost_worker(
        launcher_env, workload, secret_file, tmp_path, baseline, etcd_cluster):
    # node 1 is given no address but etcd's: it learns there where node 0 serves the process groups' store
    env = {**launcher_env, "FTRUN_SECRET_FILE": secret_file, "FAULTS": "kill:5:100001"}
    common = ["--nnodes", "2", "--nproc-per-node", "2", *etcd_flags(etcd_cluster, "etcd-two-nodes")]
    nodes = [subprocess.Popen([*FTRUN, *common, "--node-rank", str(node), *(["--master-addr", "127.0.0.1"] * (node == 0)),
                               "--log-dir", str(tmp_path / f"node{node}"), workload("faulty_train.py"), *TRAINING],
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for node in (1, 0)]
    (out1, err1), (out0, err0) = (node.communicate(timeout=TIMEOUT) for node in nodes)
    leader = read_run(subprocess.CompletedProcess(nodes[1].args, nodes[1].returncode, out0, err0), tmp_path / "node0")
    why = f"{leader.explain()}\n--- node 1\n{err1[-3000:]}"
    assert (nodes[1].returncode, nodes[0].returncode) == (0, 0), why
    (recovery,) = leader.of("recovery")
    assert recovery["lost_uids"] == [100001] and recovery["steps_lost"] == 0, why
    assert (recovery["world_before"], recovery["world_after"]) == (4, 3), why
    commits = leader.commits()
    for uid in (0, 1):
        assert [c.step for c in commits[uid]] == list(range(STEPS)), why
        assert all(c.loss == pytest.approx(baseline[c.step]) for c in commits[uid]), why
    stored = keys_of(etcd_cluster, "etcd-two-nodes")
    assert {"ftrun/job", "ftrun/group_store", "ftrun/a0/gen", "ftrun/a0/plan/1", "ftrun/status/job"} <= set(stored)
    assert not [key for key in stored if not key.startswith("ftrun/")]  # the process groups' keys are elsewhere


def cli_run(capsys, *args: str) -> tuple[int, str]:
    """``ftrun ARGS`` in this process: exit code and stdout."""
    with pytest.raises(SystemExit) as exit_:
        cli.main(list(args))
    out, _ = capsys.readouterr()
    return exit_.value.code, out


def test_status_and_inject_reach_a_job_on_etcd_by_its_url(live_job, etcd_cluster, capsys, tmp_path):
    proc, entry = live_job("--nproc-per-node", "4", *etcd_flags(etcd_cluster, "etcd-live"), "--log-dir", tmp_path,
                           EXAMPLE, "--steps", "100000", "--width", "256")
    url, secret = entry.endpoint, str(Path(entry.run_dir, "secret"))
    assert url == f"etcd://{etcd_cluster.endpoints}/etcd-live"
    status = ("status", "--json", "--endpoint", url, "--secret-file", secret)
    deadline = time.monotonic() + DEADLINE
    while True:  # the leader writes its status record about once a second
        code, out = cli_run(capsys, *status)
        (doc,) = json.loads(out)["jobs"]
        if all(w["step"] is not None for w in doc["workers"]):
            break
        assert time.monotonic() < deadline, doc
    assert (doc["state"], doc["world_size"], doc["run_id"]) == ("running", 4, entry.run_id)
    code, out = cli_run(capsys, "inject", "kill", "--rank", "2", "--endpoint", url, "--secret-file", secret)
    assert code == 0, out
    while True:
        code, out = cli_run(capsys, *status)
        (doc,) = json.loads(out)["jobs"]
        if doc["recoveries"]["count"] == 1 and doc["state"] == "running":
            break
        assert time.monotonic() < deadline + DEADLINE, doc
    assert (doc["world_size"], doc["faults"], doc["faults_survived"]) == (3, 1, 1)
    assert proc.poll() is None


def test_an_etcd_that_does_not_answer_is_one_line(run_ftrun, workload, free_port):
    result = run_ftrun("--rdzv-backend", "etcd", "--rdzv-endpoint", f"127.0.0.1:{free_port()}", "--nproc-per-node",
                       "1", workload("faulty_train.py"), *TRAINING)
    # asked before GPU health or the fork server start: their notices would come first
    (error,) = result.stderr.splitlines()
    assert result.returncode == 2 and error.startswith("ftrun: error:") and "does not answer" in error, result.stderr


def test_a_one_node_job_finishes_when_its_etcd_goes_away(launcher_env, workload, tmp_path):
    # one node: ftrun's keys are only records there (the workers rendezvous through node 0's TCPStore), so
    # losing the whole etcd cluster mid-run costs the job its status records, not its training
    (tmp_path / "etcd").mkdir()
    cluster = Cluster(tmp_path / "etcd", size=1)
    try:
        hold = tmp_path / "hold"  # the job trains slowly until it is removed, so it cannot end before etcd does
        hold.touch()
        proc = subprocess.Popen([*FTRUN, "--nproc-per-node", "2", *etcd_flags(cluster, "etcd-gone"), "--log-dir",
                                 str(tmp_path / "logs"), workload("held_train.py"), "--steps", "40", "--width", "64"],
                                env={**launcher_env, "HOLD": str(hold)}, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)
        lines = []
        for line in proc.stdout:  # to its end: the member is killed once training is under way
            lines.append(line)
            if " step=3 " in line and hold.exists():
                cluster.stop()
                hold.unlink()
        proc.wait(TIMEOUT)
        err = proc.stderr.read()
    finally:
        cluster.stop()
    out = "".join(lines)
    assert proc.returncode == 0 and "Traceback" not in err, err[-3000:]
    assert " step=3 " in out and "step=39 " in out, out[-2000:]


def test_a_two_node_job_does_not_notice_the_loss_of_one_etcd_member_of_three(launcher_env, workload, secret_file,
                                                                          tmp_path):
    # the member killed is the first endpoint: the one every client of both agents (records, mailboxes, the
    # leases and node 1's watch of node 0's) talks to. They carry on against the other two: no node is fenced
    # or lost, no worker is touched, and training runs through at world 4. The leases' timeout must leave room
    # for etcd's own leader election (500 ms in these members, longer on a loaded machine) and the clients'
    # move to another member before a node fences (at 3/4 of it): 6 s here; ftrun's default is 10.
    (tmp_path / "etcd").mkdir()
    cluster = Cluster(tmp_path / "etcd", size=3)
    hold = tmp_path / "hold"  # held at 0.2 s a step: the job runs well past --node-timeout after the kill
    hold.touch()
    env = {**launcher_env, "FTRUN_SECRET_FILE": secret_file, "HOLD": str(hold)}
    common = ["--nnodes", "2", "--nproc-per-node", "2", "--node-timeout", "6", *etcd_flags(cluster, "member-lost")]
    training = [workload("held_train.py"), "--steps", "60", "--width", "64"]
    nodes = [subprocess.Popen([*FTRUN, *common, "--node-rank", str(node), *(["--master-addr", "127.0.0.1"] * (node == 0)),
                               "--log-dir", str(tmp_path / f"node{node}"), *training], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for node in (1, 0)]
    try:
        lines = []
        for line in nodes[1].stdout:  # node 0's, to its end
            lines.append(line)
            if " step=3 " in line and not hold.with_suffix(".killed").exists():
                cluster.members[0].kill()
                hold.with_suffix(".killed").touch()
            if " step=45 " in line:
                hold.unlink(missing_ok=True)  # 42 held steps (8.4 s) after the kill: on at full speed
        nodes[1].wait(TIMEOUT)
        _, err1 = nodes[0].communicate(timeout=TIMEOUT)
        err0 = nodes[1].stderr.read()
    finally:
        for node in nodes:
            if node.poll() is None:
                node.kill()
        cluster.stop()
    leader = read_run(subprocess.CompletedProcess(nodes[1].args, nodes[1].returncode, "".join(lines), err0),
                      tmp_path / "node0")
    why = f"{leader.explain()}\n--- node 1\n{err1[-3000:]}"
    assert hold.with_suffix(".killed").exists() and (nodes[1].returncode, nodes[0].returncode) == (0, 0), why
    for kind in ("fenced", "node_lost", "fault", "recovery", "group_failure"):
        assert not leader.of(kind), why
    node1_events = (tmp_path / "node1").glob("*/node1/events.jsonl")
    assert not [e for path in node1_events for e in map(json.loads, path.read_text().splitlines())
                if e["event"] in ("fenced", "fault")], why
    commits = leader.commits()
    for uid in (0, 1):
        assert [(c.step, c.world) for c in commits[uid]] == [(step, 4) for step in range(60)], why


def test_a_hostfile_launch_on_etcd_goes_on_without_node_0(launcher_env, workload, tmp_path, etcd_cluster,
                                                          held_baseline):
    # -H with etcd: node 0's agent serves the process groups' store on its host and the launcher serves
    # nothing, so node 0's agent and workers SIGKILLed at step 3 end neither the job nor the launch: node 1 is
    # elected, the workers recover in place, and the launch's exit code is the job's (0)
    hold, logs = tmp_path / "hold", tmp_path / "logs"  # held until node 0 is gone: the job cannot end first
    hold.touch()
    job = subprocess.Popen([*FTRUN, "-H", "localhost:2,127.0.0.1:2", "--node-timeout", "2",
                            *etcd_flags(etcd_cluster, "hostfile-etcd"), "--log-dir", str(logs),
                            workload("held_train.py"), "--steps", "40", "--width", "256"],
                           env={**launcher_env, "HOLD": str(hold)}, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                           text=True)
    lines = []
    try:
        for line in job.stdout:
            lines.append(line)
            if " step=3 " in line:
                break
        node0 = agent_of_node(0, logs)
        workers = [e["pid"] for e in read_events(logs) if e["event"] == "worker_start" and e["node"] == 0]
        os.killpg(node0.pid, signal.SIGKILL)  # its agent, fork server and workers, at once
        hold.unlink()
        out, err = communicate(job, TIMEOUT)
    finally:
        if job.poll() is None:
            job.kill()
    printed = ("".join(lines) + out).splitlines(keepends=True)
    survivors = "".join(line for line in printed if " uid=10000" in line)  # node 1's workers' commits
    run = read_run(subprocess.CompletedProcess(job.args, job.returncode, survivors, err), next(logs.iterdir()))
    why = run.explain()
    assert job.returncode == 0, why
    assert "ftrun: node 0: the agent on localhost ended: killed by SIGKILL" in err, why
    assert not any(psutil.pid_exists(pid) for pid in workers), why
    (elected,) = run.of("leader")
    assert (elected["node"], elected["term"]) == (1, 1), why
    (recovery,) = run.of("recovery")
    assert sorted(recovery["lost_uids"]) == [0, 1] and recovery["steps_lost"] == 0, why
    check_survivors(run, held_baseline, recovery["resumed_at_step"], (4, 2), exact=True)
    stored = keys_of(etcd_cluster, "hostfile-etcd")
    assert {"ftrun/job", "ftrun/group_store", "ftrun/leader/1"} <= set(stored), stored


def read_events(logs: Path) -> list[dict]:
    """Node 0's events so far (its run directory under ``logs``)."""
    (log,) = logs.glob("*/events.jsonl")
    return [json.loads(line) for line in log.read_text().splitlines() if line.strip()]
