"""Mailboxes: an agent's one reading thread, and the numbered messages each agent sends.

An agent's mailbox has one reader and two kinds of writers, each in its own lane of keys:

- agents (and the hostfile launcher) number the messages they send to each box themselves
  (:class:`Outbox`): no store counter is involved, so nothing written to the store can keep an agent from
  sending;
- clients (``ftrun inject``) post commands through the box's counter (``JobStore.post``: ``add`` takes
  the next index, ``set`` writes the command there).

Every writer rings the box's bell after its message, and the reader blocks on the bell between looks (a
store wait, served by the store's own event loop): a message is seen within a round trip, and an idle
reader makes about one store request per :data:`IDLE_WAIT` seconds per lane.

Anyone who reaches the store can write to any key, before or after the writer it belongs to. So a value
that is not a sealed message (or not a valid one) never moves the reader on by itself: it is counted in
:attr:`MailReader.dropped`, and the reader waits for the writer of that index to overwrite it. An index is
given up only :data:`OVERWRITE_GRACE` seconds after its writers were seen past it (the counter passed it,
or the agent's next message waits behind it): its writer failed between taking it and writing it, or
someone overwrote its message. Indices seen passed together are given up together.
"""

from __future__ import annotations

import os
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ftrun.store import keys
from ftrun.store.job import JobStore, MalformedValue

IDLE_WAIT = 20.0
"""Seconds a reader waits on its box's bell (:meth:`JobStore.ring`) before it looks at its lanes anyway, in
case a writer's message got through and its ring did not: an idle reader costs the store one blocking wait
and a look per lane this often, instead of polling."""
RECONNECT_INTERVAL = 1.0
"""Seconds between two attempts to reach a store that stopped answering."""
STOP_WAIT = 5.0
"""Seconds :meth:`MailReader.stop` waits for the thread (its store calls return in milliseconds)."""
OVERWRITE_GRACE = 5.0
"""Seconds the writer of an index has to write it once the next index holds a valid message (a writer
writes right after it numbers its message)."""

Validator = Callable[[dict[str, Any]], "str | None"]
"""Why a message is not one the reader accepts, or None when it is."""


class Outbox:
    """What one agent (or the hostfile launcher) sends to other agents' mailboxes, numbered per box from 1."""

    def __init__(self, store: JobStore, sender: str) -> None:
        self.store = store
        self.sender = sender
        self.sent: dict[str, int] = {}

    def send(self, box: str, message: dict[str, Any]) -> None:
        """Send ``message`` to ``box``. Its number is taken even if the store call fails: the reader then gives
        it up once a later message arrives."""
        self.send_many([(box, message)])

    def send_many(self, messages: list[tuple[str, dict[str, Any]]]) -> None:
        """Send each ``(box, message)``, in order per box, in as few store writes as the backend allows."""
        numbered = []
        for box, message in messages:
            index = self.sent[box] = self.sent.get(box, 0) + 1
            numbered.append((box, index, message))
        self.store.send_many(self.sender, numbered)


@dataclass
class _Lane:
    """One writer's (or the clients') sequence of keys in a box, and how far the reader got."""

    key: Callable[[int], str]
    passed: Callable[[JobStore, _Lane], int]  # the last index its writers are known to be past (0: none)
    index: int = 1
    refused: int = 0  # the last index whose value was refused (and counted)
    passed_since: float | None = None  # when the writers were first seen past ``index``...
    passed_upto: int = 0  # ... and every index up to this one
    sender: str = ""  # the agent that writes it ("": the clients' commands)

    def advance(self) -> None:
        self.index += 1
        if self.index > self.passed_upto:
            self.passed_since = None


