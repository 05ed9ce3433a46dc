"""A run's timeline, from its event log and the losses its workers printed: what `ftrun report` draws.

Pure functions over plain data: events (and log lines) in, a :class:`Timeline` out; times are seconds since
the run's ``start`` event.
"""

from __future__ import annotations

import re
import statistics
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

_STEP = re.compile(r"\bstep[=:\s]\s*(\d{1,18})\b")
_LOSS = re.compile(r"\bloss[=:\s]\s*([-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?)")
MAX_LOSS = 1e100
"""The largest loss drawn, either sign: a larger one (an infinity, 1e999) is not plotted."""


@dataclass(frozen=True)
class Mark:
    """Something that happened at one moment: a fault, a drill, a group restart."""

    time: float
    label: str


@dataclass(frozen=True)
class RecoverySpan:
    """One recovery in place: from the fault (or the joiner's arrival) to the first step committed after it."""

    start: float
    end: float
    phases: dict[str, float]  # seconds, by phase (ftrun.tally.RECOVERY_PHASES)
    label: str


@dataclass
class Timeline:
    """Everything `ftrun report` draws for one run."""

    run_id: str
    started: float  # wall clock of the start event
    duration: float
    outcome: str
    world: list[tuple[float, int]] = field(default_factory=list)  # (time, world size) at each change
    rate: list[tuple[float, float]] = field(default_factory=list)  # (time, committed steps per second)
    faults: list[Mark] = field(default_factory=list)
    drills: list[Mark] = field(default_factory=list)
    restarts: list[Mark] = field(default_factory=list)
    recoveries: list[RecoverySpan] = field(default_factory=list)
    losses: list[tuple[int, float]] = field(default_factory=list)  # (step, loss), by step
    workers_lost: int = 0  # fault events: members lost, whatever the cause

    @property
    def median_recovery(self) -> float | None:
        """The median latency of the recoveries in place, in seconds."""
        return statistics.median(r.end - r.start for r in self.recoveries) if self.recoveries else None


def _fault_label(event: dict[str, Any]) -> str | None:
    """How a fault reads on the picture, or None for an event that is not one."""
    kind = event["event"]
    if kind == "fault":
        return f"rank {event.get('rank')}: {event.get('how')}"
    if kind == "hang":
        return f"rank {event.get('rank')} hung"
    if kind == "gpu_health":
        return f"GPU {event.get('gpu')}: {event.get('action')}"
    if kind == "node_lost":
        return f"node {event.get('node')} lost"
    if kind == "fenced":
        return "node fenced"
    if kind == "recovery_failed":
        return "recovery failed"
    return None


def build_timeline(events: list[dict[str, Any]], losses: list[tuple[int, float]], run_id: str) -> Timeline:
    """The timeline of a run from its events, oldest first (the leader's log), and its printed losses."""
    start = next((e for e in events if e["event"] == "start"), events[0] if events else {"time": 0.0})
    t0 = start["time"]
    end = next((e for e in reversed(events) if e["event"] == "end"), None)
    last = events[-1]["time"] if events else t0
    timeline = Timeline(run_id=run_id, started=t0, duration=max(0.0, last - t0),
                        outcome=end.get("outcome", "unknown") if end else "unknown (no end event)",
                        losses=sorted(losses))
    initial = start.get("world_size", start.get("nproc", 0))
    world, attempt = initial, 0
    timeline.world.append((0.0, world))
    for event in events:
        kind, t = event["event"], round(event["time"] - t0, 6)
        if kind == "generation":
            world = event["world_size"]
        elif kind == "worker_start" and event.get("attempt", 0) > attempt:
            attempt, world = event["attempt"], initial
            timeline.restarts.append(Mark(t, f"group restart {attempt}"))
        elif kind == "attempt_end" and not event.get("succeeded"):
            world = 0
        elif kind == "progress" and event.get("steps_per_s") is not None:
            timeline.rate.append((t, event["steps_per_s"]))
        elif kind == "inject":
            timeline.drills.append(Mark(t, f"drill: {event.get('kind')} rank {event.get('rank')}"))
        elif kind == "recovery":
            what = (f"rank{'s' if len(event.get('lost_ranks', [])) > 1 else ''} "
                    f"{', '.join(map(str, event.get('lost_ranks', [])))} lost" if event.get("kind") == "fault"
                    else "joiner placed")
            label = f"{what}: world {event.get('world_before')} -> {event.get('world_after')}"
            timeline.recoveries.append(RecoverySpan(t - event["latency"], t, dict(event.get("phases", {})), label))
        if kind == "fault":
            timeline.workers_lost += 1
        label = _fault_label(event)
        if label is not None:
            timeline.faults.append(Mark(t, label))
        if world != timeline.world[-1][1]:
            timeline.world.append((t, world))
    timeline.world.append((timeline.duration, world))
    return timeline


def parse_losses(lines: Iterable[str]) -> dict[int, float]:
    """``step=N ... loss=X`` as a worker prints it (``step: N``, ``loss X`` too) -> {step: loss}: the first step
    of a line and the first loss after it (two searches, each in time linear in the line's length)."""
    found = {}
    for line in lines:
        step = _STEP.search(line)
        loss = step and _LOSS.search(line, step.end())
        if loss and abs(value := float(loss[1])) <= MAX_LOSS:
            found[int(step[1])] = value
    return found
