"""Several nodes on this machine: scheduler mode (one ftrun per node), -H with local hosts, a lost node."""

from __future__ import annotations

import json
import re
import shlex
import signal
import subprocess
from pathlib import Path

import psutil
import pytest

from conftest import EXAMPLE, FTRUN
from runs import agent_of_node
from netns import HOST_IFNAME

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


def test_two_nodes_under_slurm_train_exactly_as_one_node_of_four(launcher_env, tmp_path, baseline, secret_file):
    """Slurm's variables give each node its rank, and node 0's name for the store (on torchrun's port 29400)."""
    env = {**launcher_env, "XDG_CACHE_HOME": str(tmp_path), "SLURM_JOB_ID": "7",
           "SLURM_JOB_NODELIST": "localhost,127.0.0.1", "FTRUN_SECRET_FILE": secret_file}
    nodes = [start_node({**env, "SLURM_NODEID": str(rank)}, None, None) for rank in (1, 0)]  # follower first
    outputs = [node.communicate(timeout=180) for node in nodes]
    assert [node.returncode for node in nodes] == [0, 0], outputs
    follower, leader = (out for out, _ in outputs)
    assert losses(leader) == baseline  # same world size, same sums: bit for bit
    assert re.search(r"^\[\S+:0\]: step=0 ", leader, re.M)  # lines carry the host and the global rank
    assert not LOSS.search(follower)  # ranks 2 and 3 print nothing of their own in the example


