"""Faults that end no process: a reset link between two live workers, a failure the data plane's backend records
(NCCL's watchdog), and a link that drops every packet.

The survivors are every worker (or all but the fewest the leader must exclude); no committed step is lost and
the loss is the fault-free run's.
"""

from __future__ import annotations

import json

import pytest

from runs import NPROC, check_steps


def every_worker_lived(run) -> str:  # noqa: ANN001 -- a finished launch of tests/runs.py
    """Assert that the job succeeded with each of the workers it started, each in one process to the end, and no
    fault, failed recovery or group failure: the fault ended no process. Returns the run's explanation."""
    why = run.explain()
    assert run.returncode == 0, why
    starts = {e["uid"]: e["pid"] for e in run.of("worker_start")}
    exits = {e["uid"]: (e["pid"], e["exitcode"]) for e in run.of("worker_exit")}
    assert sorted(starts) == list(range(NPROC)) and exits == {uid: (pid, 0) for uid, pid in starts.items()}, why
    assert not run.of("fault") and not run.of("recovery_failed") and not run.of("group_failure"), why
    return why


def test_a_reset_link_between_two_live_workers_re_forms_the_same_group(launch, baseline):
    """Rank 1 shuts down its connections to one other worker at step 5 (a reset, both processes alive): the
    collective fails, the same four workers re-form after a probe finds every link working, and train on."""
    run = launch(faults="reset:5:1")
    why = every_worker_lived(run)
    (link,) = run.of("link_fault")
    assert link["action"] == "reform" and link["gen"] == 0 and "a collective failed with every worker alive" \
        in link["reason"], why
    (generation,) = run.of("generation")
    assert generation["members"] == list(range(NPROC)) and generation["gen"] == 1, why
    (recovery,) = run.of("recovery")
    assert (recovery["kind"], recovery["world_before"], recovery["world_after"], recovery["steps_lost"]) == \
        ("link", NPROC, NPROC, 0), why
    assert recovery["resumed_at_step"] == 5, why
    assert "ftrun: recovered from a link fault in" in run.stderr, why
    check_steps(run, baseline, {})


@pytest.mark.compat
def test_a_failure_the_backend_records_after_the_step_fails_it_and_the_same_group_trains_on(launch, baseline):
    """At step 5's commit, rank 2's data plane reports an asynchronous failure (as NCCL's watchdog records one,
    while the collective's future was done since it was queued): the step is not applied there, the same four
    workers re-form, rank 2 takes the committed state from a peer, and the loss is the fault-free run's."""
    run = launch(faults="backend:5:2")
    why = every_worker_lived(run)
    (link,) = run.of("link_fault")
    assert link["action"] == "reform" and "reported COMM_ERROR" in json.dumps(link), why
    (recovery,) = run.of("recovery")
    assert (recovery["kind"], recovery["world_before"], recovery["world_after"], recovery["steps_lost"]) == \
        ("link", NPROC, NPROC, 0), why
    check_steps(run, baseline, {})
