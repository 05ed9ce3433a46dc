"""In-place recovery with real processes: 4 CPU workers on Gloo lose workers and carry on.

Each test runs `ftrun` over tests/workloads/faulty_train.py (or await_train.py, the same training with
waits on the event log where a joiner is involved) with faults planted at exact steps, and checks what
a user cares about: the job succeeds, no survivor was restarted, no step is lost or applied twice, the
loss of every step is the fault-free run's, and the recovery is recorded in the event log.
"""

from __future__ import annotations

import re

import pytest

from ftrun.agent.forkserver import WORKER_API
from runs import NATIVE, NO_WATCHDOG, NPROC, PHASES, RTOL, STEPS, check_in_place, check_steps

pytestmark = pytest.mark.compat  # every test here runs on torch's current release too (.ci/run)

# ---------------------------------------------------------------------------------- in-place faults
def test_sigkill_of_a_middle_rank_is_recovered_in_place(launch, baseline):
    run = launch(faults="kill:5:2")
    check_in_place(run, baseline, lost={2: -9}, fault_step=5)


def test_sigkill_of_rank_0_is_recovered_and_rank_1_becomes_rank_0(launch, baseline):
    run = launch(faults="kill:5:0")
    check_in_place(run, baseline, lost={0: -9}, fault_step=5)
    # the new rank 0 (uid 1) prints the example's per-step lines from the recovery on
    assert any("[default1]: commit uid=1 rank=0 world=3 step=5 " in line for line in run.stdout.splitlines())


def test_sigkill_inside_the_gradient_allreduce_discards_the_step_and_replays_it(launch, baseline):
    run = launch(faults="allreduce:5:1")
    check_in_place(run, baseline, lost={1: -9}, fault_step=5)


def test_exception_in_a_worker_is_recovered_in_place(launch, baseline):
    run = launch(faults="exception:5:3")
    check_in_place(run, baseline, lost={3: 1}, fault_step=5)
    assert "planted exception at step 5" in run.stderr


def test_two_workers_killed_at_once_are_recovered_in_one_recovery(launch, baseline):
    run = launch(faults="kill:5:1,kill:5:2")
    check_in_place(run, baseline, lost={1: -9, 2: -9}, fault_step=5)


def test_second_fault_during_recovery_is_folded_into_the_same_recovery(launch, baseline):
    # uid 1 dies before step 4; uid 2 dies while re-forming the group for the first new generation
    run = launch(faults="kill:4:1,recovery:4:2")
    recovery = check_in_place(run, baseline, lost={1: -9, 2: -9}, fault_step=4)
    assert [e["gen"] for e in run.of("generation")] == [1, 2] and recovery["gen"] == 2, run.explain()


@pytest.mark.parametrize("data_reconfigure", ["fresh", NATIVE])
def test_respawned_worker_rejoins_with_a_peers_state_and_world_returns_to_4(launch, baseline, data_reconfigure):
    # The survivors wait before step 8 until the joiner has been placed (an event in the log), and the
    # joiner waits until they are there, so the rejoin happens at a known step however long (or short) the
    # new process takes to start. native: the survivors' data group is reconfigured in place at both
    # generations, and the new process's, made for reconfigure as it starts, joins theirs.
    run = launch("--respawn", *NO_WATCHDOG, "--data-reconfigure", data_reconfigure, faults="kill:5:2",
                 wait="8:joined,joiner:at_8*3", script="await_train.py")
    check_in_place(run, baseline, lost={2: -9}, fault_step=5, respawned=(4,))
    why = run.explain()
    planes = {"native": "reconfigured", "fresh": "formed"}[data_reconfigure]
    assert [r["data_plane"] for r in run.of("recovery")] == [planes, planes], why
    joins = [r for r in run.of("recovery") if r["kind"] == "join"]
    assert len(joins) == 1, why
    join = joins[0]
    assert (join["world_before"], join["world_after"], join["joiners"]) == (3, 4, [4]), why
    assert join["steps_lost"] == 0 and join["resumed_at_step"] == 8, why
    assert set(join["phases"]) == PHASES and all(v >= 0 for v in join["phases"].values()), why
    generations = run.of("generation")
    assert [(g["members"], g["joiners"]) for g in generations] == [([0, 1, 3], []), ([0, 1, 3, 4], [4])], why
    respawned = [e for e in run.of("worker_start") if e["uid"] == 4]
    assert respawned[0]["joiner"] and respawned[0]["local_rank"] == 2, why
    # every worker, the replacement too, came from the fork server (a torch script; none was refused)
    assert all(e["forked"] for e in run.of("worker_start")) and not run.of("fork_server")[1:], why
    assert set(WORKER_API) <= set(run.of("fork_server")[0]["preloaded"]), why  # a script of the worker API's
    assert {e["uid"]: e["exitcode"] for e in run.of("worker_exit")}[4] == 0, why
    # the joiner committed every step from the rejoin on, as rank 3 of 4, with the baseline's losses
    assert [c.step for c in run.commits()[4]] == list(range(8, STEPS)), why
    assert "recovered from joiner arriving" in run.stderr and "world 3 -> 4, 0 steps lost" in run.stderr, why


def test_spare_takes_over_a_lost_worker_and_world_stays_4(launch, baseline):
    # every worker waits before step 5 until the spare is ready, so the fault finds it ready
    run = launch("--spares", "1", *NO_WATCHDOG, faults="kill:5:2", wait="5:joiner_ready", script="await_train.py")
    recovery = check_in_place(run, baseline, lost={2: -9}, fault_step=5, joiners=(4,))
    assert recovery["joiners"] == [4], run.explain()
    assert [c.step for c in run.commits()[4]] == list(range(5, STEPS)), run.explain()
    assert len(run.of("recovery")) == 1 and len(run.of("generation")) == 1, run.explain()
    assert all(e["forked"] for e in run.of("worker_start")), run.explain()  # the spare too: from the fork server