def hostfile_job(network, ssh_keys, tmp_path: Path, env: dict[str, str], *extra: str, slots: int = 2) -> \
        subprocess.Popen:
    """`ftrun --hostfile` over the namespace hosts, through their real sshd, with the store on the bridge."""
    hosts = tmp_path / "hosts"
    hosts.write_text("".join(f"{host.address} slots={slots}\n" for host in network.hosts))
    env = {**env, "GLOO_SOCKET_IFNAME": HOST_IFNAME, "FTRUN_SSH_OPTS": shlex.join(ssh_keys.client_options())}
    return subprocess.Popen([*FTRUN, "--hostfile", str(hosts), "--master-addr", network.gateway, "--log-dir",
                             str(tmp_path / "logs"), *extra, EXAMPLE, "--steps", str(STEPS)],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def run_until(proc: subprocess.Popen, step: int, action) -> str:
    """Read the job's stdout to its end, calling ``action`` once when rank 0 reports ``step``."""
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if f"step={step} " in line:
            action()
    return "".join(lines)


def check_node_1_evicted(stdout: str, run_dir: Path, baseline: dict[int, float]) -> dict:
    """Node 0's workers trained every step with the baseline's losses, after one recovery without node 1."""
    trained = losses(stdout)
    log = events(run_dir)
    (recovery,) = [e for e in log if e["event"] == "recovery"]
    assert recovery["lost_ranks"] == [2, 3] and recovery["world_after"] == 2 and recovery["steps_lost"] == 0
    # rank 0 may have aborted the step in flight that a peer had committed: it then took that step's state
    # from the peer, so that step, and only that one, may be missing from its lines (see tests/runs.py)
    assert set(trained) <= set(range(STEPS)), trained
    assert set(range(STEPS)) - set(trained) <= {recovery["resumed_at_step"] - 1}, trained
    assert all(loss == pytest.approx(baseline[s], rel=RTOL) for s, loss in trained.items())
    return next(e for e in log if e["event"] == "node_lost")


def test_hostfile_over_ssh_trains_across_hosts_and_survives_a_killed_node(netns_hosts, ssh_keys, launcher_env,
                                                                         tmp_path, baseline):
    """Two namespace hosts x 2 workers through ssh; node 1's agent SIGKILLed at step 10 (its workers die with
    it): its ssh session ends, the launcher tells the leader at once, node 0's workers train on."""
    job = hostfile_job(netns_hosts, ssh_keys, tmp_path, launcher_env)
    stdout = run_until(job, 10, lambda: agent_of_node(1, tmp_path / "logs").kill())  # this job's, not another test's
    stderr = job.stderr.read()
    assert job.wait(timeout=120) == 0, stderr
    assert re.search(rf"^\[{re.escape(netns_hosts.hosts[0].address)}:0\]: step=0 ", stdout, re.M)
    (run_dir,) = (tmp_path / "logs").iterdir()
    lost = check_node_1_evicted(stdout, run_dir, baseline)
    assert "agent on" in lost["reason"] and "node 1" in stderr
    (recovery,) = [e for e in events(run_dir) if e["event"] == "recovery"]
    assert recovery["phases"]["detect"] < 5  # told by the launcher, well before the 10 s lease ran out


def test_a_partitioned_node_fences_itself_and_the_others_train_on(netns_hosts, ssh_keys, launcher_env, tmp_path,
                                                                  baseline):
    """Node 1's link is cut at step 10: it cannot renew its lease, so it kills its own workers; the leader
    sees the lease run out and node 0's workers recover in place."""
    host = netns_hosts.hosts[1]
    job = hostfile_job(netns_hosts, ssh_keys, tmp_path, launcher_env, "--node-timeout", "3")
    stdout = run_until(job, 10, lambda: netns_hosts.cut(host))
    stderr = job.stderr.read()
    assert job.wait(timeout=120) == 0, stderr
    (run_dir,) = (tmp_path / "logs").iterdir()
    lost = check_node_1_evicted(stdout, run_dir, baseline)
    assert "lease expired" in lost["reason"]
    node1 = events(run_dir / "node1")
    fenced = next(e for e in node1 if e["event"] == "fenced")
    assert "could not renew this node's lease" in fenced["reason"]
    pids = [e["pid"] for e in node1 if e["event"] == "worker_start"]
    assert len(pids) == 2 and not any(psutil.pid_exists(pid) for pid in pids)


def test_a_link_that_drops_every_packet_between_two_live_hosts_excludes_one(netns_hosts, ssh_keys, launcher_env,
                                                                          tmp_path, baseline):
    """One worker on each namespace host; at step 10 every packet between the hosts is dropped while both
    still reach the store. The collective stalls on both; once every rank has waited past the hang timeout
    the leader re-forms them with a probe, which finds the broken link, and excludes the later rank: rank 0
    trains on alone, every step once, with the baseline's losses."""
    first, second = netns_hosts.hosts
    job = hostfile_job(netns_hosts, ssh_keys, tmp_path, launcher_env, "--hang-timeout", "3", slots=1)
    stdout = run_until(job, 10, lambda: netns_hosts.drop_between(first, second))
    stderr = job.stderr.read()
    assert job.wait(timeout=180) == 0, stderr
    trained = losses(stdout)
    assert sorted(trained) == list(range(STEPS)) and all(
        trained[s] == pytest.approx(baseline[s], rel=RTOL) for s in range(STEPS)), stdout
    (run_dir,) = (tmp_path / "logs").iterdir()
    log = events(run_dir)
    links = [(e["action"], e["ranks"]) for e in log if e["event"] == "link_fault"]
    assert links == [("reform", []), ("exclude", [1])], stderr
    exclude = next(e for e in log if e["event"] == "link_fault" and e["action"] == "exclude")
    assert exclude["unreachable"] == {"0": [100000], "100000": [0]}, exclude
    recoveries = [e for e in log if e["event"] == "recovery"]
    assert [(r["kind"], r["world_after"], r["steps_lost"]) for r in recoveries] == [("link", 1, 0)], log
    starts = {e["uid"]: e["pid"] for e in log if e["event"] == "worker_start"}
    exits = {e["uid"]: e["exitcode"] for e in log if e["event"] == "worker_exit"}
    assert exits[0] == 0 and exits[100000] == -signal.SIGKILL and set(starts) == {0, 100000}, log


def test_ctrl_c_stops_every_agent_and_worker_on_every_host(netns_hosts, ssh_keys, launcher_env, tmp_path, workload):
    hosts = tmp_path / "hosts"
    hosts.write_text("".join(f"{host.address} slots=2\n" for host in netns_hosts.hosts))
    env = {**launcher_env, "FTRUN_SSH_OPTS": shlex.join(ssh_keys.client_options())}
    logs = tmp_path / "logs"
    job = subprocess.Popen([*FTRUN, "--hostfile", str(hosts), "--master-addr", netns_hosts.gateway, "--log-dir",
                            str(logs), workload("wait_forever.py"), str(tmp_path)], env=env, stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True)
    pids = []
    for line in job.stderr:  # each agent's start notice names its workers
        pids += [int(pid) for pid in re.findall(r"\(pids ([\d ]+)\)", line)[0].split()] if "(pids " in line else []
        if len(pids) == 4:
            break
    processes = [psutil.Process(pid) for pid in pids] + [agent_of_node(0, logs), agent_of_node(1, logs)]
    job.send_signal(signal.SIGINT)
    assert job.wait(timeout=60) == 128 + signal.SIGINT
    _, alive = psutil.wait_procs(processes, timeout=30)
    assert alive == []


def test_a_script_that_ends_before_the_other_hosts_start_theirs_succeeds_quietly(run_ftrun, tmp_path):
    """Node 0's worker ends at once, before the other hosts' agents have started theirs: the leader waits for
    them (the early end was taken for a failure, with no reason given), and once it ended well the launcher
    lets the others end by themselves (it stopped them, and printed each as killed by SIGTERM)."""
    script = tmp_path / "hello.py"
    script.write_text('import os\nprint("hello from rank", os.environ["RANK"])\n')
    result = run_ftrun("-H", "127.0.0.2:1,127.0.0.3:1,127.0.0.4:1", "--log-dir", tmp_path, script, timeout=120)
    assert result.returncode == 0, result.stderr
    assert sorted(re.findall(r"hello from rank (\d)", result.stdout)) == ["0", "1", "2"]
    assert "ftrun: succeeded" in result.stderr and f"{script} failed" not in result.stderr, result.stderr
    assert "ended:" not in result.stderr, result.stderr


def test_a_signal_to_a_hostfile_launch_is_the_one_each_local_agent_gets_and_no_node_is_waited_for(
        launcher_env, tmp_path):
    """SIGHUP to `ftrun -H` with two of this machine's hosts: each agent gets SIGHUP (they got SIGTERM, and
    recorded it), each node's worker saves its state before it is signalled, and node 0 neither waits for node
    1's lease to run out nor calls it lost."""
    job = subprocess.Popen([*FTRUN, "-H", "127.0.0.2:1,127.0.0.3:1", "--log-dir", str(tmp_path), EXAMPLE, "--steps",
                            "100000"], env=launcher_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        for line in job.stdout:
            if LOSS.search(line):
                break
        job.send_signal(signal.SIGHUP)
        _, err = job.communicate(timeout=60)
    finally:
        job.kill()
    assert job.returncode == 128 + signal.SIGHUP, err
    (run_dir,) = tmp_path.iterdir()
    ends = [events(node)[-1] for node in (run_dir, run_dir / "node1")]
    assert [(end["event"], end["signal"]) for end in ends] == [("end", signal.SIGHUP)] * 2, ends
    assert "lost" not in err and "lease" not in err, err
    # each node's worker saved: the leader's signal did not cut node 1's save short (node 0 asks every node's
    # workers to save and waits for their answers; node 1's answered its own agent too)
    rescues = [next(e for e in events(node) if e["event"] == "rescue") for node in (run_dir, run_dir / "node1")]
    assert [sorted(rescue["saved"]) for rescue in rescues] == [["0", "100000"], ["100000"]], rescues


@pytest.mark.parametrize("args, message", [
    (["--nnodes", "2"], "every node needs the store's address"),
    (["--nnodes", "1:2", "--node-rank", "2", "--rdzv-endpoint", "h:1"], "--node-rank 2: must be between 0 and"),
    (["--nnodes", "3:2"], "--nnodes '3:2' is not valid: use N or MIN:MAX"),
    (["--nnodes", "2", "--node-rank", "2", "--rdzv-endpoint", "h:1"], "--node-rank 2: must be between 0 and"),
    (["-H", "localhost", "--nnodes", "2"], "--hostfile/-H starts every node from here"),
    (["-H", "a,a"], "duplicate host 'a'"),
    (["--hostfile", "/nonexistent"], "cannot read hostfile /nonexistent"),
    (["--node-timeout", "0"], "--node-timeout must be a positive number"),
    (["--nnodes", "2", "--rdzv-endpoint", "localhost:1"], "the nodes of a job started one by one must share a secret"),
    (["-H", "localhost:1,127.0.0.1:1", "--node-timeout", "0.5"], "--node-timeout 0.5 leaves a cut-off node 0.125 s"),
    (["-H", "localhost:1,127.0.0.1:1", "--master-addr", "203.0.113.7"], "the store's host '203.0.113.7' (203"),
    (["-H", "nosuchhost.invalid:1"], "cannot reach host nosuchhost.invalid over ssh: ssh: Could not resolve"),
])
def test_bad_multinode_flags_get_one_line(run_ftrun, args, message):
    result = run_ftrun(*args, EXAMPLE)
    assert result.returncode == 2
    assert result.stderr.count("\n") == 1 and message in result.stderr, result.stderr


@pytest.mark.fast
def test_slurm_node_lists_are_expanded():
    from ftrun.launcher.slurm import expand_nodelist, slurm_node

    assert expand_nodelist("gpu[01-03,07],login1") == ["gpu01", "gpu02", "gpu03", "gpu07", "login1"]
    assert expand_nodelist("a1,b[9-10]") == ["a1", "b9", "b10"]
    node = slurm_node({"SLURM_JOB_NODELIST": "n[1-4]", "SLURM_NODEID": "2"})
    assert (node.node_rank, node.nnodes, node.head) == (2, 4, "n1")
    assert slurm_node({"SLURM_NODEID": "2"}) is None
