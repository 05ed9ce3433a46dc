"""Sharded (FSDP2) training recovered in place from the copies in a buddy's host memory, never from disk.

4 CPU workers on Gloo train examples/train_fsdp.py (an MLP, fully_shard per layer, AdamW) through
tests/workloads/faulty_train.py. Each rank's shard lives in its own memory only; after each committed step
a copy goes to its buddy: on one node rank (r + 1) % 4, over two nodes of two rank (r + 2) % 4, on the other
node. The loss of rank 2's shard, or rank 0's, or of both of node 1's, is made good from those copies.

Loss parity tolerance: the same RTOL as the DDP tests (runs.py), for the same reason. Up to the fault the
run is the fault-free one bit for bit; after it, 3 ranks reduce-scatter the float32 gradients in another
order than 4 (and FSDP's averaging over 3 ranks undoes the loss's scaling by 3 with rounding): ~1e-7
relative per step, through AdamW's normalised update. Observed: ~2e-8. A skipped, doubled or stale step
(or a shard loaded at the wrong place, or AdamW's moments lost) moves the loss by ~1e-2 and fails it.
"""

from __future__ import annotations

import signal
import subprocess
import time
from pathlib import Path

import pytest

from conftest import FTRUN
from runs import NO_WATCHDOG, NPROC, PHASES, RTOL, STEPS, TIMEOUT, TRAINING, Run, check_in_place, read_run

SAVED = 5
"""The step every worker of a stopped job has committed: they wait before the next until the state is saved."""

FSDP = "train_fsdp"


@pytest.mark.compat
def test_sigkill_of_a_middle_rank_reshards_over_the_3_survivors(launch, fsdp_baseline):
    run = launch(faults="kill:5:2", example=FSDP)
    check_in_place(run, fsdp_baseline, lost={2: -9}, fault_step=5)
    assert "ftrun: sharded state kept redundant in host memory every 1 step(s)" in run.stdout + run.stderr


def test_sigkill_of_rank_0_inside_the_reduce_scatters_takes_its_shard_from_rank_1s_memory(launch, fsdp_baseline):
    # rank 0 dies in backward, after the last layers' reduce-scatters started and before the first's:
    # the survivors' collectives fail inside backward(), ft.guard() turns that into a discarded step
    run = launch(faults="backward:5:0", example=FSDP)
    check_in_place(run, fsdp_baseline, lost={0: -9}, fault_step=5)
    assert any("[default1]: commit uid=1 rank=0 world=3 step=5 " in line for line in run.stdout.splitlines())


def test_spare_takes_over_a_lost_shard_and_world_stays_4(launch, fsdp_baseline):
    run = launch("--spares", "1", *NO_WATCHDOG, faults="kill:5:2", wait="5:joiner_ready", script="await_train.py",
                 example=FSDP)
    recovery = check_in_place(run, fsdp_baseline, lost={2: -9}, fault_step=5, joiners=(4,))
    assert recovery["joiners"] == [4], run.explain()
    assert [c.step for c in run.commits()[4]] == list(range(5, STEPS)), run.explain()


def test_respawned_worker_takes_its_shard_from_the_survivors_memory_and_world_returns_to_4(launch, fsdp_baseline):
    # rank 2 dies: the 3 survivors reshard and train on; its replacement joins before step 8 (the survivors
    # wait there for it, and it waits for them to be there), and the state is resharded over 4 again, the
    # newcomer's shard from its peers' memory
    run = launch("--respawn", *NO_WATCHDOG, faults="kill:5:2", wait="8:joined,joiner:at_8*3",
                 script="await_train.py", example=FSDP)
    check_in_place(run, fsdp_baseline, lost={2: -9}, fault_step=5, respawned=(4,))
    why = run.explain()
    (join,) = [r for r in run.of("recovery") if r["kind"] == "join"]
    assert (join["world_before"], join["world_after"], join["joiners"]) == (3, 4, [4]), why
    assert join["steps_lost"] == 0 and join["resumed_at_step"] == 8, why
    commits = run.commits()
    assert [c.step for c in commits[4]] == list(range(8, STEPS)), why
    assert all(c.world == NPROC and c.loss == pytest.approx(fsdp_baseline[c.step], rel=RTOL) for c in commits[4]), why


