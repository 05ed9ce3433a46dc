"""The worker's part in fault drills (`ftrun inject exception|slow`): acted out in its main thread, at a step."""

from __future__ import annotations

import threading
import time
from typing import Any

from ftrun import protocol


class InjectedFault(RuntimeError):
    """Raised in the training loop by `ftrun inject exception`: the worker fails as if its code had raised."""


class WorkerDrills:
    """Drills the agent asked for, applied by :meth:`at_step` at the start of each step.

    Messages arrive on the channel thread; an exception must be raised in the main thread, and a delay
    must be spent inside a step (so that the step time the agent sees grows, as a slow rank's would).
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._error: str | None = None
        self._delay = 0.0
        self._until: float | None = None  # time.monotonic() when the delay ends; None: until cleared

    def on_message(self, message: dict[str, Any]) -> bool:
        """Take a drill message from the agent; False when ``message`` is not one."""
        kind = message.get("t")
        with self._lock:
            if kind == protocol.RAISE:
                self._error = message["message"]
            elif kind == protocol.SLOW:
                self._delay = float(message["seconds"])
                duration = message.get("duration")
                self._until = None if duration is None else time.monotonic() + float(duration)
            else:
                return False
        return True

    def at_step(self) -> None:
        """Raise the injected exception, or sleep the injected delay, if a drill asks for one."""
        with self._lock:
            error, self._error = self._error, None
            if self._until is not None and time.monotonic() >= self._until:
                self._delay, self._until = 0.0, None
            delay = self._delay
        if error is not None:
            raise InjectedFault(error)
        if delay > 0:
            time.sleep(delay)  # the drill itself: this step takes that much longer
