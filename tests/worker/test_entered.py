"""The entered notice: sent only for a step that stays in its collectives, once, and never for one that left."""

from __future__ import annotations

import threading

import pytest

from ftrun.worker.entered import EnteredNotice

pytestmark = pytest.mark.fast


def test_only_a_step_still_waiting_after_the_delay_is_reported_once():
    sent: list[int] = []
    arrived = threading.Event()

    def send(step: int) -> None:
        sent.append(step)
        arrived.set()

    notice = EnteredNotice(send, delay=0.5)
    notice.entered(1)
    notice.left()  # step 1 committed at once: never reported
    notice.entered(2)  # step 2 stays in its collectives
    assert arrived.wait(10)
    notice.entered(3)
    notice.left()
    assert sent == [2]
