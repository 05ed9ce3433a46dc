"""Render status documents for a person: a job line, one row per worker, the last events (rich)."""

from __future__ import annotations

import time
from typing import Any

from rich.console import Group, RenderableType
from rich.table import Table
from rich.text import Text

NONE = "-"
HEALTH_STYLE = {"healthy": "bold green", "degraded": "bold yellow", "ended": "bold"}
STATE_STYLE = {"running": "green", "recovering": "yellow", "hung": "bold red", "unkillable": "bold red", "lost": "red",
               "spare": "cyan", "joining": "cyan", "finished": "dim", "stopped": "dim"}
PHASES = ("detect", "plan", "abort", "rendezvous", "agree", "transfer", "first_step")


def duration(seconds: float | None) -> str:
    """12.3s, 4m05s, 2h03m."""
    if seconds is None:
        return NONE
    if seconds < 60:
        return f"{seconds:.1f}s"
    minutes, secs = divmod(int(seconds), 60)
    if minutes < 60:
        return f"{minutes}m{secs:02d}s"
    return f"{minutes // 60}h{minutes % 60:02d}m"


def size(n: int | float | None) -> str:
    """Bytes as 512K, 698M, 1.2G."""
    if n is None:
        return NONE
    for unit, scale in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if n >= scale:
            return f"{n / scale:.1f}{unit}" if n < 10 * scale else f"{n / scale:.0f}{unit}"
    return f"{n:.0f}B"


def _or_none(value: Any, fmt: str = "{}") -> str:
    return NONE if value is None else fmt.format(value)


def job_line(doc: dict[str, Any]) -> Text:
    """Run id, health, generation, world size now/initial, uptime, step, steps/s, faults survived."""
    text = Text()
    text.append(f"run {doc['run_id']}", style="bold")
    if doc["endpoint"]:
        where = f" (live at {doc['endpoint']}, updated {duration(doc['record_age'])} ago)"
    else:
        where = f" (ended: {doc['outcome']})"
    text.append(where + "  ")
    text.append(doc["health"].upper(), style=HEALTH_STYLE.get(doc["health"], ""))
    if doc["state"] not in ("running", "ended"):
        text.append(f" ({doc['state']})", style="yellow")
    world = f"{_or_none(doc['world_size'])}/{_or_none(doc['world_size_initial'])}"
    up = "ran" if doc["state"] == "ended" else "up"
    rate = "" if doc["steps_per_s"] is None else f" ({doc['steps_per_s']:.1f}/s)"
    text.append(f"\ngen {doc['generation']}  world {world}  nodes {doc['nnodes']}  {up} {duration(doc['uptime'])}"
                f"  step {_or_none(doc['step'])}{rate}  faults {doc['faults']} (survived {doc['faults_survived']})"
                f"  restarts {doc['restarts']}")
    return text


def recovery_line(doc: dict[str, Any]) -> Text:
    """How many recoveries, the last one's latency and phases, and the median latency."""
    recoveries = doc["recoveries"]
    last = recoveries["last"]
    if last is None:
        return Text("recoveries 0", style="dim")
    phases = " ".join(f"{name} {last['phases'][name] * 1000:.0f}" for name in PHASES if name in last["phases"])
    return Text(f"recoveries {recoveries['count']}: last {last['latency']:.3f} s ({phases} ms), "
                f"median {recoveries['median_latency']:.3f} s")


def worker_table(doc: dict[str, Any]) -> Table:
    """One row per worker: node, ranks, pid, state, progress, CPU and memory, GPU health."""
    table = Table(title="workers", title_justify="left", box=None, header_style="bold", pad_edge=False)
    for name in ("node", "rank", "local", "pid", "state", "step", "t/step", "idle", "cpu%", "rss", "gpu", "util",
                 "gpu mem", "temp", "ecc", "xid"):
        table.add_column(name, justify="left" if name == "state" else "right", no_wrap=True)
    for w in doc["workers"]:
        state = Text(w["state"], style=STATE_STYLE.get(w["state"], ""))
        if w["exit"]:
            state.append(f" ({w['exit']})")
        if w["evicted"]:
            state.append(" evicted", style="bold red")
        mem = NONE if w["gpu_mem_used"] is None else f"{size(w['gpu_mem_used'])}/{size(w['gpu_mem_total'])}"
        rank = f"({w['rank']})" if w["state"] == "lost" and w["rank"] is not None else _or_none(w["rank"])
        table.add_row(str(w["node"]), rank, str(w["local_rank"]), str(w["pid"]), state,
                      _or_none(w["step"]), NONE if w["step_time"] is None else f"{w['step_time'] * 1000:.0f}ms",
                      duration(w["since_progress"]), _or_none(w["cpu_percent"], "{:.0f}"), size(w["rss"]),
                      _or_none(w["gpu_index"]), _or_none(w["gpu_util"], "{:.0f}"), mem,
                      _or_none(w["gpu_temperature"], "{}C"), _or_none(w["ecc_uncorrected"]),
                      _or_none(w["last_xid"]))
    return table


def describe(event: dict[str, Any]) -> str:
    """One event in a few words."""
    kind = event["event"]
    if kind == "fault":
        return f"rank {event.get('rank')} (pid {event.get('pid')}) lost: {event.get('how')}"
    if kind == "hang":
        return f"rank {event.get('rank')} (pid {event.get('pid')}) silent for {event.get('silent_for')} s"
    if kind == "generation":
        return f"gen {event['gen']}: world {event['world_size']} ({event.get('reason')})"
    if kind == "recovery":
        return (f"{event['latency']:.3f} s: world {event.get('world_before')} -> {event.get('world_after')}, "
                f"{event.get('steps_lost')} steps lost")
    if kind == "start":
        return f"world {event.get('world_size')}"
    if kind == "attempt_end":
        how = event.get("reason") or ("succeeded" if event.get("signal") is None else f"signal {event['signal']}")
        return f"attempt {event.get('attempt')} ended at step {_or_none(event.get('last_step'))}: {how}"
    if kind == "end":
        return str(event.get("outcome"))
    rest = {k: v for k, v in event.items() if k not in ("time", "event")}
    return " ".join(f"{k}={v}" for k, v in rest.items())


def event_table(doc: dict[str, Any]) -> Table:
    """The job's last notable events, oldest first."""
    table = Table(title="last events", title_justify="left", box=None, header_style="bold", pad_edge=False)
    for name in ("time", "event", "what"):
        table.add_column(name, no_wrap=name != "what")
    for event in doc["events"]:
        table.add_row(time.strftime("%H:%M:%S", time.localtime(event["time"])), event["event"], describe(event))
    return table


def render(doc: dict[str, Any]) -> RenderableType:
    """The whole screen for one job."""
    return Group(job_line(doc), recovery_line(doc), Text(), worker_table(doc), Text(), event_table(doc))


def render_all(docs: list[dict[str, Any]]) -> RenderableType:
    """Every job shown, one after the other."""
    parts: list[RenderableType] = []
    for doc in docs:
        parts += [render(doc), Text()] if len(docs) > 1 else [render(doc)]
    return Group(*parts)
