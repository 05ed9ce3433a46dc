"""A running summary of a job's event log: faults, recoveries and their latencies, generations, outcome.

The agent folds each event into a tally as it writes it (the live ``ftrun status`` record) and ``ftrun status``
folds a finished run's ``events.jsonl`` into one (the post-mortem), so both say the same things the same way.
It imports nothing from the agent.
"""

from __future__ import annotations

import statistics
from collections import deque
from typing import Any

from ftrun import events
from ftrun.processes import signal_name

ROUTINE = frozenset(kind.name for kind in (events.WORKER_START, events.WORKER_EXIT, events.JOINER_READY,
                                           events.PROGRESS))
"""Events too routine to list for a person watching the job: the worker table and the rate show them."""
NOTABLE = frozenset(events.KINDS) - ROUTINE
"""Events worth showing a person watching the job: every kind the agent writes but the routine ones."""

RECOVERY_PHASES = ("detect", "plan", "abort", "rendezvous", "agree", "transfer", "first_step")
"""The phases a ``recovery`` event times, in the order they happen."""

RECENT_EVENTS = 20
"""How many notable events a tally keeps."""
RECENT_RECOVERIES = 10
"""How many recoveries a tally keeps in full (every latency counts towards the median)."""

_EVENT_FIELDS = ("time", "event", "rank", "pid", "how", "gen", "world_size", "reason", "lost_ranks",
                 "world_before", "world_after", "latency", "steps_lost", "outcome", "attempt", "silent_for",
                 "last_step", "signal", "kind", "uid", "node", "ranks", "gpu", "local_rank", "value", "action",
                 "args", "best_step", "state", "seconds")
_RECOVERY_FIELDS = ("time", "kind", "gen", "latency", "phases", "lost_ranks", "world_before", "world_after",
                    "steps_lost", "resumed_at_step")


def exit_reason(exitcode: int | None) -> str | None:
    """How a process ended: ``SIGKILL`` for a signal, ``exit 3`` for a code; None while it runs."""
    if exitcode is None:
        return None
    if exitcode < 0:
        return signal_name(-exitcode)
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
        self.restart_latencies: list[float] = []  # failure -> first step, of each group restart that resumed
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
        elif kind in ("fault", "recovery_refused"):  # a lost worker, recovered in place or not
            self.faults += 1
        elif kind == "recovery":
            self.latencies.append(event["latency"])
            self.recoveries.append({k: event[k] for k in _RECOVERY_FIELDS if k in event})
            if event.get("kind") == "fault":
                self.faults_survived += len(event.get("lost_ranks", []))
        elif kind == "recovery_failed":
            self.recovery_failures += 1
        elif kind == "resumed":
            self.restart_latencies.append(event["latency"])
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


def run_summary(tally: EventTally, now: float) -> str:
    """One line for the end of a run: its outcome, steps, faults, recoveries, time lost to them and goodput.

    Time lost is the recoveries' latencies (fault to the first step after it) and the group restarts'
    (failure to the first step of the new attempt); goodput is the rest of the run's wall-clock time over
    all of it.
    """
    wall = now - tally.started if tally.started else 0.0
    steps = "no step reported" if tally.last_step is None else f"{tally.last_step + 1} steps"
    head = f"ftrun: {tally.outcome or 'ended'}: {steps} in {wall:.1f} s"
    if not tally.faults and not tally.attempt:
        return f"{head}, no fault"
    lost = sum(tally.latencies) + sum(tally.restart_latencies)
    recoveries = f"{len(tally.latencies)} recover{'y' if len(tally.latencies) == 1 else 'ies'} in place"
    if tally.latencies:
        recoveries += f" (median {statistics.median(tally.latencies):.2f} s)"
    restarts = f"{tally.attempt} group restart{'' if tally.attempt == 1 else 's'}"
    head = f"{head}; {tally.faults} fault{'' if tally.faults == 1 else 's'}, {recoveries}, {restarts}"
    if tally.outcome != "succeeded" or wall <= 0:
        return head
    return f"{head}; {lost:.2f} s lost to them, goodput {max(0.0, 1 - lost / wall):.3f}"


def tally_events(events: list[dict[str, Any]]) -> EventTally:
    """A tally of a whole event log."""
    tally = EventTally()
    for event in events:
        tally.add(event)
    return tally
