"""Nodes that join a running job (``--nnodes MIN:MAX``): two nodes start and train, a third arrives later
(scheduler mode: three network-namespace hosts on a bridge, or this machine where namespaces cannot be made),
and its workers join at the next generation, taking their state from their peers' memory: world 4 -> 6 in one
generation, the first nodes' workers untouched, 0 steps lost, the fault-free run's losses (global batches: the
loss of a step does not depend on the world size)."""

from __future__ import annotations

import subprocess

import pytest

from conftest import FTRUN
from runs import NO_WATCHDOG, RTOL, TIMEOUT, communicate, read_run, until

STEPS = 40
TRAINING = ["--steps", str(STEPS), "--width", "256"]
"""held_train.py's training (HELD_TRAINING) cut short: its first 40 steps are the fault-free held run's."""


@pytest.fixture
def three_hosts():
    """Three network-namespace hosts on a bridge (no sshd: each node is started in its host, as a scheduler
    would), or None where namespaces cannot be made here: then the three nodes run on this machine."""
    from netns import Network, NetnsError, unsupported

    network = None
    if not unsupported():
        try:
            network = Network.create(3)
        except NetnsError:
            pass  # namespaces, but no bridge between them: this machine, as without namespaces
    yield network
    if network is not None:
        network.delete()


def ready_joiners(log_dir) -> int:
    """How many ``joiner_ready`` events the leader's event log under ``log_dir`` holds so far."""
    return sum('"event": "joiner_ready"' in line for log in log_dir.glob("*/events.jsonl")
               for line in log.read_text().splitlines())


def test_a_third_node_joins_a_running_job_and_its_workers_take_their_state_from_peers(
        launcher_env, workload, free_port, secret_file, tmp_path, held_baseline, three_hosts):
    hold = tmp_path / "hold"  # the job waits at step 5 (GATE) until the third node's workers are ready to join
    hold.touch()
    env = {**launcher_env, "FTRUN_SECRET_FILE": secret_file, "HOLD": str(hold), "GATE": "5"}
    prefixes, address = [[], [], []], "127.0.0.1"
    if three_hosts is not None:
        from netns import HOST_IFNAME

        hosts = three_hosts.hosts
        prefixes, address = [host.prefix for host in hosts], hosts[0].address
        env["GLOO_SOCKET_IFNAME"] = HOST_IFNAME
    common = ["--nnodes", "2:3", "--nproc-per-node", "2", "--master-addr", address,
              "--rdzv-endpoint", f"{address}:{free_port()}", *NO_WATCHDOG]

    def node(rank: int, **kwargs) -> subprocess.Popen:
        return subprocess.Popen([*prefixes[rank], *FTRUN, *common, "--node-rank", str(rank), "--log-dir",
                                 str(tmp_path / f"node{rank}"), workload("held_train.py"), *TRAINING], env=env,
                                stderr=subprocess.PIPE, text=True, **kwargs)

    node1 = node(1, stdout=subprocess.PIPE)
    node0 = node(0, stdout=subprocess.PIPE)
    procs = [node1, node0]
    lines: list[str] = []
    try:
        for line in node0.stdout:  # the first two nodes train
            lines.append(line)
            if " step=3 " in line:
                break
        procs.append(node(2, stdout=subprocess.PIPE))
        until(lambda: ready_joiners(tmp_path / "node0") == 2, TIMEOUT, "node 2's two workers ready to join")
        hold.unlink()
        for line in node0.stdout:  # node 0's workers train in a group of 6
            lines.append(line)
            if " world=6 " in line:
                break
        outputs = [communicate(proc, TIMEOUT) for proc in procs]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
    results = [subprocess.CompletedProcess(p.args, p.returncode, out, err) for p, (out, err) in zip(procs, outputs)]
    results[1].stdout = "".join(lines) + results[1].stdout
    leader = read_run(results[1], tmp_path / "node0")
    others = [read_run(result, next((tmp_path / f"node{rank}").iterdir())) for rank, result in ((1, results[0]),
                                                                                               (2, results[2]))]
    why = "\n".join(f"--- node {n}\n{run.explain()}" for n, run in enumerate([leader, *others]))
    assert [leader.returncode] + [run.returncode for run in others] == [0, 0, 0], why
    (joined,) = leader.of("node_joined")
    assert (joined["node"], joined["target"]) == (2, 6), why
    assert "ftrun: node 2 joined" in leader.stderr, why
    recoveries = leader.of("recovery")
    assert len(recoveries) == 1, why  # one generation for both of its workers
    (recovery,) = recoveries
    assert recovery["kind"] == "join" and sorted(recovery["joiners"]) == [200000, 200001], why
    assert (recovery["world_before"], recovery["world_after"], recovery["steps_lost"]) == (4, 6, 0), why
    resumed = recovery["resumed_at_step"]
    starts = {e["uid"]: e["pid"] for e in leader.of("worker_start")}
    exits = {e["uid"]: (e["pid"], e["exitcode"]) for e in leader.of("worker_exit")}
    assert exits == {uid: (pid, 0) for uid, pid in starts.items()}, why  # one process each, to the end
    assert sorted(starts) == [0, 1, 100000, 100001, 200000, 200001], why
    for rank, run in enumerate([leader, *others]):
        commits = run.commits()
        assert sorted(commits) == [rank * 100000, rank * 100000 + 1], why
        for uid, done in commits.items():
            steps = [c.step for c in done]
            if rank == 2:  # the newcomers start at the step the group resumed at
                assert steps == list(range(resumed, STEPS)), f"uid {uid}\n{why}"
            else:  # every step once; the one in flight at the join may be missing (a peer committed it)
                assert steps == sorted(set(steps)) and set(range(STEPS)) - set(steps) <= {resumed - 1}, \
                    f"uid {uid}: steps {steps}, resumed at {resumed}\n{why}"
            for c in done:
                assert c.world == (6 if c.step >= resumed else 4), f"{c}\n{why}"
                expected = held_baseline[c.step] if c.world == 4 else pytest.approx(held_baseline[c.step], rel=RTOL)
                assert c.loss == expected, f"{c}\n{why}"


def test_the_job_waits_for_its_first_nodes_up_to_the_join_timeout_and_says_so(launcher_env, workload, free_port,
                                                                              secret_file, tmp_path):
    # node 1 of --nnodes 2:3 never comes: node 0 says it waits, then ends with one line naming torchrun's key
    result = subprocess.run([*FTRUN, "--nnodes", "2:3", "--nproc-per-node", "1", "--master-addr", "127.0.0.1",
                             "--rdzv-endpoint", f"127.0.0.1:{free_port()}", "--rdzv-conf", "join_timeout=3",
                             "--log-dir", str(tmp_path), workload("held_train.py"), *TRAINING],
                            env={**launcher_env, "FTRUN_SECRET_FILE": secret_file}, capture_output=True, text=True,
                            timeout=TIMEOUT)
    lines = result.stderr.splitlines()
    assert result.returncode == 1, result.stderr
    assert lines.count("ftrun: waiting for node 1 to start its workers (1 of 2 nodes here): up to 3 s") == 1, \
        result.stderr
    assert any(line.endswith("failed: node 1 was lost before its workers started: it did not start within 3 s "
                             "(--rdzv-conf join_timeout)") for line in lines), result.stderr
