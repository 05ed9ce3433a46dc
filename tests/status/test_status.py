"""`ftrun status` on a live 4-worker job before and after a fault, after it ends, and for jobs that are not there."""

from __future__ import annotations

import io
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest

from conftest import EXAMPLE, ROOT
from rich.console import Console

from ftrun import events
from ftrun.cli import main
from ftrun.status.document import ended_document, exit_code, live_document
from ftrun.status.render import DESCRIPTIONS, render_all
from ftrun.tally import NOTABLE, ROUTINE

FTRUN = [sys.executable, "-m", "ftrun"]


class Steps:
    """Reads a job's stdout in a thread (so the pipe never fills) and lets the test await a step; keeps the
    lines that are not steps (ftrun's own, a worker's traceback) for an assertion's message."""

    def __init__(self, stdout: io.TextIOBase) -> None:
        self.step = -1
        self.said: list[str] = []
        self.changed = threading.Condition()
        self.thread = threading.Thread(target=self._read, args=(stdout,), daemon=True)
        self.thread.start()

    def _read(self, stdout: io.TextIOBase) -> None:
        for line in stdout:
            match = re.search(r"\bstep=(\d+) ", line)
            if not match:
                self.said.append(line)
                continue
            with self.changed:
                self.step = max(self.step, int(match.group(1)))
                self.changed.notify_all()

    def reach(self, step: int, timeout: float = 60) -> int:
        """Wait until the job printed ``step`` (or a later one); returns the latest step printed."""
        with self.changed:
            assert self.changed.wait_for(lambda: self.step >= step, timeout), f"step {step} not reached: {self.step}"
            return self.step


def status(capsys: pytest.CaptureFixture, *args: str) -> tuple[int, str]:
    """`ftrun status ARGS` in this process (the real command line and store client): exit code and stdout."""
    capsys.readouterr()
    with pytest.raises(SystemExit) as exited:
        main(["status", *args])
    out, err = capsys.readouterr()
    assert not err, err
    return exited.value.code, out


def status_json(capsys: pytest.CaptureFixture, *args: str) -> tuple[int, dict]:
    """`ftrun status --json ARGS`: the exit code and the one job's document."""
    code, out = status(capsys, "--json", *args)
    (doc,) = json.loads(out)["jobs"]
    return code, doc


def poll(capsys: pytest.CaptureFixture, steps: Steps, condition, *args: str, timeout: float = 60) -> tuple[int, dict]:
    """`ftrun status --json ARGS` until ``condition(doc)`` holds; between two tries the job trains 20 more steps
    (its records change once a second), within ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        code, doc = status_json(capsys, *args)
        if condition(doc):
            return code, doc
        assert time.monotonic() < deadline, f"condition never held; last document: {json.dumps(doc, indent=1)}"
        steps.reach(steps.step + 20, timeout=max(0.0, deadline - time.monotonic()))


def rendered(doc: dict) -> str:
    """The table as a 160-column console shows it."""
    console = Console(width=160, record=True, file=io.StringIO(), color_system=None)
    console.print(render_all([doc]))
    return console.export_text()


def worker_pids(run_dir: str) -> dict[int, int]:
    """rank -> pid of the workers started, from the job's event log."""
    lines = Path(run_dir, "events.jsonl").read_text().splitlines()
    return {e["rank"]: e["pid"] for e in map(json.loads, lines) if e["event"] == "worker_start"}