def test_a_rank_and_its_buddy_lost_together_fall_back_to_a_group_restart_in_one_line(launch, fsdp_baseline):
    # rank 2 dies at step 5, and its buddy (rank 3, which holds the only copy of its shard) dies as the
    # recovery begins: no memory holds shard 2. The survivors say so, the agent restarts the group, and the
    # restart trains from step 0: ranks 0 and 1 saved their shards and the copies they hold, shard 2 is in none
    run = launch("--max-restarts", "1", faults="kill:5:2,recovery:5:3", example=FSDP)
    why = run.explain()
    assert run.returncode == 0, why
    assert not run.of("recovery"), why
    (failed,) = run.of("recovery_failed")
    assert "a rank and its buddy were lost together" in failed["reason"], why
    lines = [line for line in run.stderr.splitlines() if "a rank and its buddy were lost together" in line]
    assert len(lines) == 1 and "restarting the group (restart 1 of 1)" in lines[0], why
    assert [(e["attempt"], e["succeeded"]) for e in run.of("attempt_end")] == [(0, False), (1, True)], why
    assert run.stderr.count("does not hold every shard of any step here (rank r reads shards/r.pt") == 1, why
    restarted = run.commits(attempt=1)
    assert set(restarted) == set(range(NPROC)), why
    for uid, commits in restarted.items():
        assert [c.step for c in commits] == list(range(STEPS)), f"uid {uid}\n{why}"
        assert all(c.loss == fsdp_baseline[c.step] for c in commits), f"uid {uid}\n{why}"  # a fresh run


def test_a_group_restart_resumes_from_the_saved_shards_a_dead_ranks_from_its_buddys_copy(launch, fsdp_baseline):
    # rank 2 dies before step 5; below --min-nproc 4 and with no joiner, ftrun restarts the group after the
    # live ranks saved what they hold: shard 2 of step 4 is in rank 3's copy, written to rescue/shards/3.pt
    run = launch("--max-restarts", "1", "--min-nproc", "4", "--join-timeout", "1", faults="kill:5:2", example=FSDP)
    why = run.explain()
    assert run.returncode == 0 and not run.of("recovery"), why
    (rescue,) = run.of("rescue")
    assert (rescue["saved"], rescue["missing"], rescue["why"]) == ({"0": 4, "1": 4, "3": 4}, [], "restart"), why
    assert [(e["attempt"], e["succeeded"]) for e in run.of("attempt_end")] == [(0, False), (1, True)], why
    assert "ftrun: resuming from the state of step 4 saved in " in run.stderr, why
    before, restarted = run.commits(attempt=0), run.commits(attempt=1)
    assert set(restarted) == set(range(NPROC)), why
    for uid, commits in restarted.items():  # the same world, from the same bytes: bit for bit
        assert [c.step for c in before[uid]] == list(range(5)), f"uid {uid}\n{why}"
        assert [c.step for c in commits] == list(range(5, STEPS)), f"uid {uid}\n{why}"
        assert all(c.loss == fsdp_baseline[c.step] for c in [*before[uid], *commits]), f"uid {uid}\n{why}"


def recovered_from_the_loss_of(run: Run, lost: int) -> dict:
    """Assert that the job succeeded with one in-place recovery from the SIGKILL of uid ``lost``, world 4 -> 3,
    every other worker started once and ending with exit code 0; the recovery event."""
    why = run.explain()
    assert run.returncode == 0 and not run.of("recovery_failed") and not run.of("group_failure"), why
    starts = {e["uid"]: e["pid"] for e in run.of("worker_start")}
    exits = {e["uid"]: (e["pid"], e["exitcode"]) for e in run.of("worker_exit")}
    assert len(run.of("worker_start")) == NPROC, why  # no survivor restarted
    assert exits == {uid: (starts[uid], -9 if uid == lost else 0) for uid in range(NPROC)}, why
    (recovery,) = run.of("recovery")
    assert (recovery["world_before"], recovery["world_after"], recovery["lost_uids"]) == (4, 3, [lost]), why
    return recovery


