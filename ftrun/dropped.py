"""Writes a full disk may refuse: the agent's event log and the workers' log files drop, never crash.

A write that fails (ENOSPC, EDQUOT, EIO, a read-only remount...) is dropped whole: :func:`append` takes back
the part that made it to the file, so a reader never meets half a line. :class:`DroppedWrites` counts what
was dropped, says so once on the console, and hands over what was lost when writing works again, for a
``writes_dropped`` event.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any


def append(fd: int, data: bytes) -> None:
    """Append all of ``data`` to the file open (``O_APPEND``) on ``fd``, or none of it: OSError when it failed.

    A full disk takes a write in part, then refuses the rest; that part is cut off again, so a record
    (a line) is in the file whole or not at all.
    """
    start = os.fstat(fd).st_size
    view = memoryview(data)
    try:
        while view:
            written = os.write(fd, view)
            if written == 0:
                raise OSError(28, os.strerror(28))  # ENOSPC: nothing more fits
            view = view[written:]
    except OSError:
        try:
            os.ftruncate(fd, start)
        except OSError:
            pass  # not a regular file (or gone): nothing to take back
        raise


class DroppedWrites:
    """The writes of one kind (the event log, the worker logs) that failed, since they last worked.

    ``notice`` is called once in the life of this object, at the first failure: a disk at the edge of full
    fails and recovers over and over, and one line is what a person needs. Every later outage is recorded
    by the event :meth:`lost` describes once writing works again.
    """

    def __init__(self, what: str, notice: Callable[[str], None] | None) -> None:
        self.what = what
        self.count = 0  # writes dropped since the last one that worked
        self.since: float | None = None  # wall clock of the first of them
        self.error = ""
        self._notice = notice
        self._said = False

    def failed(self, error: OSError) -> None:
        """A write of this kind failed with ``error``: count it, and say so the first time."""
        if self.count == 0:
            self.since = round(time.time(), 6)
            self.error = error.strerror or str(error)
        self.count += 1
        if not self._said and self._notice is not None:
            self._said = True
            self._notice(f"ftrun: cannot write {self.what} ({self.error}): dropping what does not fit, and "
                         "carrying on; the run's events record how much once writing works again")

    def lost(self) -> dict[str, Any] | None:
        """The fields of a ``writes_dropped`` event for what was dropped since writing last worked, or None."""
        if self.count == 0:
            return None
        return {"what": self.what, "count": self.count, "since": self.since, "error": self.error}

    def recorded(self) -> None:
        """The :meth:`lost` event was handed to the event log: start counting afresh."""
        self.count, self.since, self.error = 0, None, ""
