"""Mailboxes: an agent's one reading thread, and the numbered messages each agent sends.

An agent's mailbox has one reader and two kinds of writers, each in its own lane of keys:

- agents (and the hostfile launcher) number the messages they send to each box themselves
  (:class:`Outbox`): no store counter is involved, so nothing written to the store can keep an agent from
  sending;
- clients (``ftrun inject``) post commands through the box's counter (``JobStore.post``: ``add`` takes
  the next index, ``set`` writes the command there).

Every writer rings the box's bell after its message, and the reader blocks on the bell between looks (a
store wait, served by the store's own event loop): a message is seen within a round trip, and an idle
reader makes about one store request per :data:`IDLE_WAIT` seconds per lane, each reader at its own moment
(:func:`idle_wait`).

Anyone who reaches the store can write to any key, before or after the writer it belongs to. So a value
that is not a sealed message (or not a valid one) never moves the reader on by itself: it is counted in
:attr:`MailReader.dropped`, and the reader waits for the writer of that index to overwrite it. An index is
given up only :data:`OVERWRITE_GRACE` seconds after its writers were seen past it (the counter passed it,
or the agent's next message waits behind it): its writer failed between taking it and writing it, or
someone overwrote its message. Indices seen passed together are given up together; of the commands, only
the last :data:`COMMANDS_IN_FLIGHT` below the counter are looked at (anyone may set the counter far ahead,
and a look per index would keep the reader and the store busy for ever).
"""

from __future__ import annotations

import os
import queue
import random
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
and a look per lane this often on average, instead of polling."""
IDLE_SPREAD = 0.5
"""How far a reader's wait strays from :data:`IDLE_WAIT` either way, as a fraction of it (:func:`idle_wait`)."""
RECONNECT_INTERVAL = 1.0
"""Seconds between two attempts to reach a store that stopped answering."""
STOP_WAIT = 5.0
"""Seconds :meth:`MailReader.stop` waits for the thread (its store calls return in milliseconds)."""
OVERWRITE_GRACE = 5.0
"""Seconds the writer of an index has to write it once the next index holds a valid message (a writer
writes right after it numbers its message); also how long a message waits for the broadcast sent before it."""
KEPT_BROADCASTS = 64
"""A sender's broadcasts a reader may still read: one this many before the sender's latest is given up (every
reader is past it by then; one still behind it was cut off for longer than its lease allows). The sender
deletes them this many at a time, every this many broadcasts, in one request: each delete is an event on
every reader's watch of the broadcasts (etcd), and one per broadcast cost every node a second event per plan."""
COMMANDS_IN_FLIGHT = 64
"""The most commands clients can have numbered and not yet written, or written and not yet read, at once
(each posts one and waits for its answer): a grace that ends gives up at once every command index below the
counter's last this many."""
AFTER = "_after"
"""The field of a message to one box that says how many broadcasts its sender had sent before it."""


def idle_wait(draw: float) -> float:
    """How long a reader waits on its bell before it looks anyway, for a ``draw`` in [0, 1): :data:`IDLE_WAIT`
    on average, spread evenly over IDLE_WAIT x (1 +- :data:`IDLE_SPREAD`). A plan's broadcast wakes every reader
    of a job in the same instant; with one fixed wait, all of them looked again together every IDLE_WAIT after
    it (on 2 cores, 1,024 simulated agents' looks kept both cores busy for 3 s of every 20, and a plan sent then
    reached the last agent 2 to 3 x later than one sent between them)."""
    return IDLE_WAIT * (1.0 - IDLE_SPREAD + 2.0 * IDLE_SPREAD * draw)


Validator = Callable[[dict[str, Any]], "str | None"]
"""Why a message is not one the reader accepts, or None when it is."""


