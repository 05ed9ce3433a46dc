"""A running summary of a job's event log: faults, recoveries and their latencies, generations, outcome.

The agent folds each event into a tally as it writes it (the live ``ftrun status`` record) and ``ftrun status``
folds a finished run's ``events.jsonl`` into one (the post-mortem), so both say the same things the same way.
It imports nothing from the agent.
"""

from __future__ import annotations

import signal
import statistics
from collections import deque
from typing import Any

NOTABLE = frozenset({"start", "fault", "hang", "gpu_health", "node_lost", "fenced", "inject", "generation",
                     "recovery", "recovery_refused", "recovery_failed", "joiner_lost", "rescue", "group_failure",
                     "attempt_end", "end"})
"""Events worth showing a person watching the job: every kind the agent writes except the routine ones (each
worker's start and exit, a joiner becoming ready, periodic progress), which the worker table shows."""

RECOVERY_PHASES = ("detect", "plan", "abort", "rendezvous", "agree", "transfer", "first_step")
"""The phases a ``recovery`` event times, in the order they happen."""

RECENT_EVENTS = 20
"""How many notable events a tally keeps."""
RECENT_RECOVERIES = 10
"""How many recoveries a tally keeps in full (every latency counts towards the median)."""

_EVENT_FIELDS = ("time", "event", "rank", "pid", "how", "gen", "world_size", "reason", "lost_ranks",
                 "world_before", "world_after", "latency", "steps_lost", "outcome", "attempt", "silent_for",
                 "last_step", "signal", "kind", "uid", "node", "ranks", "gpu", "local_rank", "value", "action",
                 "args", "best_step")
_RECOVERY_FIELDS = ("time", "kind", "gen", "latency", "phases", "lost_ranks", "world_before", "world_after",
                    "steps_lost", "resumed_at_step")


def exit_reason(exitcode: int | None) -> str | None:
    """How a process ended: ``SIGKILL`` for a signal, ``exit 3`` for a code; None while it runs."""
    if exitcode is None:
        return None
    if exitcode < 0:
        try:
            return signal.Signals(-exitcode).name
        except ValueError:
            return f"signal {-exitcode}"
    return f"exit {exitcode}"


def brief(event: dict[str, Any]) -> dict[str, Any]:
    """The fields of an event worth showing, without the bulky ones (member lists, messages, commands)."""
    return {k: event[k] for k in _EVENT_FIELDS if k in event}


class EventTally:
    """Folds events, oldest first, into the counts and recent history ``ftrun status`` shows."""

    def __init__(self) -> None:
        self.run_id: str | None = None
        self.started: float | None = None
        self.ended: float | None = None
        self.outcome: str | None = None
        self.world_initial: int | None = None
        self.world_size: int | None = None
        self.gen = 0
        self.attempt = 0  # the attempt running (or the last one): the number of group restarts so far
        self.last_step: int | None = None
        self.faults = 0
        self.faults_survived = 0  # ranks lost and recovered from in place
        self.recovery_failures = 0
        self.latencies: list[float] = []
        self.recoveries: deque[dict[str, Any]] = deque(maxlen=RECENT_RECOVERIES)
        self.recent: deque[dict[str, Any]] = deque(maxlen=RECENT_EVENTS)

    def add(self, event: dict[str, Any]) -> None:
        """Fold one event in."""
        kind = event.get("event")
        if kind == "start":
            self.run_id, self.started = event.get("run_id"), event["time"]
            self.world_initial = self.world_size = event.get("world_size", event.get("nproc"))
        elif kind == "generation":
            self.gen, self.world_size = event["gen"], event["world_size"]
        elif kind == "fault":
            self.faults += 1
        elif kind == "recovery":
            self.latencies.append(event["latency"])
            self.recoveries.append({k: event[k] for k in _RECOVERY_FIELDS if k in event})
            if event.get("kind") == "fault":
                self.faults_survived += len(event.get("lost_ranks", []))
        elif kind == "recovery_failed":
            self.recovery_failures += 1
        elif kind == "worker_start" and event.get("attempt", 0) > self.attempt:
            self.attempt = event["attempt"]
            self.gen, self.world_size = 0, self.world_initial  # a group restart starts from the full group
        elif kind == "end":
            self.ended, self.outcome = event["time"], event.get("outcome")
        if event.get("last_step") is not None:
            self.last_step = max(self.last_step if self.last_step is not None else -1, event["last_step"])
        if kind in NOTABLE:
            self.recent.append(brief(event))

    def summary(self) -> dict[str, Any]:
        """The tally as a JSON-ready dict."""
        return {
            "run_id": self.run_id, "started": self.started, "ended": self.ended, "outcome": self.outcome,
            "world_size_initial": self.world_initial, "world_size": self.world_size, "generation": self.gen,
            "restarts": self.attempt, "step": self.last_step,
            "faults": self.faults, "faults_survived": self.faults_survived,
            "recovery_failures": self.recovery_failures,
            "recoveries": {"count": len(self.latencies), "recent": list(self.recoveries),
                           "median_latency": statistics.median(self.latencies) if self.latencies else None},
            "events": list(self.recent),
        }


def tally_events(events: list[dict[str, Any]]) -> EventTally:
    """A tally of a whole event log."""
    tally = EventTally()
    for event in events:
        tally.add(event)
    return tally
