"""Hang detection: the timeout policy and the choice of culprit, as pure functions."""

from __future__ import annotations

import pytest

from ftrun.health.hangs import HangPolicy, RankActivity, hang_timeout, hung_ranks

pytestmark = pytest.mark.fast


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
