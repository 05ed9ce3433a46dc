"""The run's event log: one JSON object per line for every start, fault, generation, recovery and end.

Every kind of event ftrun writes is declared here with its fields, and :meth:`EventLog.write` refuses a
record that does not match its declaration, so the log's schema (README, "The event log") cannot drift
from the code. Every record also carries the schema version ``v``, its wall-clock ``time`` and its ``event``
name. A change that renames or removes a field, or changes its meaning, raises SCHEMA_VERSION; new events and
new fields do not (a field added to a kind is declared optional, since the logs written before lack it).

The log is read back by :mod:`ftrun.event_log`.
"""

from __future__ import annotations

import errno
import json
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from ftrun.dropped import DroppedWrites, append

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