def test_status_of_a_live_job_through_a_fault_and_after_it_ends(live_job, launcher_env, monkeypatch, capsys,
                                                                free_port):
    monkeypatch.setenv("XDG_CACHE_HOME", launcher_env["XDG_CACHE_HOME"])  # where the job's run directory is
    port = free_port()
    proc, entry = live_job("--nproc-per-node", "4", "--metrics-port", port, EXAMPLE, "--steps", "100000",
                           "--width", "256")
    steps = Steps(proc.stdout)
    steps.reach(3)
    pids = worker_pids(entry.run_dir)

    # found through the run registry, once every worker committed a step
    # (the job's step and its workers' come from records written apart, each once a second: wait for both)
    code, doc = poll(capsys, steps, lambda d: d["step"] is not None and all(w["step"] is not None
                                                                            for w in d["workers"]))
    assert code == 0 and doc["health"] == "healthy" and doc["state"] == "running"
    assert (doc["run_id"], doc["world_size"], doc["world_size_initial"], doc["generation"]) == (entry.run_id, 4, 4, 0)
    assert {w["rank"]: w["pid"] for w in doc["workers"]} == pids
    assert all(w["state"] == "running" and w["rss"] > 0 for w in doc["workers"])
    first = doc["step"]
    steps.reach(first + 10)
    code, doc = poll(capsys, steps, lambda d: d["step"] >= first + 10 and d["steps_per_s"],
                     "--endpoint", entry.endpoint, "--secret-file", str(Path(entry.run_dir, "secret")))
    assert code == 0 and all(w["step"] is not None and w["step"] > first for w in doc["workers"])
    assert doc["dropped_messages"] == {"mail": 0, "channel": 0, "last": None}
    assert (Path(entry.run_dir).stat().st_mode & 0o777, Path(entry.run_dir, "secret").stat().st_mode & 0o777) \
        == (0o700, 0o600)

    os.kill(pids[2], signal.SIGKILL)
    code, doc = poll(capsys, steps, lambda d: d["recoveries"]["count"] == 1 and d["state"] == "running",
                     "--run-id", entry.run_id)
    assert code == 1 and doc["health"] == "degraded"
    assert (doc["world_size"], doc["generation"], doc["faults"], doc["faults_survived"]) == (3, 1, 1, 1), \
        "".join(steps.said)
    rows = {w["pid"]: w for w in doc["workers"]}
    assert rows[pids[2]]["state"] == "lost" and rows[pids[2]]["exit"] == "SIGKILL"
    assert sorted(rows[pids[r]]["rank"] for r in (0, 1, 3)) == [0, 1, 2]
    last = doc["recoveries"]["last"]
    assert last["latency"] > 0 and last["lost_ranks"] == [2] and set(last["phases"]) >= {"rendezvous", "transfer"}
    assert {"fault", "generation", "recovery"} <= {e["event"] for e in doc["events"]}
    after = doc["step"]
    steps.reach(after + 10)  # training goes on with three ranks

    # the same, as Prometheus scrapes it (the record of a second ago: it shows the recovery too)
    scraped = scrape(port)
    assert (scraped[("ftrun_world_size", ())], scraped[("ftrun_recoveries_total", ())],
            scraped[("ftrun_faults_total", ())]) == (3, 1, 1)
    assert scraped[("ftrun_last_recovery_phase_seconds", (("phase", "rendezvous"),))] > 0
    assert scraped[("ftrun_worker_state", (("local_rank", "2"), ("node", "0"), ("rank", "2"), ("state", "lost")))] == 1
    assert scraped[("ftrun_worker_step", (("local_rank", "0"), ("node", "0"), ("rank", "0")))] > first

    screen = rendered(doc)
    assert f"run {entry.run_id}" in screen and "DEGRADED" in screen and "world 3/4" in screen
    for rank in (0, 1, 3):
        assert re.search(rf"^\s+0\s+{rows[pids[rank]]['rank']}\s+{rank}\s+{pids[rank]}\s+running\s+\d+", screen, re.M)
    assert re.search(rf"^\s+0\s+\(2\)\s+2\s+{pids[2]}\s+lost \(SIGKILL\)", screen, re.M), screen
    assert re.search(r"recoveries 1: last \d+\.\d+ s \(detect \d+ .* first_step \d+ ms\)", screen)

    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) == 128 + signal.SIGTERM
    code, doc = status_json(capsys, "--run-id", entry.run_id)  # not running: summarised from its event log
    assert code == 1 and doc["state"] == "ended" and doc["outcome"] == "interrupted"
    assert doc["skipped_lines"] == {"count": 0, "last": None}  # every record the agent wrote reads back
    assert (doc["faults"], doc["faults_survived"], doc["recoveries"]["count"]) == (1, 1, 1)
    assert doc["step"] >= after + 10 and (doc["generation"], doc["world_size"]) == (1, 3)
    ended = {w["pid"]: (w["rank"], w["state"]) for w in doc["workers"]}
    assert ended[pids[2]] == (2, "lost") and all(ended[pids[r]][1] == "stopped" for r in (0, 1, 3))
    code, out = status(capsys, "--log-dir", entry.run_dir)
    assert code == 1 and "ended: interrupted" in out and "recoveries 1: last" in out


