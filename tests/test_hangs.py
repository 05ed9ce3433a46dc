"""Hang detection: the timeout policy and culprit choice as pure functions, and a SIGSTOPped worker live."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from ftrun.health.hangs import HangPolicy, RankActivity, hang_timeout, hung_ranks

EXAMPLE = str(Path(__file__).resolve().parents[1] / "examples" / "train_ddp.py")


def test_timeout_is_a_multiple_of_the_median_step_within_floor_and_ceiling():
    policy = HangPolicy(multiplier=10, floor=30, ceiling=1800, warmup=600, warmup_steps=3)
    assert hang_timeout(policy, [5.0, 6.0, 7.0], steps_committed=10) == 60.0
    assert hang_timeout(policy, [0.05] * 5, steps_committed=10) == 30.0
    assert hang_timeout(policy, [500.0] * 5, steps_committed=10) == 1800.0


def test_first_steps_get_the_warmup_allowance_even_with_a_fixed_timeout():
    assert hang_timeout(HangPolicy(warmup=600), [0.05], steps_committed=1) == 600
    assert hang_timeout(HangPolicy(warmup=600, fixed=3), [0.05], steps_committed=1) == 600
    assert hang_timeout(HangPolicy(warmup=600, fixed=3), [0.05] * 5, steps_committed=5) == 3


def test_bad_bounds_are_refused():
    with pytest.raises(ValueError):
        HangPolicy(floor=10, ceiling=5)
    with pytest.raises(ValueError):
        HangPolicy(fixed=0)


def activity(silent: float, in_collective: bool, stopped: bool = False) -> RankActivity:
    return RankActivity(silent_for=silent, timeout=3.0, in_collective=in_collective, stopped=stopped)


def test_the_rank_quiet_outside_a_collective_is_the_culprit_and_its_waiting_peers_are_not():
    ranks = {0: activity(5, True), 1: activity(5, True), 2: activity(5, False), 3: activity(5, True)}
    assert hung_ranks(ranks) == ([2], False)


def test_a_stopped_process_is_a_culprit_even_inside_the_collective():
    ranks = {0: activity(5, True), 1: activity(5, True, stopped=True)}
    assert hung_ranks(ranks) == ([1], False)


def test_a_stopped_rank_explains_a_peer_that_went_quiet_outside_a_reported_collective():
    ranks = {0: activity(5, False), 1: activity(5, False, stopped=True), 2: activity(5, True)}
    assert hung_ranks(ranks) == ([1], False)


def test_all_ranks_silent_in_a_collective_means_the_group_is_stuck():
    assert hung_ranks({0: activity(5, True), 1: activity(5, True)}) == ([], True)


def test_ranks_within_their_timeout_are_left_alone():
    assert hung_ranks({0: activity(1, True), 1: activity(2, False)}) == ([], False)


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
