"""Stopping with real processes: a preemption saves the committed state and a new launch resumes from it;
a worker SIGKILL cannot end (frozen by the cgroup freezer: state D) is reported and no longer waited for."""

from __future__ import annotations

import re
import signal
import subprocess
import time
from pathlib import Path

import psutil
import pytest

from conftest import EXAMPLE, FTRUN
from runs import COMMIT, NO_WATCHDOG, NPROC, RTOL, STEPS, TIMEOUT, TRAINING, Run, check_steps, communicate, read_run
from ftrun.agent.shutdown import KILL_WAIT

SAVED_STEP = 5
"""The preempted workers wait before step SAVED_STEP + 1 until the state is saved: its step is known."""


def wait_for(path: Path, timeout: float = 60) -> Path:
    """``path``, once a worker has written it."""
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert time.monotonic() < deadline, f"{path} was not written within {timeout:g} s"
        time.sleep(0.02)  # polling for a file another process writes
    return path


def ends(pid: int, timeout: float = 60) -> bool:
    """Whether process ``pid`` ends (a zombie left for init to reap counts) within ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                return True
        except psutil.NoSuchProcess:
            return True
        time.sleep(0.05)  # polling another process's end
    return False


def unkillable_line(rank: int, pid: int) -> re.Pattern:
    return re.compile(rf"^ftrun: rank {rank} \(pid {pid}\) is still there \d+ s after SIGKILL \(state: disk-sleep\); "
                      r"no longer waiting for it$", re.MULTILINE)


# ------------------------------------------------------------------------------------------ preemption
def preempted(launcher_env: dict[str, str], workload, logs: Path, example: str = "") -> Run:
    """ftrun training EXAMPLE on NPROC workers, sent SIGTERM once every worker committed step SAVED_STEP.

    The workers wait before the next step until the event log holds the rescue (the await makes the step at
    which ftrun is preempted exact; a real preemption lands anywhere, and the save takes what is committed).
    """
    proc = subprocess.Popen([*FTRUN, "--nproc-per-node", str(NPROC), "--log-dir", logs, *NO_WATCHDOG,
                             workload("await_train.py"), *TRAINING],
                            env={**launcher_env, "AWAIT": f"{SAVED_STEP + 1}:rescue", "EXAMPLE": example},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        committed: set[int] = set()
        lines = []
        for line in proc.stdout:  # every worker committed step 5: they all wait now
            lines.append(line)
            match = COMMIT.search(line.rstrip())
            if match and int(match[4]) == SAVED_STEP:
                committed.add(int(match[1]))
                if len(committed) == NPROC:
                    break
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=TIMEOUT)
    finally:
        proc.kill()
    return read_run(subprocess.CompletedProcess(proc.args, proc.returncode, "".join(lines) + out, err), logs)


def test_sigterm_saves_the_committed_state_and_a_resumed_launch_continues_the_loss_curve(
        launcher_env, workload, run_ftrun, baseline, tmp_path):
    first_logs, second_logs = tmp_path / "first", tmp_path / "second"
    first = preempted(launcher_env, workload, first_logs)
    why = first.explain()
    assert first.returncode == 128 + signal.SIGTERM, why
    assert f"ftrun: received SIGTERM, stopping the workers: asking {NPROC} workers to save their last committed " \
           "state first" in first.stderr, why
    (rescue,) = first.of("rescue")
    assert (rescue["saved"], rescue["best_step"], rescue["missing"], rescue["errors"], rescue["why"]) == \
        ({str(uid): SAVED_STEP for uid in range(NPROC)}, SAVED_STEP, [], {}, "SIGTERM"), why
    assert f"ftrun: the state of step {SAVED_STEP} is saved in {first.run_dir / 'rescue'}; " \
           f"`ftrun --resume-from {first.run_dir} ...` continues from it" in first.stderr, why
    assert [(e["outcome"], e["signal"]) for e in first.of("end")] == [("interrupted", signal.SIGTERM)], why
    assert "stopped by SIGTERM" in first.stderr, why

    resumed = run_ftrun("--nproc-per-node", NPROC, "--log-dir", second_logs, "--resume-from", first.run_dir,
                        workload("faulty_train.py"), *TRAINING, timeout=TIMEOUT)
    second = read_run(resumed, second_logs)
    assert second.returncode == 0, second.explain()
    assert f"ftrun: resuming from the state of step {SAVED_STEP} saved in {first.run_dir / 'rescue'}" in second.stderr
    # the original's steps, then the resumed launch's: each step once, with the fault-free run's loss (bit for
    # bit up to the save; after it, within RTOL: the resumed DDP sums its first step's gradients in its initial
    # buckets, the original in buckets rebuilt at its step 1, so the float32 sums round differently, ~1e-8)
    before, after = first.commits(), second.commits()
    assert set(before) == set(after) == set(range(NPROC)), why
    for uid in range(NPROC):
        assert [c.step for c in after[uid]] == list(range(SAVED_STEP + 1, STEPS)), second.explain()
        done = [c.step for c in before[uid]]
        assert done in (list(range(SAVED_STEP + 1)), list(range(SAVED_STEP + 2))), why  # at most the step in flight
        for c in before[uid]:
            assert (c.world, c.rank, c.loss) == (NPROC, uid, baseline[c.step]), f"{c}\n{why}"
        for c in after[uid]:
            assert (c.world, c.rank) == (NPROC, uid), f"{c}\n{second.explain()}"
            assert c.loss == pytest.approx(baseline[c.step], rel=RTOL), f"{c}\n{second.explain()}"

    # the same state into a model of another width: each worker says so in one line, and the launch fails
    other = run_ftrun("--nproc-per-node", 2, "--resume-from", first.run_dir, workload("faulty_train.py"),
                      "--steps", str(STEPS), "--width", "128", timeout=TIMEOUT)
    refused = f"ftrun: cannot resume from the state of step {SAVED_STEP} saved in {first.run_dir / 'rescue'}: "
    assert other.returncode == 1 and other.stderr.count(refused) == 2, other.stderr
    assert "size mismatch" in other.stderr and "Traceback" not in other.stderr, other.stderr


def test_sigterm_saves_every_shard_of_sharded_state_and_launches_of_other_worlds_resume_it_resharded(
        launcher_env, workload, run_ftrun, fsdp_baseline, tmp_path):
    # FSDP2: each rank writes its shard's last two snapshots to rescue/shards/<rank>.pt; a launch of 6 ranks
    # reads the 4 files (ranks 4 and 5 none), one of 2 reads two each (rank r: r and r + 2); either re-shards
    # the state over its world
    first = preempted(launcher_env, workload, tmp_path / "first", "train_fsdp")
    why = first.explain()
    assert first.returncode == 128 + signal.SIGTERM, why
    (rescue,) = first.of("rescue")
    assert (rescue["saved"], rescue["missing"], rescue["errors"]) == \
        ({str(uid): SAVED_STEP for uid in range(NPROC)}, [], {}), why
    shards = first.run_dir / "rescue" / "shards"
    assert sorted(path.name for path in shards.iterdir()) == [f"{rank}.pt" for rank in range(NPROC)], why

    for world in (6, 2):
        logs = tmp_path / f"world{world}"
        resumed = run_ftrun("--nproc-per-node", world, "--log-dir", logs, "--resume-from", first.run_dir,
                            workload("faulty_train.py"), *TRAINING, env={"EXAMPLE": "train_fsdp"}, timeout=TIMEOUT)
        second = read_run(resumed, logs)
        why = second.explain()
        assert second.returncode == 0, why
        assert f"ftrun: resuming from the state of step {SAVED_STEP} saved in {first.run_dir / 'rescue'}" in \
            second.stderr, why
        after = second.commits()
        assert set(after) == set(range(world)), why
        for uid, commits in after.items():  # another world sums the gradients in another order than 4: RTOL
            assert [c.step for c in commits] == list(range(SAVED_STEP + 1, STEPS)), why
            assert all(c.world == world and c.loss == pytest.approx(fsdp_baseline[c.step], rel=RTOL)
                       for c in commits), f"uid {uid}\n{why}"

    # a replicated job's save holds no shard: one line says so, and the sharded job starts from scratch
    replicated = tmp_path / "replicated"
    (replicated / "rescue").mkdir(parents=True)
    (replicated / "rescue" / "0.pt").write_bytes(b"")
    fresh = run_ftrun("--nproc-per-node", 1, "--resume-from", replicated, workload("faulty_train.py"), "--steps", "2",
                      env={"EXAMPLE": "train_fsdp"}, timeout=TIMEOUT)
    assert fresh.returncode == 0 and fresh.stderr.count(f"ftrun: the sharded state saved in {replicated / 'rescue'} "
                                                        "holds no saved shard") == 1, fresh.stderr
    assert "step=0 " in fresh.stdout, fresh.stdout


def test_resume_from_a_directory_without_saved_state_is_one_line(run_ftrun, workload, tmp_path):
    result = run_ftrun("--resume-from", tmp_path, workload("faulty_train.py"))
    assert result.returncode == 2 and result.stderr.count("\n") == 1, result.stderr
    assert result.stderr.startswith(f"ftrun: error: --resume-from {tmp_path}: no saved state there"), result.stderr


# ----------------------------------------------------------------------------- workers that will not die
def test_a_worker_sigkill_cannot_end_is_reported_and_ftrun_still_exits(launcher_env, workload, tmp_path, freezer):
    markers, logs = tmp_path / "markers", tmp_path / "logs"
    markers.mkdir()
    proc = subprocess.Popen([*FTRUN, "--nproc-per-node", "2", "--shutdown-timeout", "1", "--log-dir", logs,
                             workload("wait_forever.py"), markers], env=launcher_env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        for line in proc.stderr:  # the start notice: both workers are running
            if ", attempt 0:" in line:
                break
        pids = {rank: int(wait_for(markers / f"started_{rank}").read_text()) for rank in (0, 1)}
        freezer.add(pids[1])
        freezer.freeze()
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=TIMEOUT)
    finally:
        proc.kill()
    run = read_run(subprocess.CompletedProcess(proc.args, proc.returncode, out, err), logs)
    why = run.explain()
    assert run.returncode == 128 + signal.SIGTERM, why
    assert unkillable_line(1, pids[1]).search(err), why
    (unkillable,) = run.of("unkillable")
    assert (unkillable["uid"], unkillable["pid"], unkillable["state"]) == (1, pids[1], "disk-sleep"), why
    assert unkillable["waited"] >= KILL_WAIT, why
    assert {e["pid"]: e["exitcode"] for e in run.of("worker_exit")} == {pids[0]: -signal.SIGTERM}, why
    assert [e["outcome"] for e in run.of("end")] == ["interrupted"], why
    freezer.thaw()  # the SIGKILL it was sent takes effect
    assert ends(pids[1])


def test_a_hung_worker_sigkill_cannot_end_is_killed_once_then_given_up_on_and_the_survivors_recover(
        run_ftrun, workload, baseline, tmp_path, freezer):
    """Worker 2 freezes itself before step 6 (outside any collective): the watchdog declares it hung and kills
    it, once; KILL_WAIT s later it is still there, so it is counted lost and the others recover in place."""
    logs = tmp_path / "logs"
    result = run_ftrun("--nproc-per-node", NPROC, "--hang-timeout", "3", "--log-dir", logs,
                       workload("faulty_train.py"), *TRAINING, env={"FAULTS": "freeze:6:2", "FREEZER": freezer.path},
                       timeout=TIMEOUT)
    run = read_run(result, logs)
    why = run.explain()
    assert run.returncode == 0, why
    (start,) = [e for e in run.of("worker_start") if e["uid"] == 2]
    assert [e["uid"] for e in run.of("hang")] == [2], why  # killed once, not again and again
    (unkillable,) = run.of("unkillable")
    assert (unkillable["uid"], unkillable["pid"], unkillable["state"]) == (2, start["pid"], "disk-sleep"), why
    assert unkillable_line(2, start["pid"]).search(run.stderr), why
    (recovery,) = run.of("recovery")
    assert (recovery["lost_uids"], recovery["world_after"], recovery["steps_lost"], recovery["resumed_at_step"]) == \
        ([2], NPROC - 1, 0, 6), why
    exits = {e["uid"]: e["exitcode"] for e in run.of("worker_exit")}
    assert exits == {0: 0, 1: 0, 3: 0}, why  # the frozen one never ended while ftrun ran
    check_steps(run, baseline, {2: None})
    assert freezer.pids() == [start["pid"]]
    freezer.thaw()
    assert ends(start["pid"])



@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP])
def test_a_signal_before_the_agent_handles_signals_is_still_its_exit_status_not_a_death(launcher_env, workload, sig):
    """The launch is held asking an etcd that accepts and never answers, before the agent installs its signal
    handling: SIGTERM or SIGHUP there ends ftrun with 128 + the signal and no traceback, as Ctrl-C does (it
    died of the signal, its clean-up skipped)."""
    import select
    import socket

    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        job = subprocess.Popen([*FTRUN, "--rdzv-backend", "etcd", "--rdzv-endpoint",
                                f"127.0.0.1:{silent.getsockname()[1]}", workload("wait_forever.py"), "/nonexistent"],
                               env=launcher_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            assert select.select([silent], [], [], TIMEOUT)[0]  # ftrun is asking etcd: its connection is queued
            job.send_signal(sig)
            _, err = job.communicate(timeout=TIMEOUT)
        finally:
            job.kill()
    assert job.returncode == 128 + sig, err
    assert "Traceback" not in err


def test_ctrl_c_while_the_fork_server_imports_torch_stops_before_any_worker_starts(launcher_env, tmp_path):
    """The launch waits for its fork server's import of torch before it starts workers: Ctrl-C then ends it at
    once, with no worker started (each was started as a new process, importing torch itself, and then
    stopped: seconds later)."""
    job = subprocess.Popen([*FTRUN, "--nproc-per-node", "2", "--log-dir", str(tmp_path), EXAMPLE, "--steps", "5"],
                           env=launcher_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        for line in job.stderr:
            if "importing torch once for every worker" in line:
                break
        job.send_signal(signal.SIGINT)
        _, err = communicate(job, TIMEOUT)
    finally:
        job.kill()
    assert job.returncode == 128 + signal.SIGINT, err
    assert "ftrun: received SIGINT before the workers started; stopped" in err
    run = read_run(job, tmp_path)
    assert [(event["event"], event.get("signal")) for event in run.events] == \
        [("start", None), ("end", signal.SIGINT)], run.events
