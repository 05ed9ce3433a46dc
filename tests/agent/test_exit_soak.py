"""Clean exits, repeated: the kill drill run 20 times, a plain script that exits without destroying its group
10 times per init method, and no run may end with an abort or a crash.

A survivor that aborts at interpreter exit (``terminate called without an active exception``, SIGABRT) or
crashes (SIGSEGV) does so in a fraction of runs: one run shows nothing. This test repeats a short 4-worker
drill (one worker SIGKILLed, the others recover in place and finish) and fails on any run whose job does not
succeed with every survivor ending with exit code 0. It takes minutes, so it is not part of the default
suite: ``python -m pytest -m soak`` runs it (see the README, "Tests"). The plain script is torch's own
test_script_init_method.py: an explicit ``init_method`` and no ``destroy_process_group`` before exit, which
once aborted at exit in most runs under ftrun.
"""

from __future__ import annotations

import pytest

from runs import NPROC, check_in_place

RUNS = 20
PLAIN_RUNS = 10
CRASH_MARKS = ("terminate called", "Segmentation fault", "Aborted", "core dumped", "Fatal Python error")

pytestmark = pytest.mark.soak


@pytest.mark.parametrize("run_index", range(RUNS))
def test_the_kill_drill_ends_every_process_cleanly(launch, baseline, run_index):
    victim, step = run_index % NPROC, 3 + run_index % 5  # every rank, rank 0 too, at several steps
    run = launch(faults=f"kill:{step}:{victim}")
    check_in_place(run, baseline, lost={victim: -9}, fault_step=step)
    marks = [mark for mark in CRASH_MARKS if mark in run.stderr]
    assert not marks, f"run {run_index}: {marks}\n{run.explain()}"


@pytest.mark.parametrize("run_index", range(PLAIN_RUNS))
@pytest.mark.parametrize("init_method", ["tcp", "env"])
def test_a_plain_script_that_never_destroys_its_group_exits_cleanly(run_ftrun, workload, free_port, init_method,
                                                                  run_index):
    port = free_port()  # tcp:// names the port of the job's store, as torch's test does with MASTER_PORT
    address = f"tcp://127.0.0.1:{port}" if init_method == "tcp" else "env://"
    result = run_ftrun("--nproc-per-node", NPROC, "--master-port", port, workload("init_method.py"),
                       "--init-method", address, timeout=120)
    why = f"run {run_index}, exit {result.returncode}\n{result.stderr[-3000:]}"
    assert result.returncode == 0, why
    assert result.stdout.count("Done") == NPROC, why
    assert not [mark for mark in CRASH_MARKS if mark in result.stderr], why
