"""The Prometheus metric families of a pair of status records, without a job."""

from __future__ import annotations

import pytest

from ftrun.agent.metrics import families

pytestmark = pytest.mark.fast

WORKER = {"rank": 1, "local_rank": 1, "state": "running", "step": 41, "step_time": 0.03, "cpu_percent": 97.0,
          "rss": 1 << 30, "gpu": {"gpu_index": 5, "util": 80, "mem_used": 3 << 30, "temperature": 61,
                                 "ecc_uncorrected": 0, "last_xid": None}}


def samples(records) -> dict[tuple[str, tuple], float]:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value for f in families(records) for s in f.samples}


def test_a_follower_serves_its_workers_and_gpus_only():
    node = {"node_rank": 2, "workers": [WORKER, {**WORKER, "rank": None, "local_rank": 2, "state": "spare",
                                                 "step": None, "gpu": None}]}
    got = samples((None, node))
    ids = (("local_rank", "1"), ("node", "2"), ("rank", "1"))
    assert got[("ftrun_worker_step", ids)] == 41
    assert got[("ftrun_gpu_temperature_celsius", (("gpu", "5"), *ids))] == 61
    assert got[("ftrun_worker_state", (("local_rank", "2"), ("node", "2"), ("rank", ""), ("state", "spare")))] == 1
    assert not any(name.startswith(("ftrun_world_size", "ftrun_gpu_last_xid")) for name, _ in got)


def test_the_leader_adds_the_job_and_its_last_recovery():
    job = {"world_size": 3, "world_size_initial": 4, "generation": 1, "step": 41, "steps_per_s": 9.5, "faults": 1,
           "faults_survived": 1, "recovery_failures": 0, "restarts": 0, "recovering": False,
           "recoveries": {"count": 1, "recent": [{"latency": 0.1, "phases": {"detect": 0.001, "rendezvous": 0.03}}]}}
    got = samples((job, {"node_rank": 0, "workers": []}))
    assert (got[("ftrun_world_size", ())], got[("ftrun_faults_total", ())], got[("ftrun_recoveries_total", ())],
            got[("ftrun_last_recovery_seconds", ())]) == (3, 1, 1, 0.1)
    assert got[("ftrun_last_recovery_phase_seconds", (("phase", "rendezvous"),))] == 0.03
