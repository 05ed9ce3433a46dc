"""Reading a run's event log back (``ftrun status``, ``ftrun report``, ``ftrun inject chaos``).

:class:`EventReader` trusts nothing in the log: a line that is not an event as :mod:`ftrun.events` declares
it (cut short by a crash or still being written, corrupted, longer than :data:`MAX_LINE`, of a kind or a
schema version this ftrun does not know, with a field of the wrong type) is skipped and counted, so that the
code that folds the events reads their fields freely. :func:`read_chunks` reads a file without waiting on a
FIFO or reading a device without end.
"""

from __future__ import annotations

import errno
import json
import math
import os
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from ftrun.events import KINDS, SCHEMA_VERSION
from ftrun.paths import Unreadable, open_regular
from ftrun.protocol import MAX_SECONDS, Check, is_flag, is_int, is_number, is_optional_int, is_text, is_uids

MAX_LINE = 4 << 20
"""The longest line of an event log that is read, in bytes; a longer one is skipped without being held whole.
The longest ftrun writes, a ``generation`` of 100,000 workers, is about 1 MiB."""
READ_CHUNK = 1 << 20
"""Bytes read from a file at a time."""
MAX_DEPTH = 16
"""How deep the lists and objects of a record read back may nest (ftrun's nest 3 deep)."""
MAX_TIME = 253402300799.0
"""The latest ``time`` a record read back may have: the last second of the year 9999 (the earliest is 0, 1970)."""
MAX_RATE = 1e9
"""The highest ``steps_per_s`` a record read back may have."""


def _any(value: Any) -> bool:
    return True


def _count(value: Any) -> bool:
    return is_int(value) and value >= 0


def _time(value: Any) -> bool:
    return is_number(value) and 0 <= value <= MAX_TIME


def _seconds(value: Any) -> bool:
    return is_number(value) and -MAX_SECONDS <= value <= MAX_SECONDS


def _optional_seconds(value: Any) -> bool:
    return value is None or _seconds(value)


def _ints(value: Any) -> bool:
    return isinstance(value, list) and all(is_int(v) for v in value)


def _phases(value: Any) -> bool:
    return isinstance(value, dict) and all(_seconds(v) for v in value.values())


def _rate(value: Any) -> bool:
    return value is None or is_number(value) and 0 <= value <= MAX_RATE


def _optional_object(value: Any) -> bool:
    return value is None or isinstance(value, dict)


FIELD_CHECKS: dict[str, Check] = {
    "v": lambda v: is_int(v) and v == SCHEMA_VERSION, "time": _time, "gen": _count, "world_size": _count,
    "nproc": _count, "attempt": _count, "uid": is_int, "rank": is_optional_int, "local_rank": is_optional_int,
    "pid": is_optional_int, "node": is_optional_int, "exitcode": is_optional_int, "last_step": is_optional_int,
    "members": is_uids, "joiners": is_uids, "lost": is_uids, "lost_uids": is_uids, "lost_ranks": _ints,
    "latency": _seconds, "phases": _phases, "seconds": _optional_seconds, "steps_per_s": _rate,
    "args": _optional_object, "outcome": is_text, "kind": is_text, "joiner": is_flag, "succeeded": is_flag,
}
"""The type of each field ftrun computes with when it reads a record back, whatever the record's kind; a field
not named here is only shown, and may hold any JSON value."""


def event_problem(record: Any) -> str | None:
    """Why ``record``, read back from an event log, is not an event of a kind declared here with each of its
    fields (and ``v``, ``time``) of the right type, or None when it is."""
    if not isinstance(record, dict):
        return f"not a JSON object but {type(record).__name__}"
    if "event" not in record:
        return "no field 'event'"
    name = record["event"]
    kind = KINDS.get(name) if isinstance(name, str) else None
    if kind is None:
        return f"unknown event {str(name)[:40]!r}"
    for field in ("v", "time", *kind.fields):
        if field not in record:
            return f"{kind.name}: no field {field!r}"
    for field, value in record.items():
        if not FIELD_CHECKS.get(field, _any)(value):
            return f"{kind.name}: field {field[:40]!r} has a wrong type or value"
    return None


def _may_be_misshapen(text: str) -> bool:
    """Whether the JSON line ``text`` may nest deeper than MAX_DEPTH (it has more brackets than that) or hold a
    lone surrogate (it has a surrogate's escape: UTF-8 text holds none otherwise). Most lines do neither, and
    are not walked through."""
    return text.count("[") + text.count("{") > MAX_DEPTH or "\\ud" in text.lower()


def _shape_problem(record: dict[str, Any]) -> str | None:
    """Why the values of ``record`` cannot be shown as they are (nested deeper than MAX_DEPTH, which printing it
    as JSON does not survive, or a string with a lone surrogate, which no output encodes), or None."""
    stack: list[tuple[Any, int]] = [(record, 1)]
    while stack:
        value, depth = stack.pop()
        if isinstance(value, str) and not value.isascii():
            try:
                value.encode()
            except UnicodeEncodeError:
                return "a string that is not text (a lone surrogate)"
        elif isinstance(value, (list, dict)):
            if depth > MAX_DEPTH:
                return f"nested deeper than {MAX_DEPTH}"
            children = value if isinstance(value, list) else [*value, *value.values()]
            stack.extend((child, depth + 1) for child in children)
    return None


class NotAnEvent(ValueError):
    """A line of an event log that holds no event: the message says why, in a few words."""


def _finite(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"{text[:20]} is no finite number")
    return value


def _no_constant(text: str) -> float:
    raise ValueError(f"{text} is no number")


