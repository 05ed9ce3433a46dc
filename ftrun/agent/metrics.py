"""Metrics where cluster users look: a Prometheus text endpoint served by each agent (``--metrics-port``).

Every agent serves its node's workers (step, step time, state, CPU, memory, GPU health); the leader also
serves the job's (world size, generation, steps, step rate, faults, recoveries and the last one's phases).
The values are the agent's last status record (about one second old), so a scrape never waits on the agent's
loop; :func:`families` turns a pair of records into metric families and is a pure function.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client.core import CollectorRegistry, CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import start_http_server

Records = tuple[dict[str, Any] | None, dict[str, Any] | None]
"""(the job's status record, or None off the leader; this node's status record, or None before the first)."""

_JOB_GAUGES = (
    ("world_size", "world_size", "Workers in the current generation."),
    ("world_size_initial", "world_size_initial", "Workers the job started with."),
    ("generation", "generation", "The current generation (one more at each in-place recovery)."),
    ("step", "step", "The highest step committed."),
    ("steps_per_second", "steps_per_s", "Committed steps per second over the last 10 s."),
)
_JOB_COUNTERS = (
    ("faults", "faults", "Workers lost, recovered in place or not."),
    ("faults_survived", "faults_survived", "Workers lost and recovered from in place."),
    ("recovery_failures", "recovery_failures", "In-place recoveries given up (a group restart followed)."),
    ("restarts", "restarts", "Group restarts."),
)
_WORKER_GAUGES = (
    ("worker_step", "step", "The last step this worker committed."),
    ("worker_step_time_seconds", "step_time", "This worker's last step time."),
    ("worker_cpu_percent", "cpu_percent", "CPU use of this worker's process."),
    ("worker_rss_bytes", "rss", "Resident memory of this worker's process."),
)
_GPU_GAUGES = (
    ("gpu_utilization_percent", "util", "GPU utilisation."),
    ("gpu_memory_used_bytes", "mem_used", "GPU memory in use."),
    ("gpu_temperature_celsius", "temperature", "GPU temperature."),
    ("gpu_ecc_uncorrected", "ecc_uncorrected", "Uncorrected ECC errors (volatile)."),
    ("gpu_last_xid", "last_xid", "The last Xid seen on this GPU."),
)
STATES = ("running", "recovering", "hung", "spare", "joining", "finished", "lost")
"""The states a worker can be in (``ftrun status``); ``ftrun_worker_state`` is 1 for the current one."""


def families(records: Records) -> list[Metric]:
    """The metric families of one (job record, node record) pair."""
    job, node = records
    out: list[Metric] = []
    if job is not None:
        for name, key, text in _JOB_GAUGES:
            if job.get(key) is not None:
                out.append(GaugeMetricFamily(f"ftrun_{name}", text, value=job[key]))
        for name, key, text in _JOB_COUNTERS:
            out.append(CounterMetricFamily(f"ftrun_{name}", text, value=job.get(key) or 0))
        out.append(GaugeMetricFamily("ftrun_recovering", "1 while an in-place recovery runs.",
                                     value=int(bool(job.get("recovering")))))
        recoveries = job.get("recoveries") or {}
        out.append(CounterMetricFamily("ftrun_recoveries", "In-place recoveries.", value=recoveries.get("count", 0)))
        last = (recoveries.get("recent") or [None])[-1]
        if last is not None:
            out.append(GaugeMetricFamily("ftrun_last_recovery_seconds", "The last recovery: fault to first step.",
                                         value=last["latency"]))
            phases = GaugeMetricFamily("ftrun_last_recovery_phase_seconds", "The last recovery, phase by phase.",
                                       labels=["phase"])
            for phase, seconds in last.get("phases", {}).items():
                phases.add_metric([phase], seconds)
            out.append(phases)
    if node is not None:
        out.extend(_worker_families(node))
    return out


def _worker_families(node: dict[str, Any]) -> Iterator[Metric]:
    labels = ["node", "local_rank", "rank"]

    def ids(worker: dict[str, Any]) -> list[str]:
        rank = worker.get("rank")
        return [str(node["node_rank"]), str(worker["local_rank"]), "" if rank is None else str(rank)]

    state = GaugeMetricFamily("ftrun_worker_state", "1 for the worker's current state.", labels=[*labels, "state"])
    for worker in node["workers"]:
        for name in STATES:
            state.add_metric([*ids(worker), name], int(worker["state"] == name))
    yield state
    for name, key, text in _WORKER_GAUGES:
        family = GaugeMetricFamily(f"ftrun_{name}", text, labels=labels)
        for worker in node["workers"]:
            if worker.get(key) is not None:
                family.add_metric(ids(worker), worker[key])
        yield family
    for name, key, text in _GPU_GAUGES:
        family = GaugeMetricFamily(f"ftrun_{name}", text, labels=[*labels, "gpu"])
        for worker in node["workers"]:
            gpu = worker.get("gpu") or {}
            if gpu.get(key) is not None:
                family.add_metric([*ids(worker), str(gpu["gpu_index"])], gpu[key])
        yield family


class _Collector:
    """Hands the latest records to prometheus_client at each scrape."""

    def __init__(self, latest: Callable[[], Records]) -> None:
        self.latest = latest

    def collect(self) -> Iterator[Metric]:
        yield from families(self.latest())


def serve(port: int, address: str, latest: Callable[[], Records]) -> None:
    """Serve ``/metrics`` on ``address:port`` from a daemon thread, reading ``latest()`` at each scrape."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Collector(latest))
    start_http_server(port, addr=address, registry=registry)
