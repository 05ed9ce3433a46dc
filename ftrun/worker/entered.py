"""Telling the agent that a step's collectives started, only for a step still uncommitted a moment later."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

ENTERED_DELAY = 0.2  # seconds a step may wait in its collectives before the agent is told


class EnteredNotice:
    """Sends ``entered`` for a step whose collectives started ``delay`` seconds ago and that has not committed.

    The agent's hang watchdog asks, of a rank silent past its hang timeout, whether it waits in a collective
    (its peers hold it up) or computes (it holds them up). A message at every step's first collective would
    wake the agent once more per step and worker, CPU the workers lose where cores are few; the step's entry
    is kept here instead, and a thread of its own sends it only for a step still uncommitted ``delay``
    seconds later: long before any hang timeout (30 s at the least, seconds with ``--hang-timeout``), and
    never for a step that commits sooner.
    """

    def __init__(self, send: Callable[[int], None], delay: float = ENTERED_DELAY) -> None:
        self._send = send
        self._delay = delay
        self._lock = threading.Lock()
        self._entry: tuple[int, float] | None = None  # (step, time.monotonic()) of an entry not yet sent
        threading.Thread(target=self._run, name="ftrun-entered", daemon=True).start()

    def entered(self, step: int) -> None:
        """The first collective of ``step`` started."""
        with self._lock:
            self._entry = (step, time.monotonic())

    def left(self) -> None:
        """The step committed or was abandoned: it no longer waits in its collectives."""
        with self._lock:
            self._entry = None

    def _run(self) -> None:
        while True:
            time.sleep(self._delay / 2)
            with self._lock:
                due = self._entry if self._entry and time.monotonic() - self._entry[1] >= self._delay else None
                if due is not None:
                    self._entry = None
            if due is not None:
                self._send(due[0])
