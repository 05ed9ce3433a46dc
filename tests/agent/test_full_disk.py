"""A full disk under --log-dir (a real tmpfs of a few MiB) is not a crash: the job trains and recovers in place
with its logs dropped (said once each), and a rescue that cannot be written says why."""

from __future__ import annotations

import pytest

from runs import NPROC, RTOL, STEPS, TIMEOUT, TRAINING, read_run

ENOSPC = "No space left on device"


def test_a_full_log_disk_drops_the_logs_and_the_job_still_recovers_in_place(run_ftrun, workload, baseline, tiny_disk):
    disk = tiny_disk(1024 * 1024)
    (disk.path / "runtime").mkdir()  # the run registry too is on the full disk
    disk.fill()
    result = run_ftrun("--nproc-per-node", NPROC, "--log-dir", disk.path / "logs", workload("faulty_train.py"),
                       *TRAINING, env={"FAULTS": "kill:5:2", "XDG_RUNTIME_DIR": str(disk.path / "runtime")},
                       timeout=TIMEOUT)
    run = read_run(result, disk.path / "logs")
    why = run.explain()
    assert run.returncode == 0, why
    assert run.events == [], why  # not one record fitted, and nothing broke
    notices = [line for line in run.stderr.splitlines() if line.startswith("ftrun: cannot ")]
    assert [line.split(" (")[0] for line in notices] == [
        f"ftrun: cannot write the event log {run.run_dir / 'events.jsonl'}",
        f"ftrun: cannot write {run.run_dir / 'secret'}",
        "ftrun: cannot enter this run in the run registry",
        f"ftrun: cannot write the worker logs under {run.run_dir}"], why  # each said once, in the order met
    assert all(ENOSPC in line for line in notices), why
    assert "ftrun: recovered from loss of rank 2 in " in run.stderr and ", 0 steps lost" in run.stderr, why
    commits = run.commits()  # the console still has every line
    assert set(commits) == set(range(NPROC)), why
    for uid, lines in commits.items():
        steps = [c.step for c in lines]
        if uid == 2:
            assert steps == list(range(5)), why
        else:  # step 4, in flight as rank 2 died, may be missing: that rank took it from a peer (runs.check_steps)
            assert steps == sorted(set(steps)) and set(range(STEPS)) - set(steps) <= {4} and steps[-1] == STEPS - 1, \
                f"uid {uid}: {steps}\n{why}"
        for c in lines:
            assert c.loss == pytest.approx(baseline[c.step], rel=RTOL), f"{c}\n{why}"
    assert all(p.stat().st_size == 0 for p in run.run_dir.glob("attempt_0/*/*.log")), why


def test_a_rescue_the_disk_cannot_hold_says_why_and_the_restart_goes_on(run_ftrun, workload, baseline, tiny_disk):
    # 256 KiB free: room for the logs, not for the workers' state (2 MiB each: the model and its momentum)
    disk = tiny_disk(4 * 1024 * 1024)
    disk.fill(leave=256 * 1024)
    result = run_ftrun("--nproc-per-node", NPROC, "--log-dir", disk.path / "logs", "--min-nproc", NPROC,
                       "--max-restarts", "1", workload("faulty_train.py"), *TRAINING, env={"FAULTS": "kill:5:2"},
                       timeout=TIMEOUT)
    run = read_run(result, disk.path / "logs")
    why = run.explain()
    assert run.returncode == 0, why
    (rescue,) = run.of("rescue")
    assert (rescue["saved"], rescue["best_step"], rescue["missing"], rescue["why"]) == ({}, -1, [], "restart"), why
    assert set(rescue["errors"]) == {"0", "1", "3"} and all(ENOSPC in e for e in rescue["errors"].values()), why
    assert not list((run.run_dir / "rescue").glob("*")), why  # no partial file is left taking the space
    (notice,) = [line for line in run.stderr.splitlines() if "restarting the group (restart 1 of 1)" in line]
    assert f"no state could be saved for the restart: [Errno 28] {ENOSPC}" in notice, why
    restarted = run.commits(attempt=1)
    assert set(restarted) == set(range(NPROC)), why
    for lines in restarted.values():  # from scratch, since nothing was saved
        assert [c.step for c in lines] == list(range(STEPS)), why
        assert all(c.loss == baseline[c.step] for c in lines), why
