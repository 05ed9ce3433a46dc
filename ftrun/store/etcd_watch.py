"""Watches that stay open across waits: what :meth:`~ftrun.store.etcd.EtcdKeyValue.wait_any` waits on.

A mailbox reader waits again and again for the same few keys: its box's bell, and its sender's next
broadcast. A watch opened for each wait (an HTTP connection, a request and a thread, torn down when the
wait ends) and a read of the key that came cost each reader tens of milliseconds of CPU per broadcast. Here
each range waited on has one watch that stays open from wait to wait, and its events carry the values: a
key that comes is known with no read, and a wait that finds it known already costs no request at all.

- A range is one key, or every key under a parent where the key waited for and the one to be waited for
  next share it (a sender's broadcasts: :func:`range_for`). A bell stays a range of its own: a watch on
  every node's bells would hand each reader every other node's mail.
- What a client knows of a key (:class:`Known`) is its value (None: absent) and the revision it was known at,
  from a read, from one of the client's own transactions, or from a watch's event; a later revision
  replaces an earlier one. A range's watch starts just after the read that first filled it, so no write after
  that read is missed; a key of the range not yet known is read before it is waited for.
- A watch that ends (its member went away, or etcd cancelled it: compaction) is opened again, after a fresh
  read, from whichever member answers.
"""

from __future__ import annotations

import base64
import json
import threading
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any, NamedTuple

if TYPE_CHECKING:
    from ftrun.store.etcd_http import Member  # imports urllib3: only a job with the etcd backend needs it

KNOWN_KEYS = 1024
"""Keys a watch remembers; past this it forgets the half known longest ago (read again if waited for)."""

Event = tuple[str, "bytes | None", int]
"""One change a watch saw: the key (without the job's prefix), its value (None: deleted), its revision."""


class KeyRange(NamedTuple):
    """The keys one watch covers: the key ``start``, or every key under it where ``prefix``. (A tuple: a reader
    hashes its ranges a dozen times per event, in C this way, in Python as a frozen dataclass.)"""

    start: str
    prefix: bool = False

    def covers(self, key: str) -> bool:
        """Whether a watch on this range sees ``key``'s changes."""
        return key.startswith(self.start) if self.prefix else key == self.start


def range_for(key: str, successor: str | None) -> KeyRange:
    """The range to watch while waiting for ``key``: the parent it shares with ``successor`` (the key waited
    for in its place next, a sender's next broadcast), so that one watch serves every wait of the sequence;
    the key alone when there is no such successor."""
    parent = key.rpartition("/")[0] + "/"
    if successor is not None and parent != "/" and successor.startswith(parent) \
            and "/" not in successor[len(parent):]:
        return KeyRange(parent, prefix=True)
    return KeyRange(key)