def scrape(port: int) -> dict[tuple[str, tuple], float]:
    """The samples of an agent's metrics endpoint: (name, sorted labels) -> value."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as response:
        text = response.read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def failed(capsys: pytest.CaptureFixture, *args: str) -> tuple[int, str]:
    """`ftrun status ARGS` in this process when it must fail: the exit code and its stderr."""
    capsys.readouterr()
    with pytest.raises(SystemExit) as exited:
        main(["status", *args])
    out, err = capsys.readouterr()
    assert not out, out
    return exited.value.code, err


def test_no_such_job_is_one_line_and_exit_code_3(private_registry, launcher_env, monkeypatch, free_port, capsys):
    result = subprocess.run([*FTRUN, "status"], env=private_registry, capture_output=True, text=True, timeout=60)
    assert result.returncode == 3 and not result.stdout, result
    assert result.stderr == "ftrun: error: no ftrun job is running on this machine (name one with --endpoint " \
                            "HOST:PORT, or a past one with --run-id ID or --log-dir DIR)\n"
    monkeypatch.setenv("XDG_CACHE_HOME", launcher_env["XDG_CACHE_HOME"])
    for args, message in [(("--run-id", "nosuchrun"), "no job with run id 'nosuchrun'"),
                          (("--endpoint", f"127.0.0.1:{free_port()}"), "cannot reach a job at 127.0.0.1"),
                          (("--log-dir", "/nonexistent"), "--log-dir /nonexistent: no such directory")]:
        code, err = failed(capsys, *args)
        assert code == 3 and err.startswith(f"ftrun: error: {message}") and err.count("\n") == 1, err


def test_bad_flags_are_one_line_and_exit_code_2(private_registry, tmp_path, capsys):
    loose = tmp_path / "loose"
    loose.write_text("x" * 64)
    loose.chmod(0o644)
    for args, message in ((("--endpoint", "nohost"), "expected HOST:PORT"),
                          (("--json", "--watch"), "do not go together"),
                          (("--endpoint", "a:1", "--run-id", "x"), "--endpoint names the job already"),
                          (("--secret-file", str(loose)), "--secret-file goes with --endpoint")):
        code, err = failed(capsys, *args)
        assert code == 2 and err.startswith("ftrun: error: ") and err.count("\n") == 1 and message in err, err


@pytest.mark.fast
def test_a_store_read_without_the_runs_secret_is_one_line_and_exit_code_2(tmp_path, monkeypatch, capsys):
    """A live store named by --endpoint needs the run's secret: none, one others can read, or another run's."""
    from datetime import timedelta

    from torch.distributed import TCPStore

    from ftrun.store.auth import Seal, new_secret, write_secret_file
    from ftrun.store.job import JobStore

    monkeypatch.delenv("FTRUN_SECRET_FILE", raising=False)
    server = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30))
    JobStore(server, Seal(new_secret())).write_job_status({"nnodes": 1})
    loose, other = tmp_path / "loose", tmp_path / "other"
    write_secret_file(loose, new_secret())
    loose.chmod(0o644)
    write_secret_file(other, new_secret())
    endpoint = f"127.0.0.1:{server.port}"
    for args, message in (((), f"the job at {endpoint} signs its store with its secret: pass --secret-file"),
                          (("--secret-file", str(loose)), "other users may read it (mode 644): chmod 600 it"),
                          (("--secret-file", str(other)), "does not sign its status with this secret")):
        code, err = failed(capsys, "--endpoint", endpoint, *args)
        assert code == 2 and err.startswith("ftrun: error: ") and err.count("\n") == 1 and message in err, err


def test_with_two_jobs_running_status_lists_them_and_acts_on_neither(live_job, workload, tmp_path, capsys):
    jobs = [live_job("--nproc-per-node", "1", workload("wait_forever.py"), tmp_path)[1] for _ in range(2)]
    code, err = failed(capsys)
    assert code == 2 and err.count("\n") == 1 and "2 ftrun jobs are running: " in err, err
    assert all(job.run_id in err for job in jobs) and "name one with --run-id RUN_ID" in err
    code, doc = status_json(capsys, "--run-id", jobs[1].run_id)
    assert doc["run_id"] == jobs[1].run_id


@pytest.mark.fast
def test_gpu_health_reaches_the_row_and_a_hung_rank_degrades_the_job():
    job = {"run_id": "r_1", "nnodes": 1, "started": 100.0, "world_size": 2, "world_size_initial": 2, "generation": 0,
           "recoveries": {"count": 0, "recent": [], "median_latency": None}, "faults": 0, "faults_survived": 0,
           "restarts": 0, "step": 7, "steps_per_s": 2.0}
    gpu = {"gpu_index": 5, "util": 97, "mem_used": 40 << 30, "mem_total": 80 << 30, "temperature": 71,
           "ecc_uncorrected": 2, "last_xid": 79, "evicted": False}
    worker = {"rank": 0, "local_rank": 0, "pid": 4242, "state": "running", "exit": None, "step": 7,
              "step_time": 0.5, "since_progress": 0.1, "cpu_percent": 99.0, "rss": 3 << 30, "gpu": gpu}
    node = {"node_rank": 0, "host": "n0", "time": 110.0, "events": [], "workers": [worker, {**worker, "pid": 4243,
            "rank": 1, "local_rank": 1, "state": "hung", "gpu": None}]}
    doc = live_document(job, [node], "n0:29500", now=111.0)
    assert doc["record_age"] == 1.0 and doc["health"] == "degraded" and exit_code([doc]) == 1
    first, second = doc["workers"]
    assert (first["gpu_index"], first["gpu_util"], first["ecc_uncorrected"], first["last_xid"]) == (5, 97, 2, 79)
    assert second["gpu_index"] is None and second["gpu_temperature"] is None
    screen = rendered(doc)
    row = r"^\s+0\s+0\s+0\s+4242\s+running\s+7\s+500ms\s+0\.1s\s+99\s+3\.0G\s+5\s+97\s+40G/80G\s+71C\s+2\s+79$"
    assert re.search(row, screen, re.M), screen
    assert re.search(r"^\s+0\s+1\s+1\s+4243\s+hung\s+7\s+500ms\s+0\.1s\s+99\s+3\.0G(\s+-){6}$", screen, re.M), screen


def written_event_kinds() -> set[str]:
    """Every event kind the code writes: the first argument of each ``.write(events.KIND, ...)`` call."""
    root = ROOT / "ftrun"
    return {getattr(events, name).name for path in root.rglob("*.py")
            for name in re.findall(r"\.write\(\s*events\.([A-Z_]+)\b", path.read_text())}


@pytest.mark.fast
def test_status_shows_every_kind_of_event_the_run_writes_except_the_routine_ones():
    written = written_event_kinds()
    assert {"fault", "gpu_health", "node_lost", "fenced", "inject", "worker_start"} <= written  # the scan works
    assert written == set(events.KINDS), "an event kind is declared but never written"
    assert NOTABLE == set(events.KINDS) - ROUTINE and set(DESCRIPTIONS) == NOTABLE


def test_gpu_evictions_node_loss_fencing_and_drills_reach_the_event_table(tmp_path):
    events = [
        {"time": 100.0, "event": "start", "run_id": "r", "world_size": 4, "nproc": 4},
        {"time": 101.0, "event": "inject", "kind": "xid", "rank": 1, "uid": 1, "pid": 11, "args": {"value": 79}},
        {"time": 101.5, "event": "gpu_health", "kind": "xid", "gpu": 1, "local_rank": 1, "value": 79,
         "action": "evict_gpu", "reason": "Xid 79 (GPU has fallen off the bus)", "source": "drill", "pids": [11]},
        {"time": 102.0, "event": "node_lost", "node": 1, "reason": "lease expired", "ranks": [2, 3]},
        {"time": 103.0, "event": "fenced", "reason": "no lease renewal for 10 s"},
        {"time": 104.0, "event": "joiner_lost", "uid": 7, "how": "SIGKILL"},
        {"time": 105.0, "event": "end", "outcome": "failed", "reason": "gone"},
    ]
    doc = ended_document(events, tmp_path, {"count": 0, "last": None})
    assert [e["event"] for e in doc["events"]] == ["start", "inject", "gpu_health", "node_lost", "fenced",
                                                   "joiner_lost", "end"]
    screen = rendered(doc)
    for words in ("drill xid on rank 1 (pid 11) value=79", "GPU 1 (local rank 1): Xid 79 (GPU has fallen off "
                  "the bus) -> evict_gpu", "node 1 lost (lease expired): ranks [2, 3]",
                  "this node stopped its workers: no lease renewal for 10 s", "joiner 7 lost before it was placed"):
        assert words in screen, screen


@pytest.mark.fast
def test_a_log_with_lines_that_are_no_event_is_summarised_and_says_so(private_registry, tmp_path, monkeypatch, capsys):
    monkeypatch.delenv("COLUMNS", raising=False)
    run_dir = tmp_path / "run_1"
    log = events.EventLog(run_dir / "events.jsonl")
    log.write(events.START, run_id="r", command=["train.py"], node=0, nproc=2, world_size=2, store_port=29500)
    log.write(events.END, outcome="succeeded")
    log.close()
    with open(run_dir / "events.jsonl", "ab") as f:
        f.write(b'[1]\n{"v": 1, "event": "fenced", "time": NaN, "reason": ""}\n{"event": "end", "ti')
    code, out = status(capsys, "--json", "--log-dir", str(run_dir))

    def refuse(constant: str) -> None:
        raise ValueError(f"{constant} is not JSON")

    (doc,) = json.loads(out, parse_constant=refuse)["jobs"]
    skipped = "skipped 3 lines that are no event (the last: line 5: not JSON, cut short or corrupted)"
    assert code == 0 and doc["outcome"] == "succeeded" and doc["world_size_initial"] == 2
    assert doc["skipped_lines"] == {"count": 3, "last": "line 5: not JSON, cut short or corrupted"}
    code, out = status(capsys, "--log-dir", str(run_dir))
    assert code == 0 and f"event log: {skipped}" in out, out


@pytest.mark.fast
def test_text_from_an_event_log_is_shown_as_text_not_markup_or_escapes(tmp_path):
    events = [{"time": 100.0, "event": "start", "run_id": "r", "world_size": 1},
              {"time": 101.0, "event": "fenced", "reason": "[/x] [bold]\x1b[2J\udcff"},
              {"time": 102.0, "event": "end", "outcome": "[/y]"}]
    screen = rendered(ended_document(events, tmp_path, {"count": 0, "last": None}))
    assert "this node stopped its workers: [/x] [bold]?[2J?" in screen and "(ended: [/y])" in screen, screen
