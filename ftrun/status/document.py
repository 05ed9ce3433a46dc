"""The status document of one job: built from the live store records or from a finished run's event log.

``--json`` prints these documents and the table is rendered from them, so both always say the same.
Pure functions: no store, no files, no clock (``now`` is passed in).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ftrun.errors import EXIT_OK, EXIT_WORKERS_FAILED
from ftrun.tally import RECENT_EVENTS, exit_reason, tally_events

GPU_FIELDS = {"gpu_index": "gpu_index", "util": "gpu_util", "mem_used": "gpu_mem_used",
              "mem_total": "gpu_mem_total", "temperature": "gpu_temperature",
              "ecc_uncorrected": "ecc_uncorrected", "last_xid": "last_xid", "evicted": "evicted"}
"""GPU health keys of a node record -> their worker row keys (None where unknown or without a GPU)."""

JOB_FIELDS = ("run_id", "rdzv_id", "run_dir", "nnodes", "started", "ended", "outcome", "generation", "world_size",
              "world_size_initial", "restarts", "step", "steps_per_s", "faults", "faults_survived",
              "recovery_failures")

EXIT_DEGRADED = 1
"""`ftrun status`: the job runs below its initial size, is recovering, or has a hung rank."""


def live_document(job: dict[str, Any], nodes: list[dict[str, Any]], endpoint: str, now: float) -> dict[str, Any]:
    """A running job from its store records: the leader's job record and every node's record."""
    doc = {k: job.get(k) for k in JOB_FIELDS}
    workers = [_worker_row(node, worker) for node in nodes for worker in node["workers"]]
    state = "restarting" if job.get("restarting") else "recovering" if job.get("recovering") else "running"
    degraded = (state != "running" or job["world_size"] < job["world_size_initial"]
                or any(w["state"] in ("hung", "unkillable") for w in workers))
    events = sorted((e for node in nodes for e in node["events"]), key=lambda e: e["time"])[-RECENT_EVENTS:]
    doc.update(source="live", endpoint=endpoint, state=state, health="degraded" if degraded else "healthy",
               uptime=now - job["started"] if job.get("started") else None,
               record_age=max((now - node["time"] for node in nodes), default=None),
               recoveries=_recoveries(job["recoveries"]), workers=workers, events=events,
               dropped_messages=_dropped(nodes), skipped_lines=None)
    return doc


def _dropped(nodes: list[dict[str, Any]]) -> dict[str, Any]:
    """The messages the agents refused (unsigned, forged or malformed), summed over the nodes, and the last
    reason one gave."""
    counts = [node.get("dropped") or {} for node in nodes]
    last = next((c["last"] for c in reversed(counts) if c.get("last")), None)
    return {"mail": sum(c.get("mail", 0) for c in counts), "channel": sum(c.get("channel", 0) for c in counts),
            "last": last}


def ended_document(events: list[dict[str, Any]], run_dir: Path, skipped: dict[str, Any]) -> dict[str, Any]:
    """A job that is not running, from its event log: its outcome, faults, recoveries and last workers;
    ``skipped``: the lines of the log that are no event (``ftrun.event_log.EventReader.skipped_lines``)."""
    summary = tally_events(events).summary()
    doc = {k: summary.get(k) for k in JOB_FIELDS}
    started = summary["started"]
    ended = summary["ended"] or (events[-1]["time"] if events else None)
    doc.update(run_id=run_dir.name, rdzv_id=summary["run_id"], run_dir=str(run_dir), nnodes=1, ended=ended,
               outcome=summary["outcome"] or "unknown (the launcher ended without writing an end event)",
               source="event log", endpoint=None, state="ended", health="ended", record_age=None,
               uptime=ended - started if started and ended else None,
               recoveries=_recoveries(summary["recoveries"]), workers=_last_workers(events),
               events=summary["events"], dropped_messages=None, skipped_lines=skipped)
    return doc


def exit_code(docs: list[dict[str, Any]]) -> int:
    """0 when every job is healthy (or ended in success), 1 when one is degraded (or ended otherwise)."""
    def one(doc: dict[str, Any]) -> int:
        if doc["state"] == "ended":
            return EXIT_OK if doc["outcome"] == "succeeded" else EXIT_WORKERS_FAILED
        return EXIT_OK if doc["health"] == "healthy" else EXIT_DEGRADED

    return max((one(doc) for doc in docs), default=EXIT_OK)


def _recoveries(tallied: dict[str, Any]) -> dict[str, Any]:
    recent = tallied["recent"]
    return {**tallied, "last": recent[-1] if recent else None}


def _worker_row(node: dict[str, Any], worker: dict[str, Any]) -> dict[str, Any]:
    """One row of the worker table: the node's record of it, with its GPU health flattened."""
    row = {"node": node["node_rank"], "host": node["host"],
           **{k: worker[k] for k in ("rank", "local_rank", "pid", "state", "exit", "step", "step_time",
                                     "since_progress", "cpu_percent", "rss")}}
    gpu = worker.get("gpu") or {}
    row.update({name: gpu.get(key) for key, name in GPU_FIELDS.items()})
    return row


def _last_workers(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The workers of the last attempt as the event log left them: their last rank, pid and how each ended."""
    attempt = max((e.get("attempt", 0) for e in events if e["event"] == "worker_start"), default=0)
    first = next((i for i, e in enumerate(events) if e["event"] == "worker_start" and e.get("attempt", 0) == attempt),
                 len(events))
    last = events[first:]
    starts = [e for e in last if e["event"] == "worker_start"]
    exits = {e["uid"]: e["exitcode"] for e in last if e["event"] == "worker_exit"}
    lost = {e["uid"]: e["rank"] for e in last if e["event"] == "fault"}
    members = next((e["members"] for e in reversed(last) if e["event"] == "generation"), None)
    rows = []
    for start in starts:
        uid, code = start["uid"], exits.get(start["uid"])
        state = "lost" if uid in lost else "finished" if code == 0 else "stopped" if code else "unknown"
        if uid in lost:
            rank = lost[uid]  # its rank in the generation it was lost from
        elif members is not None:  # the last generation's rank; none for a spare never placed
            rank = members.index(uid) if uid in members else None
        else:  # generation 0: the launch ranks, spares have none
            rank = None if start.get("joiner") else start["rank"]
        rows.append({"node": 0, "host": None, "rank": rank, "local_rank": start["local_rank"], "pid": start["pid"],
                     "state": state, "exit": exit_reason(code), "step": None, "step_time": None,
                     "since_progress": None, "cpu_percent": None, "rss": None,
                     **{name: None for name in GPU_FIELDS.values()}})
    return rows
