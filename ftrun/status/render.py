"""Render status documents for a person: a job line, one row per worker, the last events (rich)."""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from typing import Any

from rich.console import Group, RenderableType
from rich.table import Table
from rich.text import Text

from ftrun.event_log import skipped_words
from ftrun.tally import RECOVERY_PHASES

NONE = "-"
HEALTH_STYLE = {"healthy": "bold green", "degraded": "bold yellow", "ended": "bold"}
STATE_STYLE = {"running": "green", "recovering": "yellow", "hung": "bold red", "unkillable": "bold red", "lost": "red",
               "spare": "cyan", "joining": "cyan", "finished": "dim", "stopped": "dim"}
_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f\ud800-\udfff]")
"""Control characters but tab and newline, which a terminal would act on (an escape sequence in an event log),
and surrogates, which a UTF-8 terminal cannot show (a run directory's name that is not UTF-8)."""


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


def _shown(value: str | Text) -> Text:
    """``value`` as the screen shows it: never read as markup, each control character a ``?`` (the text of an
    event log, or of a record, is anyone's)."""
    text = value if isinstance(value, Text) else Text(value)
    text.plain = _CONTROL.sub("?", text.plain)  # as long as before: the styles stay where they were
    return text


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
    dropped = doc.get("dropped_messages") or {}
    if dropped.get("mail") or dropped.get("channel"):
        text.append(f"\nrefused {dropped['mail']} store messages and {dropped['channel']} worker lines "
                    f"(last: {dropped['last'] or 'a malformed line'})", style="yellow")
    skipped = doc.get("skipped_lines") or {}
    if skipped.get("count"):
        text.append(f"\nevent log: {skipped_words(skipped)}", style="yellow")
    return _shown(text)


def recovery_line(doc: dict[str, Any]) -> Text:
    """How many recoveries, the last one's latency and phases, and the median latency."""
    recoveries = doc["recoveries"]
    last = recoveries["last"]
    if last is None:
        return Text("recoveries 0", style="dim")
    phases = " ".join(f"{name} {last['phases'][name] * 1000:.0f}" for name in RECOVERY_PHASES if name in last["phases"])
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
        table.add_row(*map(_shown, (
            str(w["node"]), rank, str(w["local_rank"]), str(w["pid"]), state, _or_none(w["step"]),
            NONE if w["step_time"] is None else f"{w['step_time'] * 1000:.0f}ms", duration(w["since_progress"]),
            _or_none(w["cpu_percent"], "{:.0f}"), size(w["rss"]), _or_none(w["gpu_index"]),
            _or_none(w["gpu_util"], "{:.0f}"), mem, _or_none(w["gpu_temperature"], "{}C"),
            _or_none(w["ecc_uncorrected"]), _or_none(w["last_xid"]))))
    return table


def _attempt_end(event: dict[str, Any]) -> str:
    how = event.get("reason") or ("succeeded" if event.get("signal") is None else f"signal {event['signal']}")
    return f"attempt {event.get('attempt')} ended at step {_or_none(event.get('last_step'))}: {how}"


def _rank(event: dict[str, Any]) -> str:
    return f"rank {event.get('rank')} (pid {event.get('pid')})"


DESCRIPTIONS: dict[str, Callable[[dict[str, Any]], str]] = {
    "start": lambda e: f"world {e.get('world_size')}",
    "fault": lambda e: f"{_rank(e)} lost: {e.get('how')}",
    "hang": lambda e: f"{_rank(e)} silent for {e.get('silent_for')} s",
    "gpu_health": lambda e: f"GPU {e.get('gpu')} (local rank {e.get('local_rank')}): {e.get('reason')} "
                            f"-> {e.get('action')}",
    "node_joined": lambda e: f"node {e.get('node')} joined: its workers join the group, up to {e.get('target')}",
    "node_lost": lambda e: f"node {e.get('node')} lost ({e.get('reason')}): ranks {e.get('ranks')}",
    "fenced": lambda e: f"this node stopped its workers: {e.get('reason')}",
    "leader": lambda e: f"node {e.get('node')} elected leader (term {e.get('term')}), the store now at "
                        f"{e.get('store')}: {e.get('reason')}",
    "inject": lambda e: f"drill {e.get('kind')} on {_rank(e)}" + "".join(f" {k}={v}" for k, v in
                                                                        (e.get("args") or {}).items()),
    "generation": lambda e: f"gen {e['gen']}: world {e['world_size']} ({e.get('reason')})",
    "recovery": lambda e: (f"{e['latency']:.3f} s: world {e.get('world_before')} -> {e.get('world_after')}, "
                           f"{e.get('steps_lost')} steps lost"),
    "recovery_refused": lambda e: f"no in-place recovery: {e.get('reason')}",
    "recovery_failed": lambda e: f"in-place recovery failed: {e.get('reason')}",
    "link_fault": lambda e: f"gen {e.get('gen')}: {e.get('action')}" + (f" ranks {e['ranks']}" if e.get("ranks")
                                                                         else "") + f" ({e.get('reason')})",
    "unkillable": lambda e: f"{_rank(e)} still there {e.get('waited')} s after SIGKILL ({e.get('state')}): "
                            "counted lost",
    "writes_dropped": lambda e: f"{e.get('count')} writes to {e.get('what')} dropped: {e.get('error')}",
    "joiner_lost": lambda e: f"joiner {e.get('uid')} lost before it was placed: {e.get('how')}",
    "rescue": lambda e: f"state saved for the group restart (best step {_or_none(e.get('best_step'))})",
    "group_failure": lambda e: str(e.get("reason")),
    "resumed": lambda e: f"attempt {e.get('attempt')} resumed at step {e.get('step')}, "
                         f"{e.get('latency', 0):.2f} s after the failure",
    "attempt_end": _attempt_end,
    "fork_server": lambda e: (f"fork server {e.get('state')}" + (f": {e['reason']}" if e.get("reason") else "")
                              + (f" (imports took {e['seconds']:.1f} s)" if e.get("seconds") is not None else "")),
    "end": lambda e: str(e.get("outcome")),
}
"""How :func:`describe` words each kind of event (ftrun.tally.NOTABLE)."""


def describe(event: dict[str, Any]) -> str:
    """One event in a few words."""
    words = DESCRIPTIONS.get(event["event"])
    if words is not None:
        return words(event)
    rest = {k: v for k, v in event.items() if k not in ("v", "time", "event")}
    return " ".join(f"{k}={v}" for k, v in rest.items())


def event_table(doc: dict[str, Any]) -> Table:
    """The job's last notable events, oldest first."""
    table = Table(title="last events", title_justify="left", box=None, header_style="bold", pad_edge=False)
    for name in ("time", "event", "what"):
        table.add_column(name, no_wrap=name != "what")
    for event in doc["events"]:
        table.add_row(*map(_shown, (time.strftime("%H:%M:%S", time.localtime(event["time"])), event["event"],
                                    describe(event))))
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
