"""Reaching a running job: the run registry finds it, and a command posted to its agent's mailbox is answered."""

from __future__ import annotations

import signal

import pytest

from ftrun import control, registry
from ftrun.errors import UsageError


def test_a_running_job_is_registered_answers_ping_and_is_unregistered_at_exit(live_job, workload, tmp_path):
    proc, entry = live_job("--nproc-per-node", "2", workload("wait_forever.py"), tmp_path)
    assert registry.running() == [entry] and registry.find(entry.run_id) == registry.find(entry.rdzv_id) == [entry]
    store = control.connect(entry.endpoint)
    answer = control.request(store, control.node_box(0), {"cmd": "ping"})
    assert answer["ok"] and answer["node_rank"] == 0 and sorted(answer["ranks"]) == ["0", "1"]
    unknown = control.request(store, control.node_box(0), {"cmd": "frobnicate"})
    assert not unknown["ok"] and "frobnicate" in unknown["error"]
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) == 128 + signal.SIGTERM
    assert registry.running() == []


def test_an_endpoint_nobody_listens_on_is_one_clear_error(free_port):
    with pytest.raises(UsageError, match="cannot reach a job at 127.0.0.1"):
        control.connect(f"127.0.0.1:{free_port()}")
    with pytest.raises(UsageError, match="expected HOST:PORT"):
        control.connect("nohost")