_DECODER = json.JSONDecoder(parse_float=_finite, parse_constant=_no_constant)
"""Reads JSON as Python's json module does, but refuses NaN and the infinities (1e999 too): no JSON writer
prints them back as JSON."""


def parse_event(line: bytes) -> dict[str, Any]:
    """The event one line of an event log holds; NotAnEvent when it holds none (not UTF-8, not JSON, a NaN or an
    infinity in it, nested too deeply, or not an event: :func:`event_problem`)."""
    try:
        text = line.decode()
        record = _DECODER.decode(text)
    except RecursionError:
        raise NotAnEvent("nested too deeply") from None
    except ValueError:  # not UTF-8, not JSON, not finite, an integer of more than 4,300 digits
        raise NotAnEvent("not JSON, cut short or corrupted") from None
    problem = event_problem(record) or (_shape_problem(record) if _may_be_misshapen(text) else None)
    if problem is not None:
        raise NotAnEvent(problem)
    return record


class BoundedLines:
    """Splits a byte stream into lines as chunks of it arrive, holding at most ``limit`` bytes of a line: a longer
    line comes out as None, its bytes dropped as they arrive."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.partial = bytearray()
        self.overlong = False

    def feed(self, data: bytes) -> list[bytes | None]:
        """The lines completed by ``data``, without their newlines (None for one longer than the limit)."""
        *complete, rest = data.split(b"\n")
        lines = []
        for piece in complete:
            self._hold(piece)
            lines.append(self.rest())
        self._hold(rest)
        return lines

    def rest(self) -> bytes | None:
        """At the end of the stream: the unfinished last line (empty when the stream ended with a newline), or
        None when it is longer than the limit."""
        line = None if self.overlong else bytes(self.partial)
        self.partial.clear()
        self.overlong = False
        return line

    def _hold(self, piece: bytes) -> None:
        if not self.overlong and len(self.partial) + len(piece) > self.limit:
            self.overlong = True
            self.partial.clear()
        if not self.overlong:
            self.partial += piece


class EventReader:
    """Turns an event log's bytes, as they are read, into its events (:func:`parse_event`), and counts the lines
    it skips, with where the last one is and why it was skipped (blank lines are passed over, uncounted)."""

    def __init__(self) -> None:
        self.lines = BoundedLines(MAX_LINE)
        self.line_number = 0
        self.skipped = 0
        self.last_skipped: str | None = None

    def feed(self, data: bytes) -> list[dict[str, Any]]:
        """The events of the lines ``data`` completes; an unfinished last line waits for the next call (or for
        :meth:`finish`)."""
        return self._events(self.lines.feed(data))

    def finish(self) -> list[dict[str, Any]]:
        """At the end of a log no longer written to: the event of its unfinished last line, if it holds one (a
        line cut short by a crash is skipped)."""
        rest = self.lines.rest()
        return self._events([rest]) if rest != b"" else []

    def skipped_lines(self) -> dict[str, Any]:
        """The lines skipped so far: ``count``, and ``last``: where the last one is and why it was skipped."""
        return {"count": self.skipped, "last": self.last_skipped}

    def _events(self, lines: Iterable[bytes | None]) -> list[dict[str, Any]]:
        events = []
        for line in lines:
            self.line_number += 1
            try:
                if line is None:
                    raise NotAnEvent(f"longer than {MAX_LINE:,} bytes")
                if line.strip():
                    events.append(parse_event(line))
            except NotAnEvent as exc:
                self.skipped += 1
                self.last_skipped = f"line {self.line_number}: {exc}"
        return events


def skipped_words(skipped: dict[str, Any]) -> str:
    """What a reader of an event log says of the lines it skipped (:meth:`EventReader.skipped_lines`)."""
    count = skipped["count"]
    return (f"skipped {count} line{'' if count == 1 else 's'} that {'is' if count == 1 else 'are'} no event "
            f"(the last: {skipped['last']})")


def read_chunks(path: Path, start: int = 0, *, last: int | None = None, follow: bool = True) -> Iterator[bytes]:
    """The bytes of the regular file at ``path`` from byte ``start`` up to its size as it is opened (what is
    written later is there for the next read), in chunks; with ``last``, only its last ``last`` bytes, from the
    first line that begins in them. Nothing when there is no such file; Unreadable when it is not a regular file
    (a FIFO is never waited on, a device never read without end), is a symbolic link and ``follow`` is False,
    or cannot be read."""
    try:
        fd, info = open_regular(path, follow)
    except FileNotFoundError:
        return
    except OSError as exc:
        raise Unreadable("a symbolic link" if exc.errno == errno.ELOOP else exc.strerror or str(exc)) from None
    try:
        position = start if last is None else max(start, info.st_size - last)
        cut = last is not None and position > 0  # begun inside the file: its first line is passed over
        if cut:
            position -= 1  # from the byte before: a newline there means a line begins at the first byte kept
        while position < info.st_size:
            chunk = os.pread(fd, min(READ_CHUNK, info.st_size - position), position)
            if not chunk:
                break
            position += len(chunk)
            if cut:
                newline = chunk.find(b"\n")
                chunk, cut = (chunk[newline + 1:], False) if newline >= 0 else (b"", True)
            if chunk:
                yield chunk
    except OSError as exc:
        raise Unreadable(exc.strerror or str(exc)) from None
    finally:
        os.close(fd)


def read_events(path: Path, reader: EventReader | None = None) -> list[dict[str, Any]]:
    """The events of a run's log, oldest first: its lines that are events (``reader``, a new one by default,
    counts the others); none when there is no log; Unreadable when it is not a regular file or cannot be read."""
    reader = reader or EventReader()
    events = [event for chunk in read_chunks(path) for event in reader.feed(chunk)]
    return events + reader.finish()