class Outbox:
    """What one agent (or the hostfile launcher) sends to other agents' mailboxes, numbered per box from 1, and
    what it broadcasts to every node (numbered in the box :data:`~ftrun.store.keys.BROADCAST`)."""

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
        broadcasts = self.sent.get(keys.BROADCAST, 0)
        for box, message in messages:
            index = self.sent[box] = self.sent.get(box, 0) + 1
            numbered.append((box, index, {**message, AFTER: broadcasts} if broadcasts and box != keys.BROADCAST
                             else message))
        self.store.send_many(self.sender, numbered)

    def broadcast(self, message: dict[str, Any]) -> None:
        """Send ``message`` to every node that reads this sender's broadcasts: one write, whatever the number
        of nodes (each reader waits for its key; no bell is rung). A message this outbox sends to a box later
        is handed on after it (it carries the count of broadcasts before it, :data:`AFTER`)."""
        self.send_many([(keys.BROADCAST, message)])
        written = self.sent[keys.BROADCAST]
        if written > KEPT_BROADCASTS and written % KEPT_BROADCASTS == 0:
            self.store.discard_mail([keys.sent_item(keys.BROADCAST, self.sender, index)
                                     for index in range(written - 2 * KEPT_BROADCASTS + 1,
                                                        written - KEPT_BROADCASTS + 1)])


@dataclass
class _Lane:
    """One writer's (or the clients') sequence of keys in a box, and how far the reader got."""

    key: Callable[[int], str]
    probe: Callable[[_Lane], str]  # the key that tells whether its writers are past ``index``...
    passed: Callable[[JobStore, _Lane, bytes | None], int]  # ... read from its value: the last index they are
    # known to be past (0: none)
    index: int = 1
    refused: int = 0  # the last index whose value was refused (and counted)
    passed_since: float | None = None  # when the writers were first seen past ``index``...
    passed_upto: int = 0  # ... and every index up to this one
    sender: str = ""  # the agent that writes it ("": the clients' commands)
    shared: bool = False  # the sender's broadcasts: read by every node, deleted by the sender
    held_since: float | None = None  # when the message at ``index`` was first seen waiting for a broadcast

    def advance(self) -> None:
        self.index += 1
        self.held_since = None
        if self.index > self.passed_upto:
            self.passed_since = None


