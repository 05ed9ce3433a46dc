"""The progress notice: a worker's first commits and each generation's first told at once, others now and then."""

from __future__ import annotations

import types

import pytest

from ftrun.protocol import PROGRESS_EVERY, PROGRESS_FIRST
from ftrun.worker import progress
from ftrun.worker.progress import ProgressNotice

pytestmark = pytest.mark.fast


def test_the_first_commits_and_each_generations_first_are_told_the_rest_now_and_then(monkeypatch):
    clock = types.SimpleNamespace(now=100.0)
    monkeypatch.setattr(progress, "time", types.SimpleNamespace(monotonic=lambda: clock.now))
    told: list[tuple[int, int]] = []
    notice = ProgressNotice(lambda gen, step, _: told.append((gen, step)))
    for step in range(10):  # all within one moment
        notice.committed(0, step, 0.01)
    assert told == [(0, step) for step in range(PROGRESS_FIRST)]
    notice.committed(1, 10, 0.01)  # a new generation's first commit ends a recovery: told at once
    notice.committed(1, 11, 0.01)
    clock.now += PROGRESS_EVERY
    notice.committed(1, 12, 0.01)
    assert told[PROGRESS_FIRST:] == [(1, 10), (1, 12)]
