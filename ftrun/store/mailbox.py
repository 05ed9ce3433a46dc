"""The reading end of a mailbox: a thread that hands each message posted to one box to an event loop.

A mailbox has one reader (an agent) and any number of writers (``JobStore.post``: other agents, the
hostfile launcher, ``ftrun inject``). Posting is two store calls (``add`` takes the next index, ``set``
writes the sealed message there); the reader checks for its next index every few milliseconds on a
connection of its own.

Anyone who reaches the store can write to any index, before or after the writer that took it. So a value
that is not a sealed message (or not a valid one) never moves the reader on by itself: it is counted in
:attr:`MailReader.dropped` and the reader waits for the writer that took the index to overwrite it; only
once a writer took the index (``add``) and :data:`OVERWRITE_GRACE` seconds passed without a valid message
there is the index given up.
"""

from __future__ import annotations

import os
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

from ftrun.store.job import JobStore, MalformedValue

POLL_INTERVAL = 0.01
"""Seconds between two looks for a mailbox's next message: a store round trip each, cheap."""
RECONNECT_INTERVAL = 1.0
"""Seconds between two attempts to reach a store that stopped answering."""
RECHECK_INTERVAL = 0.05
"""Seconds between two reads of an index that holds something other than a valid message."""
OVERWRITE_GRACE = 5.0
"""Seconds the writer that took an index has to replace what someone else wrote there (its own ``set``
follows its ``add`` at once)."""

Validator = Callable[[dict[str, Any]], "str | None"]
"""Why a message is not one the reader accepts, or None when it is."""


class MailReader:
    """Waits for each next message of one box and queues it for an event loop.

    It uses a store connection of its own (so the loop's calls never queue behind it), writes a byte to
    ``wake_fd`` so the loop can select on it, and :meth:`take` returns what arrived. A value that is not a
    sealed JSON object, or that ``validate`` refuses, is dropped and counted in :attr:`dropped`, never
    handed on.
    """

    def __init__(self, connect: Callable[[], JobStore], box: str, wake_fd: int,
                 validate: Validator = lambda message: None) -> None:
        self.box = box
        self.wake_fd = wake_fd
        self.dropped = 0
        self.last_dropped: str | None = None
        """Why the last value dropped was refused."""
        self._validate = validate
        self._connect = connect
        self._queue: queue.SimpleQueue[dict[str, Any]] = queue.SimpleQueue()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"ftrun-mail-{box}", daemon=True)

    def start(self) -> None:
        """Start waiting for messages."""
        self._thread.start()

    def stop(self) -> None:
        """Stop at the next wake-up; messages not yet read stay in the store."""
        self._stop.set()

    def take(self) -> list[dict[str, Any]]:
        """The messages that arrived since the last call, in order."""
        messages = []
        while not self._queue.empty():
            messages.append(self._queue.get())
        return messages

    def _run(self) -> None:
        store = None
        index = 1
        refused = False  # whether what is at ``index`` was refused (and counted) already
        taken_since: float | None = None  # when a writer was first seen to hold ``index`` while it was refused
        retry = 0.0  # seconds before the next attempt to reach the store
        while not self._stop.wait(retry):
            try:
                retry = RECONNECT_INTERVAL
                store = store or self._connect()
                retry = 0.0
                while not store.has_mail(self.box, index):  # check, not wait: a wait that times out logs
                    if self._stop.wait(POLL_INTERVAL):
                        return
                message, problem = self._read(store, index)
                if problem is not None:
                    if not refused:
                        refused = True
                        self.dropped += 1
                        self.last_dropped = problem
                    if taken_since is None and store.mail_posted(self.box) >= index:
                        taken_since = time.monotonic()
                    if taken_since is None or time.monotonic() - taken_since < OVERWRITE_GRACE:
                        self._stop.wait(RECHECK_INTERVAL)
                        continue
                store.discard_mail(self.box, index)
            except RuntimeError:  # the store went away: connect again
                store = None
                continue
            index += 1
            refused, taken_since = False, None
            if problem is None:
                self._queue.put(message)
                try:
                    os.write(self.wake_fd, b"m")
                except BlockingIOError:
                    pass  # the loop has not read the earlier wake-ups yet: it will see this message too

    def _read(self, store: JobStore, index: int) -> tuple[dict[str, Any], str | None]:
        """Message ``index``, and why it is refused (None when it is handed on)."""
        try:
            message = store.read_mail(self.box, index)
        except MalformedValue as exc:
            return {}, str(exc)
        problem = self._validate(message)
        return message, None if problem is None else f"mailbox {self.box}, message {index}: {problem}"
