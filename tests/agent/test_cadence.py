"""How often nodes write what they publish now and then (ftrun.agent.cadence): pure, no process started."""

from __future__ import annotations

import pytest

from ftrun import protocol
from ftrun.agent.cadence import JOB_WRITES_PER_S, ProgressRelay, periodic_interval

pytestmark = pytest.mark.fast


def commit(gen: int, step: int) -> dict:
    return {"t": protocol.PROGRESS, "gen": gen, "step": step, "time": 1.0, "step_time": 0.1}


def told(*commits: tuple[int, dict]) -> dict:
    """The message that tells the leader these ``(uid, commit)``."""
    return {"t": protocol.COMMITS, "commits": [{"uid": uid, "msg": message} for uid, message in commits]}


@pytest.mark.parametrize("nodes, least, interval", [
    (1, 1.0, 1.0), (16, 2.0, 2.0), (200, 1.0, 1.0), (1_000, 1.0, 5.0), (1_000, 2.0, 5.0), (12_500, 1.0, 62.5)])
def test_a_nodes_cadence_keeps_its_least_until_the_whole_job_would_write_more_than_the_bound(nodes, least, interval):
    assert periodic_interval(nodes, least) == interval
    assert nodes / periodic_interval(nodes, least) <= max(JOB_WRITES_PER_S, nodes / least)


def test_the_first_commit_of_each_generation_goes_at_once_and_later_ones_together_at_the_cadence():
    relay = ProgressRelay(every=2.0)
    assert relay.commit(7, commit(0, 0)) and relay.commit(8, commit(0, 0))  # each worker's first of generation 0
    assert relay.take(10.0) == told((7, commit(0, 0)), (8, commit(0, 0)))
    assert not relay.due(10.0) and relay.take(10.0) is None
    for step in (1, 2, 3):
        assert not relay.commit(7, commit(0, step))
        assert not relay.commit(8, commit(0, step))
    assert not relay.due(11.9)
    assert relay.due(12.0)
    message = relay.take(12.0)
    assert message == told((7, commit(0, 3)), (8, commit(0, 3)))  # the latest of each worker alone
    assert protocol.mail_problem(message) is None  # as the leader's mailbox reader checks it
    assert not relay.commit(7, commit(0, 4))
    assert relay.commit(8, commit(1, 4))  # a new generation: at once, whatever the cadence
    assert relay.take(12.5) == told((7, commit(0, 4)), (8, commit(1, 4)))  # with what was held meanwhile
    assert relay.commit(7, commit(1, 5)) and not relay.commit(8, commit(1, 5))


def test_nothing_held_is_never_due():
    relay = ProgressRelay(every=0.0)
    assert not relay.due(100.0)
    relay.commit(1, commit(0, 0))
    assert relay.due(100.0)