# ------------------------------------------------------------------------------------------ fallback
def test_script_without_the_worker_api_falls_back_to_a_group_restart(launch, tmp_path):
    run = launch("--max-restarts", "1", script="fail_rank1.py", training=[str(tmp_path)], nproc=2)
    why = run.explain()
    assert run.returncode == 1, why  # rank 1 fails in both attempts
    refused = run.of("recovery_refused")
    assert len(refused) == 2, why
    assert all(re.search(r"does not use the (ftrun )?worker API", e["reason"]) for e in refused), why
    assert [e["attempt"] for e in run.of("worker_start")] == [0, 0, 1, 1], why
    assert [e["attempt"] for e in run.of("attempt_end")] == [0, 1], why
    assert not run.of("generation") and not run.of("recovery"), why
    assert "restarting the group (restart 1 of 1)" in run.stderr, why
    # the console says why, as the fault is seen, and what to change
    assert "rank 1 lost (exit code 1): no in-place recovery: not every worker had joined through ftrun.init()" \
        in run.stderr and "README, 'The worker API'" in run.stderr, why
    assert re.search(r"^ftrun: failed: no step reported in \d+\.\d s; 2 faults, 0 recoveries in place, "
                     r"1 group restart$", run.stderr, re.M), why


def test_recovery_that_cannot_reach_min_nproc_falls_back_and_the_restart_completes(launch, baseline):
    # A respawned worker could bring the world back to --min-nproc 4, so the survivors wait for it; it
    # is held back (it waits for "recovery_failed" in the log) so --join-timeout expires deterministically.
    # Faults fire in attempt 0 only, so the restarted group trains from scratch without one.
    run = launch("--respawn", "--min-nproc", "4", "--join-timeout", "2", "--max-restarts", "1",
                 faults="kill:5:2", wait="joiner:recovery_failed", script="await_train.py")
    why = run.explain()
    assert run.returncode == 0, why
    failed = run.of("recovery_failed")
    assert len(failed) == 1 and "--join-timeout 2 s" in failed[0]["reason"], why
    assert not run.of("generation") and not run.of("recovery"), why
    notice = [line for line in run.stderr.splitlines() if "restarting the group (restart 1 of 1)" in line]
    assert len(notice) == 1 and "no joiner came within --join-timeout 2 s to reach --min-nproc 4" in notice[0], why
    assert [(e["attempt"], e["succeeded"]) for e in run.of("attempt_end")] == [(0, False), (1, True)], why
    second = [e for e in run.of("worker_start") if e["attempt"] == 1]
    assert [e["uid"] for e in second] == [0, 1, 2, 3], why
    assert all(e["exitcode"] == 0 for e in run.of("worker_exit") if e["pid"] in {e["pid"] for e in second}), why
    # The restart trains to the end, from scratch or from the state the survivors saved before it
    # (then nothing committed is lost: they had committed steps 0..4), with the baseline's losses.
    rescues = [e["best_step"] for e in run.of("rescue") if e["best_step"] >= 0]
    assert rescues in ([], [4]), why
    start = rescues[0] + 1 if rescues else 0
    first = run.commits(attempt=0)
    assert all([c.step for c in first[uid]] == list(range(5)) for uid in range(NPROC)), why
    restarted = run.commits(attempt=1)
    assert set(restarted) == set(range(NPROC)), why
    for uid, lines in restarted.items():
        assert [c.step for c in lines] == list(range(start, STEPS)), why
        assert all(c.world == NPROC and c.rank == uid for c in lines), why
        for c in lines:
            assert c.loss == pytest.approx(baseline[c.step], rel=RTOL), f"{c}\n{why}"


def test_no_recovery_flag_gives_a_plain_group_failure_like_torchrun(launch):
    run = launch("--no-recovery", faults="kill:5:2")
    why = run.explain()
    assert run.returncode == 1, why
    for kind in ("fault", "generation", "recovery", "recovery_refused", "recovery_failed"):
        assert not run.of(kind), why
    assert len(run.of("group_failure")) == 1 and "rank 2" in run.of("group_failure")[0]["reason"], why
    assert [e["outcome"] for e in run.of("end")] == ["failed"], why
    assert len(run.of("worker_start")) == NPROC, why  # nothing restarted
    exits = {e["uid"]: e["exitcode"] for e in run.of("worker_exit")}
    assert exits[2] == -9 and all(exits[uid] != 0 for uid in (0, 1, 3)), why  # the others were stopped
    assert max(c.step for lines in run.commits().values() for c in lines) == 4, why  # no step after the fault
    assert "recovered" not in run.stderr and "ended with signal SIGKILL" in run.stderr, why


# ----------------------------------------------------------------------------------- late joiner
def test_joiner_ready_when_the_survivors_have_finished_does_not_fail_the_job(launch, baseline):
    # The survivors finish all their steps, then wait (after the loop, e.g. saving a checkpoint) until
    # the respawned worker is ready to join; it is held back until the three have left their loops.
    # Training is complete: the late joiner is not placed, and must not turn the run into a failure (nor,
    # with --max-restarts, into a restart from scratch).
    run = launch("--respawn", "--recovery-timeout", "5", *NO_WATCHDOG, faults="kill:5:2",
                 wait="end:joiner_ready,joiner:left_loop*3", script="await_train.py")
    why = run.explain()
    assert run.returncode == 0, why
    assert not run.of("recovery_failed"), why
    assert not any(g["joiners"] for g in run.of("generation")), why
    check_steps(run, baseline, {2: -9})