def test_kill_during_a_refresh_returns_to_the_previous_complete_copy_and_replays_one_step(launch, fsdp_baseline):
    # uid 1 dies in the copy of committed step 5 to its buddy: that copy never completes, so the newest
    # step every shard is held at is 4; the survivors return to it from their snapshots and replay step 5.
    run = launch(faults="refresh:5:1", example=FSDP)
    why = run.explain()
    recovery = recovered_from_the_loss_of(run, 1)
    assert recovery["steps_lost"] == 1 and recovery["resumed_at_step"] == 5, why  # step 5 is replayed
    assert set(recovery["phases"]) == PHASES, why
    assert "recovered from loss of rank 1 in" in run.stderr and "world 4 -> 3, 1 steps lost" in run.stderr, why
    commits = run.commits()
    assert [c.step for c in commits[1]] == list(range(5)), why  # died inside step 5's commit
    for uid in (0, 2, 3):
        lines = commits[uid]
        assert [c.step for c in lines] == [*range(6), *range(5, STEPS)], f"uid {uid}\n{why}"
        for c in lines:
            if c.world == NPROC:
                assert c.loss == fsdp_baseline[c.step], f"{c}\n{why}"  # generation 0: bit for bit
            else:
                assert c.loss == pytest.approx(fsdp_baseline[c.step], rel=RTOL), f"{c}\n{why}"


def test_kill_while_the_last_steps_copies_may_be_in_flight_recovers_at_most_one_step_back(launch, fsdp_baseline):
    # uid 2 dies at the start of step 5 while the copies of step 4 overlap it (no wait for them first): the
    # survivors' copies in flight fail with the generation, and whichever copies completed decide the step
    # they return to, 4 or 3 (step 4 computed again from memory, with the same batches)
    run = launch(faults="copying:5:2", example=FSDP)
    why = run.explain()
    recovery = recovered_from_the_loss_of(run, 2)
    assert recovery["steps_lost"] in (0, 1) and recovery["resumed_at_step"] == 5 - recovery["steps_lost"], why
    commits = run.commits()
    for uid in (0, 1, 3):
        steps = [c.step for c in commits[uid]]
        assert steps == [*range(5), *range(5 - recovery["steps_lost"], STEPS)], f"uid {uid}\n{why}"
        assert all(c.loss == pytest.approx(fsdp_baseline[c.step], rel=RTOL) for c in commits[uid]), why


