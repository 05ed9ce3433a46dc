"""The run's event log: one JSON object per line for every start, fault, generation, recovery and end.

Every kind of event ftrun writes is declared here with its fields, and :meth:`EventLog.write` refuses a
record that does not match its declaration, so the log's schema (README, "The event log") cannot drift
from the code. Every record also carries the schema version ``v``, its wall-clock ``time`` and its ``event``
name. A change that renames or removes a field, or changes its meaning, raises SCHEMA_VERSION; new events and
new fields do not (a field added to a kind is declared optional, since the logs written before lack it).

The log is read back (``ftrun status``, ``ftrun report``, ``ftrun inject chaos``) by :class:`EventReader`, which
trusts nothing in it: a line that is not an event as declared here (cut short by a crash or still being
written, corrupted, longer than :data:`MAX_LINE`, of a kind or a schema version this ftrun does not know, with a
field of the wrong type) is skipped and counted, so that the code that folds the events reads their fields
freely.
"""

from __future__ import annotations

import errno
import json
import math
import os
import stat
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from ftrun.dropped import DroppedWrites, append
from ftrun.paths import Unreadable
from ftrun.protocol import MAX_SECONDS, Check, is_flag, is_int, is_number, is_optional_int, is_text, is_uids

SCHEMA_VERSION = 1
"""The version of the records' layout, written as ``v`` in every record."""


@dataclass(frozen=True)
class EventKind:
    """One kind of event: its name in the log, the fields it always has, and those it may have."""

    name: str
    fields: tuple[str, ...]
    optional: tuple[str, ...] = ()

    def check(self, fields: dict[str, Any]) -> None:
        """TypeError when ``fields`` are not this kind's (a bug in the writer, caught by the tests)."""
        missing = set(self.fields) - set(fields)
        unknown = set(fields) - set(self.fields) - set(self.optional)
        if missing or unknown:
            raise TypeError(f"event {self.name!r}: missing {sorted(missing)}, unknown {sorted(unknown)}")


START = EventKind("start", ("run_id", "command", "node", "nproc", "world_size", "store_port"))
"""An agent started (one per node)."""
WORKER_START = EventKind("worker_start", ("uid", "rank", "local_rank", "pid", "joiner", "attempt", "node"), ("forked",))
"""A worker process started; ``joiner``: a spare or replacement that waits to be placed; ``forked``: by the
fork server (else started as a new process)."""
WORKER_EXIT = EventKind("worker_exit", ("uid", "rank", "pid", "exitcode", "node"))
"""A worker process ended; ``exitcode`` < 0 means killed by that signal."""
FAULT = EventKind("fault", ("uid", "rank", "pid", "how", "message", "gen"))
"""A member of generation ``gen`` was lost (its rank in that generation)."""
GENERATION = EventKind("generation", ("gen", "members", "reason", "lost", "joiners", "world_size"))
"""The leader issued a new generation's plan: ``members`` are uids in rank order."""
RECOVERY = EventKind("recovery", ("kind", "gen", "lost_ranks", "lost_uids", "world_before", "world_after",
                                  "joiners", "steps_lost", "resumed_at_step", "latency", "phases", "data_plane"))
"""The first step of a new generation committed: one in-place recovery (``kind`` fault or join), timed;
``data_plane`` reconfigured (torch's in-place reconfigure on every member) or formed (a new group)."""
RECOVERY_REFUSED = EventKind("recovery_refused", ("uid", "reason"))
"""A fault that cannot be recovered in place; the group restarts."""
RECOVERY_FAILED = EventKind("recovery_failed", ("reason", "gen"))
"""An in-place recovery was given up; the live workers save their state, then the group restarts."""
RESCUE = EventKind("rescue", ("saved", "best_step", "missing"), ("errors", "why"))
"""The state the live workers saved (uid -> step) before a group restart (``why`` restart) or as ftrun was
stopped by a signal (``why`` the signal's name), who did not answer, and why a worker could not save (uid ->
error)."""
JOINER_READY = EventKind("joiner_ready", ("uid", "pid"))
"""A spare or respawned worker is ready to be placed."""
JOINER_LOST = EventKind("joiner_lost", ("uid", "how"))
"""A joiner ended before it was placed."""
GROUP_FAILURE = EventKind("group_failure", ("reason",))
"""The attempt is being ended: every worker of this node is stopped."""
PROGRESS = EventKind("progress", ("step", "steps_per_s", "world_size", "gen"))
"""Written by the leader every few seconds while steps commit: the step rate over the run (``ftrun report``)."""
RESUMED = EventKind("resumed", ("attempt", "step", "latency"))
"""The first step committed after a group restart; ``latency``: seconds since the failure that caused it."""
ATTEMPT_END = EventKind("attempt_end", ("attempt", "succeeded", "signal", "reason", "last_step"))
"""One start of the worker group ended."""
END = EventKind("end", ("outcome",), ("signal", "reason"))
"""The launch ended: ``outcome`` succeeded, failed or interrupted."""
LINK_FAULT = EventKind("link_fault", ("gen", "action", "reason", "ranks", "unreachable"))
"""Collectives failed with every worker alive: the same members re-form (``action`` reform), or the fewest
members whose links do not connect are stopped (exclude; ``ranks``); ``unreachable``: a probe's matrix."""
HANG = EventKind("hang", ("uid", "rank", "pid", "silent_for", "timeout", "stopped", "in_collective"))
"""A rank made no progress within its hang timeout: its stacks are dumped (unless it is stopped), then it is
killed."""
INJECT = EventKind("inject", ("kind", "rank", "uid", "pid", "args"))
"""A drill of ``ftrun inject`` was carried out."""
NODE_LOST = EventKind("node_lost", ("node", "reason", "ranks"))
"""The leader declared a node lost (its lease ran out, or its agent ended)."""
NODE_JOINED = EventKind("node_joined", ("node", "target"))
"""A node of ``--nnodes MIN:MAX``'s optional ones started its workers: they join at the next generation,
which grows to ``target`` training workers."""
LEADER = EventKind("leader", ("node", "term", "store", "reason"))
"""Node ``node`` was elected leader (``term``: 1 for the first after node 0) through etcd, and serves the
process groups' store at ``store`` from now on; ``reason``: why the leader before it was lost."""
FENCED = EventKind("fenced", ("reason",))
"""A follower stopped its own workers: it lost its lease, or the leader evicted it."""
UNKILLABLE = EventKind("unkillable", ("uid", "rank", "pid", "state", "waited"))
"""A worker still there ``waited`` seconds after SIGKILL (``state``: its process state, e.g. disk-sleep):
ftrun stops waiting for it and treats it as lost."""
WRITES_DROPPED = EventKind("writes_dropped", ("what", "count", "since", "error"))
"""Writes that failed (a full disk) were dropped: ``count`` of them to ``what`` from ``since`` (wall clock),
with ``error``; recorded once writing works again."""
FORK_SERVER = EventKind("fork_server", ("pid", "state", "reason", "node"), ("seconds", "modules", "preloaded"))
"""The node's fork server is ``ready`` (its imports, ``preloaded``, took ``seconds``), ``unusable`` (``reason``: workers start as
new processes) or ``gone`` (it stopped answering; later workers start as new processes)."""
GPU_HEALTH = EventKind("gpu_health", ("kind", "gpu", "local_rank", "value", "action", "reason", "source", "detail",
                                      "pids"))
