"""The reading end of a mailbox: a thread that hands each message posted to one box to an event loop.

A mailbox has one reader (an agent) and any number of writers (``JobStore.post``: other agents, the
hostfile launcher, ``ftrun inject``). Posting is two store calls (``add`` then ``set``); the reader checks
for the next index every few milliseconds on a connection of its own.
"""

from __future__ import annotations

import os
import queue
import threading
from collections.abc import Callable
from typing import Any

from ftrun.store.job import JobStore, MalformedValue

POLL_INTERVAL = 0.01
"""Seconds between two looks for a mailbox's next message: a store round trip each, cheap."""
RECONNECT_INTERVAL = 1.0
"""Seconds between two attempts to reach a store that stopped answering."""
STOP_WAIT = 10.0
"""Seconds :meth:`stop` waits for the thread: longer than one store call on its connection."""


class MailReader:
    """Waits for each next message of one box and queues it for an event loop.

    It uses a store connection of its own (so the loop's calls never queue behind it), writes a byte to
    ``wake_fd`` so the loop can select on it, and :meth:`take` returns what arrived. A message that is not
    a JSON object is dropped and counted in :attr:`dropped`, never handed on.
    """

    def __init__(self, connect: Callable[[], JobStore], box: str, wake_fd: int) -> None:
        self.box = box
        self.wake_fd = wake_fd
        self.dropped = 0
        self._connect = connect
        self._queue: queue.SimpleQueue[dict[str, Any]] = queue.SimpleQueue()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"ftrun-mail-{box}", daemon=True)

    def start(self) -> None:
        """Start waiting for messages."""
        self._thread.start()

    def stop(self) -> None:
        """Stop at the next wake-up; messages not yet read stay in the store. and wait for the thread (bounded: a store call in flight has its
        own timeout), so it is not inside torch's C++ code when the interpreter exits, which would abort the
        process ("terminate called without an active exception").
        """
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(STOP_WAIT)

    def take(self) -> list[dict[str, Any]]:
        """The messages that arrived since the last call, in order."""
        messages = []
        while not self._queue.empty():
            messages.append(self._queue.get())
        return messages

    def _run(self) -> None:
        store = None
        index = 1
        while not self._stop.wait(0 if store is not None else RECONNECT_INTERVAL):
            try:
                store = store or self._connect()
                while not store.has_mail(self.box, index):  # check, not wait: a wait that times out logs
                    if self._stop.wait(POLL_INTERVAL):
                        return
                message = store.take_mail(self.box, index)
            except MalformedValue:
                self.dropped += 1
                index += 1
                continue
            except RuntimeError:  # the store went away: connect again
                store = None
                continue
            index += 1
            self._queue.put(message)
            try:
                os.write(self.wake_fd, b"m")
            except BlockingIOError:
                pass  # the loop has not read the earlier wake-ups yet: it will see this message too
