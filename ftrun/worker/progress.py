"""Telling the agent of committed steps: each of a worker's first ones, the first of each generation, else now
and then (``protocol.PROGRESS_FIRST`` and ``PROGRESS_EVERY`` say why)."""

from __future__ import annotations

import time
from collections.abc import Callable

from ftrun.protocol import PROGRESS_EVERY, PROGRESS_FIRST


class ProgressNotice:
    """Decides which commits ``send(gen, step, step_time)`` tells the agent, and tells them."""

    def __init__(self, send: Callable[[int, int, float], None]) -> None:
        self._send = send
        self._last = (-1, 0.0)  # (generation, time.monotonic()) of the last commit told
        self._count = 0  # commits told

    def committed(self, gen: int, step: int, step_time: float) -> None:
        """Step ``step`` of generation ``gen`` committed, ``step_time`` seconds after it began."""
        now = time.monotonic()
        if self._count >= PROGRESS_FIRST and self._last[0] == gen and now - self._last[1] < PROGRESS_EVERY:
            return
        self._last, self._count = (gen, now), self._count + 1
        self._send(gen, step, step_time)