def test_both_workers_of_a_node_killed_take_their_shards_from_the_other_nodes_memory(
        launcher_env, workload, free_port, secret_file, tmp_path, fsdp_baseline):
    # two nodes of two workers (scheduler mode, both on this machine): the buddies are on the other node
    # (stride 2), so node 1's shards survive in node 0's memory when both its workers die at step 5; with
    # the next rank as buddy, shard 2 and its only copy (rank 3) would be lost together
    env = {**launcher_env, "FTRUN_SECRET_FILE": secret_file, "EXAMPLE": "train_fsdp",
           "FAULTS": "kill:5:100000,kill:5:100001"}
    common = ["--nnodes", "2", "--rdzv-endpoint", f"127.0.0.1:{free_port()}", "--nproc-per-node", "2"]
    nodes = [subprocess.Popen([*FTRUN, *common, "--node-rank", str(node), "--log-dir", str(tmp_path / f"node{node}"),
                               workload("faulty_train.py"), *TRAINING], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for node in (1, 0)]
    (out1, err1), (out0, err0) = (node.communicate(timeout=TIMEOUT) for node in nodes)
    leader = read_run(subprocess.CompletedProcess(nodes[1].args, nodes[1].returncode, out0, err0), tmp_path / "node0")
    why = f"{leader.explain()}\n--- node 1\n{err1[-3000:]}"
    assert (nodes[1].returncode, nodes[0].returncode) == (0, 0), why
    assert not leader.of("recovery_failed") and not leader.of("group_failure"), why
    (recovery,) = leader.of("recovery")
    assert sorted(recovery["lost_uids"]) == [100000, 100001] and recovery["steps_lost"] == 0, why
    assert (recovery["world_before"], recovery["world_after"], recovery["kind"]) == (4, 2, "fault"), why
    exits = {e["uid"]: e["exitcode"] for e in leader.of("worker_exit")}
    assert exits == {0: 0, 1: 0, 100000: -9, 100001: -9}, why  # node 1's died as planted; no survivor restarted
    assert sorted(e["uid"] for e in leader.of("worker_start")) == [0, 1, 100000, 100001], why  # each started once
    commits = leader.commits()
    for uid in (0, 1):
        assert [c.step for c in commits[uid]] == list(range(STEPS)), why  # every step once, none lost
        assert all(c.loss == pytest.approx(fsdp_baseline[c.step], rel=RTOL) for c in commits[uid]), why
    assert {c.world for c in commits[0] if c.step >= 5} == {2}, why


def committed_everywhere(proc: subprocess.Popen, logs: Path, step: int) -> None:
    """Return once the 4 workers logged under ``logs`` committed ``step`` (``proc``, the launch, still running)."""
    deadline = time.monotonic() + TIMEOUT
    while sum(f"step={step} " in p.read_text() for p in logs.glob("**/attempt_0/*/stdout.log")) < NPROC:
        assert time.monotonic() < deadline and proc.poll() is None, f"the workers did not all commit step {step}"
        time.sleep(0.05)  # polling the workers' logs: they wait before the next step until the state is saved


def test_a_stop_of_node_0_alone_saves_every_nodes_shards_and_a_scheduler_mode_resume_finds_them(
        launcher_env, workload, free_port, secret_file, tmp_path, fsdp_baseline):
    # Scheduler mode, where only node 0's ftrun gets the signal: its agent asks node 1's workers to save as well
    # (each writes to its own node's run directory), and signals them once they have (node 1's were signalled
    # unsaved: one shard is no state, and sharded state could not resume). Each node logs under a directory of
    # its own, as on two hosts; node 1 links its run directory under node 0's, where --resume-from finds it.
    env = {**launcher_env, "FTRUN_SECRET_FILE": secret_file, "EXAMPLE": "train_fsdp", "AWAIT": f"{SAVED + 1}:rescue"}

    def start(node: int, port: int, logs: Path, script: str, *flags: str) -> subprocess.Popen:
        return subprocess.Popen([*FTRUN, "--nnodes", "2", "--rdzv-endpoint", f"127.0.0.1:{port}", "--nproc-per-node",
                                 "2", "--node-rank", str(node), "--log-dir", str(logs / f"node{node}"), *flags,
                                 workload(script), *TRAINING], env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)

    port = free_port()
    node1, node0 = (start(node, port, tmp_path, "await_train.py", *NO_WATCHDOG) for node in (1, 0))
    try:
        committed_everywhere(node0, tmp_path, SAVED)
        node0.send_signal(signal.SIGTERM)
        out0, err0 = node0.communicate(timeout=TIMEOUT)
        _, err1 = node1.communicate(timeout=TIMEOUT)
    finally:
        node0.kill()
        node1.kill()
    leader = read_run(subprocess.CompletedProcess(node0.args, node0.returncode, out0, err0), tmp_path / "node0")
    why = f"{leader.explain()}\n--- node 1\n{err1[-3000:]}"
    assert leader.returncode == 128 + signal.SIGTERM, why
    assert "asking 4 workers to save their last committed state first" in err0, why
    (rescue,) = leader.of("rescue")
    assert (rescue["saved"], rescue["missing"], rescue["errors"]) == \
        ({str(uid): SAVED for uid in (0, 1, 100000, 100001)}, [], {}), why
    assert sorted(p.name for p in (leader.run_dir / "rescue" / "shards").iterdir()) == ["0.pt", "1.pt"], why
    (node1_dir,) = (tmp_path / "node1").glob("*/node1")
    assert sorted(p.name for p in (node1_dir / "rescue" / "shards").iterdir()) == ["2.pt", "3.pt"], why
    assert (leader.run_dir / "node1").resolve() == node1_dir.resolve(), why  # linked as node 1's agent ended

    del env["AWAIT"]
    again, port = tmp_path / "again", free_port()
    node1, node0 = (start(node, port, again, "faulty_train.py", "--resume-from", str(leader.run_dir)) for node in (1, 0))
    (out1, err1), (out0, err0) = (node.communicate(timeout=TIMEOUT) for node in (node1, node0))
    why = f"--- node 0\n{err0[-3000:]}\n--- node 1\n{err1[-3000:]}"
    assert (node0.returncode, node1.returncode) == (0, 0), why
    assert f"ftrun: resuming from the state of step {SAVED} saved in {leader.run_dir / 'rescue'}" in err0, why
    commits = {**Run(0, out0, err0, [], again).commits(), **Run(0, out1, err1, [], again).commits()}
    assert set(commits) == {0, 1, 100000, 100001}, why
    for uid, steps in commits.items():
        assert [c.step for c in steps] == list(range(SAVED + 1, STEPS)), f"uid {uid}\n{why}"
        assert all(c.world == 4 and c.loss == pytest.approx(fsdp_baseline[c.step], rel=RTOL) for c in steps), why


def test_a_sharded_job_on_two_hosts_stopped_then_resumed_goes_on_everywhere_from_each_hosts_own_shards(
        launcher_env, workload, tmp_path, fsdp_baseline):
    # `ftrun -H` with two of this machine's hosts: each node saves its workers' shards in its own run directory
    # (node 1's is <run>/node1); `--resume-from <run>` makes node 1 read <run>/node1/rescue, node 0 <run>/rescue
    hosts, logs, again = "127.0.0.2:2,127.0.0.3:2", tmp_path / "first", tmp_path / "again"
    env = {**launcher_env, "EXAMPLE": "train_fsdp", "AWAIT": f"{SAVED + 1}:rescue"}
    job = subprocess.Popen([*FTRUN, "-H", hosts, "--log-dir", str(logs), *NO_WATCHDOG, workload("await_train.py"),
                            *TRAINING], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        committed_everywhere(job, logs, SAVED)
        job.send_signal(signal.SIGTERM)
        _, err = job.communicate(timeout=TIMEOUT)
    finally:
        job.kill()
    assert job.returncode == 128 + signal.SIGTERM, err
    (run_dir,) = logs.iterdir()
    assert sorted(p.name for p in (run_dir / "rescue" / "shards").iterdir()) == ["0.pt", "1.pt"], err
    assert sorted(p.name for p in (run_dir / "node1" / "rescue" / "shards").iterdir()) == ["2.pt", "3.pt"], err

    del env["AWAIT"]
    resumed = subprocess.run([*FTRUN, "-H", hosts, "--log-dir", str(again), "--resume-from", str(run_dir),
                              workload("faulty_train.py"), *TRAINING], env=env, capture_output=True, text=True,
                             timeout=TIMEOUT)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"ftrun: resuming from the state of step {SAVED} saved in {run_dir / 'rescue'}" in resumed.stderr
    (new_dir,) = again.iterdir()
    commits = Run(0, "".join(p.read_text() for p in new_dir.glob("**/attempt_0/*/stdout.log")), "", [],
                  new_dir).commits()
    assert set(commits) == {0, 1, 100000, 100001}, resumed.stderr[-3000:]
    for uid, steps in commits.items():
        assert [c.step for c in steps] == list(range(SAVED + 1, STEPS)), f"uid {uid}\n{resumed.stderr[-3000:]}"
        assert all(c.world == 4 and c.loss == pytest.approx(fsdp_baseline[c.step], rel=RTOL) for c in steps)