class MailReader:
    """Reads one box, its commands and the messages of the agents in ``senders``, for an event loop.

    It uses a store connection of its own (so the loop's calls never queue behind it; one that can be
    interrupted, such as :class:`~ftrun.store.wire.StoreClient`, lets :meth:`stop` end its wait at once;
    torch's client logs each wait that times out), writes a byte to
    ``wake_fd`` so the loop can select on it, and :meth:`take` returns what arrived. A value that is not a
    sealed JSON object, or that ``validate`` refuses, is dropped and counted in :attr:`dropped`, never handed
    on. The reader only reads, checks and deletes keys: no value anyone writes can break its connection.
    """

    def __init__(self, connect: Callable[[], JobStore], box: str, wake_fd: int,
                 validate: Validator = lambda message: None, senders: tuple[str, ...] = ()) -> None:
        self.box = box
        self.wake_fd = wake_fd
        self.dropped = 0
        self.last_dropped: str | None = None
        """Why the last value dropped was refused."""
        self._validate = validate
        self._connect = connect
        self._lanes = [_Lane(lambda i: keys.mail_item(box, i), self._counter_passed)]
        self._lanes += [_Lane(lambda i, sender=sender: keys.sent_item(box, sender, i), self._next_is_valid,
                              sender=sender) for sender in senders]
        self._queue: queue.SimpleQueue[dict[str, Any]] = queue.SimpleQueue()
        self._lanes_lock = threading.Lock()  # held while a lane is dropped, and while a message is queued
        self._store: JobStore | None = None  # the connection in use, for stop() to interrupt
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"ftrun-mail-{box}", daemon=True)

    def start(self) -> None:
        """Start waiting for messages."""
        self._thread.start()

    def add_sender(self, sender: str, store: JobStore) -> None:
        """Read ``sender``'s messages too, from its first (a new leader's, after an election); the box's bell
        is rung through ``store`` (the caller's connection), so that what it wrote already is read now."""
        lane = _Lane(lambda i: keys.sent_item(self.box, sender, i), self._next_is_valid, sender=sender)
        self._lanes = [*self._lanes, lane]  # one assignment: the reader's thread sees the old list or the new
        store.ring(self.box)

    def drop_sender(self, sender: str) -> None:
        """Read nothing more of ``sender``'s (a leader replaced by an election: should it come back, its word
        is no longer the job's)."""
        with self._lanes_lock:
            self._lanes = [lane for lane in self._lanes if lane.sender != sender]

    def stop(self) -> None:
        """Stop, and wait (a few seconds at most) for the thread to leave its store call: a thread still inside
        torch's store client when the interpreter exits aborts the process (``terminate called without an
        active exception``). Messages not yet read stay in the store."""
        self._stop.set()
        store = self._store
        interrupt = getattr(store.kv, "interrupt", None) if store is not None else None
        if interrupt is not None:
            interrupt()
        if self._thread.is_alive():
            self._thread.join(STOP_WAIT)

    def take(self) -> list[dict[str, Any]]:
        """The messages that arrived since the last call, in order (per writer)."""
        messages = []
        while not self._queue.empty():
            messages.append(self._queue.get())
        return messages

    def _run(self) -> None:
        retry = 0.0  # seconds before the next attempt to reach the store
        while not self._stop.wait(retry):
            try:
                retry = RECONNECT_INTERVAL
                store = self._store = self._connect()
                retry = 0.0
                while not self._stop.is_set():
                    now = time.monotonic()
                    if not any([self._pump(store, lane, now) for lane in self._lanes]):  # every lane, each pass
                        store.await_ring(self.box, self._quiet_for(now))
            except RuntimeError:  # the store went away (or stop() interrupted it): connect again
                continue

    def _quiet_for(self, now: float) -> float:
        """How long to wait for the bell: until the first lane's writers' grace ends, at most IDLE_WAIT."""
        ends = [lane.passed_since + OVERWRITE_GRACE - now for lane in self._lanes if lane.passed_since is not None]
        return max(0.0, min([IDLE_WAIT, *ends]))

    def _pump(self, store: JobStore, lane: _Lane, now: float) -> bool:
        """Hand on the message at ``lane``'s index, or give the index up; whether the lane moved on."""
        key = lane.key(lane.index)
        if store.has_mail(key):
            message, problem = self._read(store, key)
            if problem is None:
                store.discard_mail(key)
                lane.advance()
                with self._lanes_lock:  # a lane dropped meanwhile hands nothing on
                    if any(lane is kept for kept in self._lanes):
                        self._queue.put(message)
                try:
                    os.write(self.wake_fd, b"m")
                except BlockingIOError:
                    pass  # the loop has not read the earlier wake-ups yet: it will see this message too
                return True
            if lane.refused != lane.index:
                lane.refused = lane.index
                self.dropped += 1
                self.last_dropped = problem
        if lane.passed_since is None:  # looked at each time the bell rings, or the reader's wait ends
            lane.passed_upto = lane.passed(store, lane)
            if lane.passed_upto >= lane.index:
                lane.passed_since = now
        elif now - lane.passed_since >= OVERWRITE_GRACE:
            store.discard_mail(key)
            lane.advance()
            return True
        return False

    def _counter_passed(self, store: JobStore, lane: _Lane) -> int:
        """How many command indices clients took (the counter is read with ``get``: ``add`` on a counter that
        holds no number makes the store drop the connection)."""
        counter = keys.mail_count(self.box)
        taken = store.kv.get(counter) if store.has_mail(counter) else b""
        return int(taken) if taken.isdigit() and len(taken) < 20 else 0

    def _next_is_valid(self, store: JobStore, lane: _Lane) -> int:
        """``lane``'s index when the agent's next message waits behind it (an agent writes in order), else 0."""
        behind = lane.key(lane.index + 1)
        return lane.index if store.has_mail(behind) and self._read(store, behind)[1] is None else 0

    def _read(self, store: JobStore, key: str) -> tuple[dict[str, Any], str | None]:
        """The message at ``key``, and why it is refused (None when it is handed on)."""
        try:
            message = store.read_mail(key)
        except MalformedValue as exc:
            return {}, str(exc)
        problem = self._validate(message)
        return message, None if problem is None else f"{key}: {problem}"