class Known:
    """What is known of the keys of one range: each key's value (None: absent) and the revision it was known at.

    A watch on a prefix starts from a listing of every key under it (``listed``: their names, not their
    values): a key not listed is then known to be absent until an event says otherwise, and a listed one is
    read when it is waited for. Without a listing only what is noted is known.
    """

    def __init__(self, listed: Iterable[str] | None = None, limit: int = KNOWN_KEYS) -> None:
        self.limit = limit
        self._values: dict[str, tuple[bytes | None, int]] = {}
        self._listed = listed is not None
        self._unread = set(listed or ())  # present, value not known

    def note(self, key: str, value: bytes | None, revision: int) -> None:
        """``key`` held ``value`` at ``revision``: kept unless something later is known of it already."""
        held = self._values.get(key)
        if held is not None and held[1] >= revision:
            return
        self._values[key] = (value, revision)
        if len(self._values) > self.limit:
            ordered = sorted(self._values.items(), key=lambda item: item[1][1])
            forgotten, kept = ordered[:len(ordered) // 2], ordered[len(ordered) // 2:]
            self._values = dict(kept)
            self._unread.update(key for key, (value, _) in forgotten if value is not None)

    def __contains__(self, key: str) -> bool:
        return key in self._values or (self._listed and key not in self._unread)

    def value(self, key: str) -> bytes | None:
        """The value last known of ``key`` (None: absent, or not known)."""
        held = self._values.get(key)
        return held[0] if held is not None else None


def parse_events(line: bytes, prefix: bytes) -> tuple[list[Event], bool]:
    """The changes one line of a watch stream reports, keys without the job's ``prefix`` (others left out), and
    whether etcd ended the watch with it (cancelled: compaction; or the gateway's error, such as the member's
    loss of etcd's leader, see :data:`~ftrun.store.etcd_http.REQUIRE_LEADER`); ValueError for a line that is
    not etcd's."""
    try:
        message = json.loads(line)
        if isinstance(message.get("error"), dict):
            return [], True
        result = message["result"]
        events = []
        for event in result.get("events") or []:
            kv = event["kv"]
            key = base64.b64decode(kv["key"])
            if not key.startswith(prefix):
                continue
            value = None if event.get("type") == "DELETE" else base64.b64decode(kv.get("value", ""))
            events.append((key[len(prefix):].decode(errors="replace"), value, int(kv["mod_revision"])))
        return events, bool(result.get("canceled"))
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise ValueError(f"not a watch event: {exc}") from None


class OpenWatch:
    """One watch kept open on ``key_range`` of ``member``, from ``revision`` on: a thread reads its stream and
    notes each change in :attr:`known`, notifying ``changed`` (whose lock guards :attr:`known`) at each line
    that sets a key of the range and at the stream's end (:attr:`ended`). A line of deletes only is noted
    without a notification: no wait ends at a delete (a wait is for a key that is set), and each reader's
    delete of its own bell, and a sender's of its oldest broadcast, would wake the wait for nothing.
    ``listed``: every key of the range just before ``revision`` (see :class:`Known`)."""

    def __init__(self, member: Member, key_range: KeyRange, revision: int, prefix: bytes,
                 changed: threading.Condition, listed: Iterable[str] | None = None) -> None:
        self.key_range = key_range
        self.known = Known(listed)
        self.ended = False
        self._changed = changed
        start = prefix + key_range.start.encode()
        body: dict[str, Any] = {"create_request": {"key": b64(start), "start_revision": revision}}
        if key_range.prefix:
            body["create_request"]["range_end"] = b64(prefix_end(start))
        self._stream = member.stream("watch", body)
        threading.Thread(target=self._read, args=(prefix,), name="ftrun-etcd-watch", daemon=True).start()

    def _read(self, prefix: bytes) -> None:
        try:
            for line in self._stream.lines():
                events, cancelled = parse_events(line, prefix)
                with self._changed:
                    news = False
                    for key, value, revision in events:
                        if self.key_range.covers(key):
                            self.known.note(key, value, revision)
                            news = news or value is not None
                    if news:
                        self._changed.notify_all()
                if cancelled:
                    break
        except Exception:  # noqa: BLE001 -- a closed or broken stream, or a line that is not etcd's: it is over
            pass
        with self._changed:
            self.ended = True
            self._changed.notify_all()

    def close(self) -> None:
        """Stop watching (the thread ends as its stream is shut down)."""
        self._stream.close()


class Watches:
    """Watches one client keeps open, and what they know, guarded by ``changed`` (a new condition by default;
    a client's watches for different waits share one, so that waking it reaches every wait)."""

    def __init__(self, changed: threading.Condition | None = None) -> None:
        self.changed = changed if changed is not None else threading.Condition()
        self._open: dict[KeyRange, OpenWatch] = {}

    def keep(self, ranges: Iterable[KeyRange]) -> None:
        """Close every watch but those on ``ranges`` that are still open."""
        wanted = set(ranges)
        with self.changed:
            closing = [watch for key_range, watch in self._open.items()
                       if key_range not in wanted or watch.ended]
            self._open = {key_range: watch for key_range, watch in self._open.items()
                          if key_range in wanted and not watch.ended}
        for watch in closing:
            watch.close()

    def unknown(self, ranges: dict[str, KeyRange]) -> list[str]:
        """The keys (of ``ranges``: key to its range) that no open watch knows of yet."""
        with self.changed:
            return [key for key, key_range in ranges.items()
                    if key_range not in self._open or key not in self._open[key_range].known]

    def missing(self, ranges: Iterable[KeyRange]) -> set[KeyRange]:
        """The ones of ``ranges`` with no watch open."""
        with self.changed:
            return {key_range for key_range in ranges if key_range not in self._open}

    def add(self, watch: OpenWatch) -> None:
        """Keep ``watch`` (just opened) open."""
        with self.changed:
            self._open[watch.key_range] = watch

    def note(self, key: str, value: bytes | None, revision: int) -> None:
        """What one of the client's own calls learnt of ``key`` at ``revision``, for the watch that covers it."""
        with self.changed:
            for key_range, watch in self._open.items():
                if key_range.covers(key):
                    watch.known.note(key, value, revision)

    def values(self, ranges: dict[str, KeyRange]) -> dict[str, bytes | None]:
        """The value each open watch knows of each key of ``ranges`` (key to its range; None: absent); keys no
        open watch knows are left out."""
        with self.changed:
            watches = {key: self._open.get(key_range) for key, key_range in ranges.items()}
            return {key: watch.known.value(key) for key, watch in watches.items()
                    if watch is not None and not watch.ended and key in watch.known}

    def await_any(self, ranges: dict[str, KeyRange], deadline: float, stop: Callable[[], bool],
                  clock: Callable[[], float]) -> dict[str, bytes | None] | None:
        """Wait until one of the keys of ``ranges`` is known to be set (its value, by key), ``deadline`` passes
        (empty) or ``stop()``; None as soon as a watch it needs has ended (open it again and come back)."""
        with self.changed:
            while True:
                watches = {key: self._open.get(key_range) for key, key_range in ranges.items()}
                if any(watch is None or watch.ended for watch in watches.values()):
                    return None
                came = {key: watch.known.value(key) for key, watch in watches.items()
                        if watch is not None and watch.known.value(key) is not None}
                left = deadline - clock()
                if came or stop() or left <= 0:
                    return came
                self.changed.wait(left)

    def wake(self) -> None:
        """Wake a wait in progress (to see ``stop()``)."""
        with self.changed:
            self.changed.notify_all()

    def close(self) -> None:
        """Close every watch."""
        self.keep(())


def b64(data: str | bytes) -> str:
    """``data`` (text as UTF-8) as etcd's JSON gateway takes bytes: base64."""
    return base64.b64encode(data.encode() if isinstance(data, str) else data).decode()


def prefix_end(prefix: bytes) -> bytes:
    """The first key after every key that starts with ``prefix`` (etcd's ``range_end`` for a prefix)."""
    return prefix[:-1] + bytes([prefix[-1] + 1])
