"""The event tally's end-of-run summary, from synthetic events."""

from __future__ import annotations

import pytest

from ftrun.tally import run_summary, tally_events

pytestmark = pytest.mark.fast


def events(*records: tuple[str, dict]) -> list[dict]:
    return [{"time": 100.0 + i, "event": kind, **fields} for i, (kind, fields) in enumerate(records)]


def test_a_fault_free_run_says_so():
    tally = tally_events(events(("start", {"world_size": 4}), ("attempt_end", {"last_step": 79}),
                                ("end", {"outcome": "succeeded"})))
    assert run_summary(tally, now=142.3) == "ftrun: succeeded: 80 steps in 42.3 s, no fault"


def test_recoveries_and_a_group_restart_are_time_lost():
    tally = tally_events(events(
        ("start", {"world_size": 4}), ("fault", {"rank": 2}), ("recovery", {"latency": 0.2, "kind": "fault"}),
        ("recovery_refused", {"uid": 1}), ("worker_start", {"attempt": 1}), ("resumed", {"latency": 5.8}),
        ("attempt_end", {"last_step": 99}), ("end", {"outcome": "succeeded"})))
    assert run_summary(tally, now=200.0) == ("ftrun: succeeded: 100 steps in 100.0 s; 2 faults, 1 recovery in place "
                                             "(median 0.20 s), 1 group restart; 6.00 s lost to them, goodput 0.940")


def test_a_failed_run_has_no_goodput():
    tally = tally_events(events(("start", {}), ("recovery_refused", {"uid": 1}), ("end", {"outcome": "failed"})))
    assert run_summary(tally, now=110.0) == ("ftrun: failed: no step reported in 10.0 s; 1 fault, "
                                             "0 recoveries in place, 0 group restarts")
