"""Reaching a running job: the run registry finds it, and a command posted to its agent's mailbox is answered."""

from __future__ import annotations

import json
import signal
import subprocess
import sys

import psutil
import pytest

from ftrun import control, registry
from ftrun.errors import UsageError


def test_a_running_job_is_registered_answers_ping_and_is_unregistered_at_exit(live_job, workload, tmp_path):
    proc, entry = live_job("--nproc-per-node", "2", workload("wait_forever.py"), tmp_path)
    assert registry.running() == [entry] and registry.find(entry.run_id) == registry.find(entry.rdzv_id) == [entry]
    store = control.connect(entry.endpoint, connect_timeout=control.STORE_START_WAIT)  # registered: may be starting
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


WITHOUT_TORCH = """
import runpy, sys
sys.argv = ["ftrun", *sys.argv[1:]]
try:
    runpy.run_module("ftrun", run_name="__main__")
except SystemExit as exc:
    code = exc.code
print("torch imported:", "torch" in sys.modules, file=sys.stderr)
sys.exit(code)
"""


def test_status_and_inject_reach_a_live_job_without_importing_torch(live_job, workload, tmp_path, private_registry):
    proc, entry = live_job("--nproc-per-node", "2", workload("wait_forever.py"), tmp_path)

    def ftrun(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-c", WITHOUT_TORCH, *args], env=private_registry,
                              capture_output=True, text=True, timeout=120)

    status = ftrun("status", "--json")
    assert "torch imported: False" in status.stderr, status.stderr
    (doc,) = json.loads(status.stdout)["jobs"]
    assert doc["run_id"] == entry.run_id and doc["state"] == "running"
    victim = psutil.Process(int((tmp_path / "started_1").read_text()))
    inject = ftrun("inject", "kill", "--rank", "1")
    assert inject.returncode == 0 and "killed (SIGKILL)" in inject.stdout, inject.stderr
    assert "torch imported: False" in inject.stderr
    victim.wait(timeout=30)  # not a child of this process: psutil waits for it to be gone
