"""The hang watchdog: steps told together count towards its warm-up; on a live job a worker hung in its own code
is declared hung, dumped, killed, and the others recover in place."""

from __future__ import annotations

import re
import signal
import subprocess
import sys

import pytest

from runs import NPROC, TIMEOUT, TRAINING, check_in_place, read_run
from ftrun.agent.watchdog import HangWatchdog
from ftrun.health.hangs import HangPolicy, hang_timeout
from ftrun.protocol import STACK_DUMP_SIGNAL


@pytest.mark.fast
def test_steps_told_in_one_progress_message_each_count_towards_the_warmup():
    # a worker tells its commits now and then: steps 1 to 5 come with the message of step 5
    policy = HangPolicy(fixed=3.0)
    watchdog = HangWatchdog(workers=None, log=None, notices=None, policy=policy)
    watchdog.committed(0, 0, 0.01)
    assert hang_timeout(policy, watchdog.progress[0].step_times, watchdog.progress[0].committed) == policy.warmup
    watchdog.committed(0, 5, 0.01)
    assert watchdog.progress[0].committed == 6
    assert hang_timeout(policy, watchdog.progress[0].step_times, watchdog.progress[0].committed) == 3.0


DUMP_REQUEST = f"os.kill(os.getpid(), {int(STACK_DUMP_SIGNAL)})\n"  # as the agent's watchdog asks


def run_answering(*lines: str) -> subprocess.CompletedProcess[str]:
    """A Python process that imports os, faulthandler and threading, answers dump requests, then runs ``lines``."""
    script = ("import faulthandler, os, threading\n"
              "from ftrun.worker.stack_dumps import answer_stack_dump_requests\n" + "".join(lines))
    return subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)


def test_a_dump_request_after_faulthandler_let_go_is_lost_not_the_workers_death():
    """A worker slow to exit can be declared hung after Python's end has unregistered faulthandler's handler:
    the request then finds the disposition from before (ignore), and the worker still ends with its own status."""
    done = run_answering(
        "answer_stack_dump_requests()\n",
        DUMP_REQUEST,  # while running: the stacks go to stderr
        f"faulthandler.unregister({int(STACK_DUMP_SIGNAL)})\n",  # as Python's finalization does
        DUMP_REQUEST,
        "raise SystemExit(1)\n")
    assert done.returncode == 1, (done.returncode, done.stderr[-2000:])
    assert done.stderr.count("most recent call first") == 1, done.stderr[-2000:]


def test_a_session_begun_outside_the_main_thread_still_answers_dump_requests():
    """Python sets a signal's disposition only from the main thread: elsewhere the ignore is left out, not the dump."""
    done = run_answering(
        "begun = threading.Thread(target=answer_stack_dump_requests)\n",
        "begun.start(); begun.join()\n",
        DUMP_REQUEST)
    assert done.returncode == 0 and "Traceback" not in done.stderr, (done.returncode, done.stderr[-2000:])
    assert done.stderr.count("most recent call first") == 1, done.stderr[-2000:]


def test_a_rank_asleep_in_its_own_code_is_dumped_killed_and_the_survivors_recover_in_place(
        run_ftrun, workload, baseline, tmp_path):
    """Worker 2 sleeps before step 6, outside any collective, while its peers wait in step 6's: it alone is
    declared hung, its Python stacks go to the log (where it sleeps), it is killed, and 3 survivors recover in
    place with no step lost. (A stopped rank, killed without a dump, is ``ftrun inject hang``'s drill.)"""
    logs = tmp_path / "logs"
    result = run_ftrun("--nproc-per-node", NPROC, "--hang-timeout", "3", "--log-dir", logs,
                       workload("faulty_train.py"), *TRAINING, env={"FAULTS": "sleep:6:2"}, timeout=TIMEOUT)
    run = read_run(result, logs)
    why = run.explain()
    check_in_place(run, baseline, lost={2: -signal.SIGKILL}, fault_step=6)
    (hang,) = run.of("hang")  # one hang, one event
    (start,) = [e for e in run.of("worker_start") if e["uid"] == 2]
    assert (hang["pid"], hang["stopped"], hang["in_collective"]) == (start["pid"], False, False), why
    assert hang["silent_for"] >= 3, why
    dump = run.stderr[run.stderr.index("most recent call first"):]  # faulthandler's, of the sleeping worker
    assert re.search(r'File ".*faulty_train\.py", line \d+ in plant\n', dump), why


def test_work_after_a_loop_left_mid_step_is_not_taken_for_a_hang(run_ftrun, workload, tmp_path):
    """Both workers break out of ft.steps() at step 5 with its collectives under way and the step uncommitted
    (as on a NaN loss), then work for 8 s, past the 3 s hang timeout: leaving the loop tells the agent they wait
    in no collective, so nothing is killed or re-formed, the job succeeds, and the summary counts the 5 steps
    committed (0-4)."""
    logs = tmp_path / "logs"
    result = run_ftrun("--nproc-per-node", "2", "--hang-timeout", "3", "--log-dir", logs, workload("break_early.py"),
                       timeout=TIMEOUT)
    run = read_run(result, logs)
    why = run.explain()
    assert result.returncode == 0, why
    assert not run.of("hang") and not run.of("fault") and not run.of("recovery"), why
    assert "re-forming" not in run.stderr and "recovering in place" not in run.stderr, why
    assert run.stdout.count("after the loop: committed 4") == 2, why
    assert re.search(r"^ftrun: succeeded: 5 steps in \S+ s, no fault", run.stderr, re.M), why