"""A GPU health signal (NVML, or a drill) and the action taken on the workers using that GPU."""

KINDS: dict[str, EventKind] = {kind.name: kind for kind in (
    START, WORKER_START, WORKER_EXIT, FAULT, GENERATION, RECOVERY, RECOVERY_REFUSED, RECOVERY_FAILED, RESCUE,
    JOINER_READY, JOINER_LOST, GROUP_FAILURE, PROGRESS, RESUMED, ATTEMPT_END, END, LINK_FAULT, HANG, INJECT, NODE_LOST,
    NODE_JOINED, FENCED, LEADER, GPU_HEALTH, UNKILLABLE, WRITES_DROPPED, FORK_SERVER)}
"""Every kind of event, by name."""


class EventSink(Protocol):
    """Where events are written: the run's event log, as the agent's parts see it."""

    def write(self, kind: EventKind, /, **fields: Any) -> dict[str, Any]:
        """Record one event; returns the record."""


class EventLog:
    """Appends structured events to ``<run dir>/events.jsonl``, each line whole, as it is written.

    A record the file cannot take (a full disk) is dropped, not fatal: ``notice`` says so once, the listeners
    still get it, and a ``writes_dropped`` event records how many were lost once the file takes records again.
    """

    def __init__(self, path: Path, notice: Callable[[str], None] | None = None) -> None:
        self.path = path
        self.listeners: list[Callable[[dict[str, Any]], None]] = []
        """Called with each record once it is written (the live status tally)."""
        self.dropped = DroppedWrites(f"the event log {path}", notice)
        self._fd = -1
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            self._fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o644)
        except OSError as exc:
            self.dropped.failed(exc)

    def write(self, kind: EventKind, /, **fields: Any) -> dict[str, Any]:
        """Record one event of ``kind`` with its fields and the wall-clock time; returns the record."""
        kind.check(fields)
        lost = self.dropped.lost()
        if lost is not None and self._append(_record(WRITES_DROPPED, lost)) is None:
            self.dropped.recorded()
        record = _record(kind, fields)
        error = self._append(record)
        if error is not None:
            self.dropped.failed(error)
        for listener in self.listeners:
            listener(record)
        return record

    def _append(self, record: dict[str, Any]) -> OSError | None:
        """Make ``record`` a line of the file; the error when the file would not take it (then it is not there)."""
        try:
            if self._fd < 0:
                raise OSError(errno.EBADF, f"{self.path} could not be opened")
            append(self._fd, (json.dumps(record, sort_keys=True) + "\n").encode())
        except OSError as exc:
            return exc
        return None

    def close(self) -> None:
        """Close the file."""
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


def _record(kind: EventKind, fields: dict[str, Any]) -> dict[str, Any]:
    return {"v": SCHEMA_VERSION, "time": round(time.time(), 6), "event": kind.name, **fields}


# ------------------------------------------------------------------------------------- reading back
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
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | (0 if follow else os.O_NOFOLLOW))
    except FileNotFoundError:
        return
    except OSError as exc:
        raise Unreadable("a symbolic link" if exc.errno == errno.ELOOP else exc.strerror or str(exc)) from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise Unreadable("not a regular file")
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