class MailReader:
    """Reads one box, its commands and the messages of the agents in ``senders``, and the broadcasts of those
    in ``broadcasts``, for an event loop.

    It uses a store connection of its own (so the loop's calls never queue behind it; one that can be
    interrupted, such as :class:`~ftrun.store.wire.StoreClient`, lets :meth:`stop` end its wait at once;
    torch's client logs each wait that times out), writes a byte to
    ``wake_fd`` so the loop can select on it, and :meth:`take` returns what arrived. A value that is not a
    sealed JSON object, or that ``validate`` refuses, is dropped and counted in :attr:`dropped`, never handed
    on. The reader only reads, checks and deletes keys: no value anyone writes can break its connection.

    A broadcast is read where its sender wrote it once for every node, and left there. The reader waits for
    its bell and for the next broadcast at once (on a backend that can), so a broadcast costs each reader its
    wait's answer and one read, with no look. A sender's message to the box is handed on after every broadcast it sent
    before it: each look reads the box's lanes before the broadcasts, and a message that names a broadcast
    not yet read waits for it (:data:`OVERWRITE_GRACE` seconds at most).
    """

    def __init__(self, connect: Callable[[], JobStore], box: str, wake_fd: int,
                 validate: Validator = lambda message: None, senders: tuple[str, ...] = (),
                 broadcasts: tuple[str, ...] = ()) -> None:
        self.box = box
        self.wake_fd = wake_fd
        self.dropped = 0
        self.last_dropped: str | None = None
        """Why the last value dropped was refused."""
        self._validate = validate
        self._connect = connect
        self._lanes = [_Lane(lambda i: keys.mail_item(box, i), lambda lane: keys.mail_count(box),
                             self._counter_passed)]
        self._lanes += [self._sender_lane(sender) for sender in senders]
        self._lanes += [self._sender_lane(sender, shared=True) for sender in broadcasts]
        self._discard: list[str] = []  # keys to delete with the next look: read, given up, or the rung bell
        self._queue: queue.SimpleQueue[dict[str, Any]] = queue.SimpleQueue()
        self._lanes_lock = threading.Lock()  # held while a lane is dropped, and while a message is queued
        self._store: JobStore | None = None  # the connection in use, for stop() to interrupt
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"ftrun-mail-{box}", daemon=True)

    def start(self) -> None:
        """Start waiting for messages."""
        self._thread.start()

    def add_sender(self, sender: str, store: JobStore, broadcasts: bool = False) -> None:
        """Read ``sender``'s messages too, from its first (a new leader's, after an election), and its
        broadcasts where ``broadcasts``; the box's bell is rung through ``store`` (the caller's connection), so
        that what it wrote already is read now."""
        added = [self._sender_lane(sender)] + ([self._sender_lane(sender, shared=True)] if broadcasts else [])
        self._lanes = [*self._lanes, *added]  # one assignment: the reader's thread sees the old list or the new
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

    def _sender_lane(self, sender: str, shared: bool = False) -> _Lane:
        if shared:  # its writer's sealed count of broadcasts: the ones at or below it that are gone were deleted
            return _Lane(lambda i: keys.sent_item(keys.BROADCAST, sender, i),
                         lambda lane: keys.broadcast_count(sender), self._broadcasts_written, sender=sender,
                         shared=True)
        return _Lane(lambda i: keys.sent_item(self.box, sender, i), lambda lane: lane.key(lane.index + 1),
                     self._next_is_valid, sender=sender)

    def _run(self) -> None:
        retry = 0.0  # seconds before the next attempt to reach the store
        while not self._stop.wait(retry):
            try:
                retry = RECONNECT_INTERVAL
                store = self._store = self._connect()
                retry = 0.0
                while not self._stop.is_set():
                    if not self._look(store, time.monotonic()) and self._await(store):
                        self._discard.append(keys.bell(self.box))  # deleted before the next look reads
            except RuntimeError:  # the store went away (or stop() interrupted it): connect again
                close = getattr(self._store.kv, "close", None) if self._store is not None else None
                if close is not None:
                    close()
                continue

    def _await(self, store: JobStore) -> bool:
        """Wait for the bell, and hand on the broadcasts that come meanwhile (each read by its own wait, with
        no look), until the bell rings (True), the wait ends, or a message to the box waits for a broadcast
        that came: the reader looks then."""
        bell = keys.bell(self.box)
        while not self._stop.is_set():
            shared = [lane for lane in self._lanes if lane.shared]
            came = store.await_ring(self.box, self._quiet_for(time.monotonic(), random.random()),
                                    {lane.key(lane.index): lane.key(lane.index + 1) for lane in shared})
            now = time.monotonic()
            for lane in shared:
                key = lane.key(lane.index)
                if key in came:
                    self._pump(store, lane, key, came[key], None, now)
            if not came or bell in came or any(lane.held_since is not None for lane in self._lanes):
                return bell in came
        return False

    def _quiet_for(self, now: float, draw: float) -> float:
        """How long to wait for the bell: until the first lane's writers' grace ends (or a held message's wait
        for its broadcast), at most :func:`idle_wait` of ``draw``."""
        ends = [since + OVERWRITE_GRACE - now for lane in self._lanes
                for since in (lane.passed_since, lane.held_since) if since is not None]
        return max(0.0, min([idle_wait(draw), *ends]))

    def _look(self, store: JobStore, now: float) -> bool:
        """One look at every lane, in one store call that first deletes what earlier looks took: hand on the
        message at each lane's index, or give the index up; whether to look again before waiting (a lane moved
        on, and its writers may be past its new index too). What a look took is deleted with the next, so a
        message costs its reader one round trip besides the wait. The box's lanes are read before the
        broadcasts and handed on after them: a message to the box that was written after a broadcast is never
        seen without it."""
        lanes = [lane for lane in self._lanes if not lane.shared] + [lane for lane in self._lanes if lane.shared]
        wanted = [[lane.key(lane.index)] + ([lane.probe(lane)] if lane.passed_since is None else [])
                  for lane in lanes]
        values = iter(store.look_at_mail(self._discard, [key for keys_ in wanted for key in keys_], self.box))
        self._discard = []
        looked = [(lane, keys_[0], next(values), next(values) if len(keys_) > 1 else None, len(keys_) > 1)
                  for lane, keys_ in zip(lanes, wanted)]
        again = False
        for lane, key, value, probed, was_probed in sorted(looked, key=lambda entry: not entry[0].shared):
            if self._pump(store, lane, key, value, probed, now):
                again = again or not was_probed or self._more_behind(store, lane, probed)
        return again

    def _more_behind(self, store: JobStore, lane: _Lane, probed: bytes | None) -> bool:
        """Whether ``lane``, just moved on, may hold its next message already: its probe, read for the index it
        left, shows a writer past that one (an agent's next key holds something, or the clients' counter is at
        the new index)."""
        if lane.shared:
            return self._broadcasts_written(store, lane, probed) >= lane.index
        if lane.sender:
            return probed is not None
        return self._counter_passed(store, lane, probed) >= lane.index

    def _pump(self, store: JobStore, lane: _Lane, key: str, value: bytes | None, probed: bytes | None,
              now: float) -> bool:
        """Hand on ``value``, the message at ``lane``'s index (``key``), or give the index up (``probed``: what
        its probe key holds); whether the lane moved on."""
        if value is not None:
            message, problem = self._open(store, key, value)
            if problem is None and self._waits_for_broadcast(lane, message, now):
                return False
            if problem is None:
                if not lane.shared:  # a broadcast stays for the other nodes
                    self._discard.append(key)
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
            lane.passed_upto = lane.passed(store, lane, probed)
            if lane.shared and lane.passed_upto - KEPT_BROADCASTS >= lane.index:  # deleted: skip them at once
                lane.index = lane.passed_upto - KEPT_BROADCASTS + 1
                lane.held_since = None
                return True
            if lane.passed_upto >= lane.index:
                lane.passed_since = now
        elif now - lane.passed_since >= OVERWRITE_GRACE:
            if not lane.shared:
                self._discard.append(key)
            lane.advance()
            if not lane.sender and not lane.shared:
                lane.index = max(lane.index, lane.passed_upto - COMMANDS_IN_FLIGHT + 1)
            return True
        return False

    def _waits_for_broadcast(self, lane: _Lane, message: dict[str, Any], now: float) -> bool:
        """Whether ``message`` (valid, at ``lane``'s index) waits for a broadcast its sender sent before it and
        this reader has not read yet; it waits OVERWRITE_GRACE seconds at most (that broadcast's write failed)."""
        after = message.get(AFTER)
        if lane.shared or not isinstance(after, int) or not any(
                other.shared and other.sender == lane.sender and other.index <= after for other in self._lanes):
            return False
        if lane.held_since is None:
            lane.held_since = now
        return now - lane.held_since < OVERWRITE_GRACE

    @staticmethod
    def _counter_passed(store: JobStore, lane: _Lane, taken: bytes | None) -> int:
        """How many command indices clients took (the counter's value is read, never added to: ``add`` on a
        counter that holds no number makes the store drop the connection)."""
        return int(taken) if taken is not None and taken.isdigit() and len(taken) < 20 else 0

    def _broadcasts_written(self, store: JobStore, lane: _Lane, count: bytes | None) -> int:
        """How many broadcasts ``lane``'s sender wrote, by its sealed count (0 when there is none, or it is not
        one the sender sealed): a reader that starts late gives up the ones already deleted."""
        if count is None:
            return 0
        try:
            written = store.open_mail(keys.broadcast_count(lane.sender), count).get("n")
        except MalformedValue:
            return 0
        return written if isinstance(written, int) else 0

    def _next_is_valid(self, store: JobStore, lane: _Lane, behind: bytes | None) -> int:
        """``lane``'s index when the agent's next message waits behind it (an agent writes in order), else 0."""
        ok = behind is not None and self._open(store, lane.key(lane.index + 1), behind)[1] is None
        return lane.index if ok else 0

    def _open(self, store: JobStore, key: str, raw: bytes) -> tuple[dict[str, Any], str | None]:
        """The message ``raw`` read at ``key``, and why it is refused (None when it is handed on)."""
        try:
            message = store.open_mail(key, raw)
        except MalformedValue as exc:
            return {}, str(exc)
        problem = self._validate(message)
        return message, None if problem is None else f"{key}: {problem}"
