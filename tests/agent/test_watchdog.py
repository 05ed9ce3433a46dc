"""The hang watchdog on a live job: a SIGSTOPped worker is declared hung, dumped, killed; the others recover."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import EXAMPLE

from ftrun.agent.watchdog import HangWatchdog
from ftrun.health.hangs import HangPolicy, hang_timeout


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


def test_sigstopped_worker_is_detected_dumped_killed_and_the_survivors_recover(launcher_env, tmp_path):
    """A worker frozen by SIGSTOP at step 8: declared hung, its stacks dumped, killed; 3 survivors finish."""
    log_dir = tmp_path / "logs"
    proc = subprocess.Popen(
        [sys.executable, "-m", "ftrun", "--nproc-per-node", "4", "--hang-timeout", "3", "--log-dir", str(log_dir),
         EXAMPLE, "--steps", "80", "--width", "256"],
        env=launcher_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    stopped_pid = None
    try:
        for line in proc.stdout:
            if stopped_pid is None and "step=8 " in line:
                events = _events(log_dir)
                stopped_pid = next(e["pid"] for e in events if e["event"] == "worker_start" and e["rank"] == 2)
                os.kill(stopped_pid, signal.SIGSTOP)
        stderr = proc.stderr.read()
        assert proc.wait(timeout=120) == 0, stderr
    finally:
        proc.kill()
    events = _events(log_dir)
    (hang,) = [e for e in events if e["event"] == "hang"]  # one hang, one event
    assert hang["pid"] == stopped_pid and hang["stopped"] and hang["silent_for"] >= 3
    assert "most recent call first" in stderr  # the faulthandler dump of the hung worker
    recovery = next(e for e in events if e["event"] == "recovery")
    assert recovery["lost_ranks"] == [2] and recovery["world_after"] == 3 and recovery["steps_lost"] == 0
    survivors = {e["pid"] for e in events if e["event"] == "worker_start"} - {stopped_pid}
    exits = {e["pid"]: e["exitcode"] for e in events if e["event"] == "worker_exit"}
    assert all(exits[pid] == 0 for pid in survivors)


def _events(log_dir: Path) -> list[dict]:
    (path,) = log_dir.glob("*/events.jsonl")
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
