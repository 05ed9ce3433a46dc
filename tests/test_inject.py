"""`ftrun inject` against live 4-worker CPU jobs: each drill is delivered through the store to the agent,
recorded, and turns into the fault (or slowdown) it names; the survivors recover in place and finish.

The live jobs run tests/workloads/held_train.py, held to one step per 0.2 s while the test drills, then
released to run to its end; its losses are compared with a fault-free run of the same training. Drills are
awaited through the job's output and its event log, one after another.
"""

from __future__ import annotations

import http.server
import math
import queue
import re
import socket
import subprocess
import sys
import threading
import time
from itertools import islice
from pathlib import Path

import pytest

from ftrun import cli
from ftrun import protocol
from ftrun.inject import GONE, ChaosSchedule, EventFollower, Job, await_settled, drill_message, job_store
from ftrun.errors import UsageError
from ftrun.store import keys
from ftrun.worker.injected import InjectedFault, WorkerDrills
from runs import COMMIT, HELD_STEPS, HELD_TRAINING, RTOL

STEPS, TRAINING = HELD_STEPS, HELD_TRAINING
DEADLINE = 90.0  # seconds any one awaited thing may take on a busy machine
SLOW = 1.0  # seconds the slow drill adds to each step: 5x the held pace


class LiveJob:
    """A held job started by the ``live_job`` fixture: its output lines (with arrival times) and events."""

    def __init__(self, proc: subprocess.Popen, log_dir: Path, hold: Path, run_id: str) -> None:
        self.proc, self.hold, self.run_id = proc, hold, run_id
        self.lines: queue.Queue[tuple[float, str | None]] = queue.Queue()
        self.stdout: list[str] = []
        self.stderr: list[str] = []
        (events,) = log_dir.glob("*/events.jsonl")
        self.follower = EventFollower(events)
        self.events: list[dict] = []
        self.awaited = 0  # events before this index were passed by await_event
        threading.Thread(target=self._read_stdout, daemon=True).start()
        threading.Thread(target=lambda: self.stderr.extend(proc.stderr), daemon=True).start()

    def _read_stdout(self) -> None:
        for line in self.proc.stdout:
            self.stdout.append(line)
            self.lines.put((time.monotonic(), line))
        self.lines.put((time.monotonic(), None))

    def commits(self, uid: int):
        """(arrival time, step) of each step committed by worker ``uid`` from now on."""
        while True:
            stamp, line = self.lines.get(timeout=DEADLINE)
            assert line is not None, f"the job ended early:\n{''.join(self.stderr)[-3000:]}"
            match = COMMIT.search(line.rstrip())
            if match and int(match[1]) == uid:
                yield stamp, int(match[4])

    def await_event(self, **fields) -> dict:
        """The first event after the one the last call returned whose fields have these values. Every event
        read is kept, the ones read with it but after it too: the next call starts from them."""
        deadline = time.monotonic() + DEADLINE
        while time.monotonic() < deadline:
            self.events += self.follower.new()
            for index in range(self.awaited, len(self.events)):
                if all(self.events[index].get(k) == v for k, v in fields.items()):
                    self.awaited = index + 1
                    return self.events[index]
            time.sleep(0.05)  # polling the file the agent appends to
        raise AssertionError(f"no event {fields} within {DEADLINE:.0f} s; events: {self.events}")

    def finish(self) -> int:
        """Release the hold and wait for the job's exit code."""
        self.hold.unlink()
        code = self.proc.wait(timeout=DEADLINE)
        self.events += self.follower.new()
        return code

    def of(self, kind: str) -> list[dict]:
        return [e for e in self.events if e["event"] == kind]

    def check_losses(self, baseline: dict[int, float]) -> None:
        """Every step was committed, and every committed loss is the fault-free run's."""
        steps = set()
        for line in self.stdout:
            match = COMMIT.search(line.rstrip())
            if match:
                step, loss = int(match[4]), float(match[5])
                steps.add(step)
                assert loss == pytest.approx(baseline[step], rel=RTOL), (step, loss, baseline[step])
        assert steps == set(range(STEPS))


@pytest.fixture
def held_job(live_job, workload, tmp_path):
    """Start a held 4-worker job with --hang-timeout 3 (and more ftrun flags); returns its LiveJob."""

    def start(*flags: str) -> LiveJob:
        hold, log_dir = tmp_path / "hold", tmp_path / "logs"
        hold.touch()
        proc, entry = live_job("--nproc-per-node", 4, "--hang-timeout", 3, "--log-dir", log_dir, *flags,
                               workload("held_train.py"), *TRAINING, env={"HOLD": str(hold)})
        return LiveJob(proc, log_dir, hold, entry.run_id)

    return start


def inject(capsys, *args: str) -> tuple[int, str, str]:
    """Run `ftrun inject ARGS` (in this process, against the live job): exit code, stdout, stderr."""
    with pytest.raises(SystemExit) as exit_:
        cli.main(["inject", *args])
    out, err = capsys.readouterr()
    return exit_.value.code, out, err


def gaps_of(commits):
    """(time since the previous commit, arrival time) for each commit from now on."""
    last = next(commits)[0]
    for stamp, _ in commits:
        yield stamp - last, stamp
        last = stamp


def since(gaps, moment: float):
    """The gaps of the commits that arrived after ``moment``."""
    return (gap for gap, stamp in gaps if stamp > moment)


def check_in_place(recovery: dict, lost_rank: int, world_before: int) -> None:
    assert recovery["lost_ranks"] == [lost_rank] and recovery["steps_lost"] == 0, recovery
    assert (recovery["world_before"], recovery["world_after"]) == (world_before, world_before - 1), recovery


def test_slow_kill_exception_and_hang_drills_on_one_live_job(held_job, held_baseline, capsys):
    """Slow rank 0, then clear it; kill rank 3, raise in rank 2, hang rank 1: three in-place recoveries."""
    job = held_job()
    gaps = gaps_of(job.commits(uid=0))
    next(islice(gaps, 3, None))  # training is under way
    assert any(gap < SLOW for gap, _ in islice(gaps, 3))  # held pace: the slow drill below is measurable

    code, out, _ = inject(capsys, "slow", str(SLOW), "--rank", "0")
    assert code == 0 and out.startswith(f"run {job.run_id}: rank 0 (pid ")
    assert out.endswith(f": each step slowed by {SLOW:g} s\n")
    slowed = since(gaps, time.monotonic())
    assert any(gap >= SLOW for gap in islice(slowed, 5))  # the drill reaches the worker within a few steps
    assert all(gap >= SLOW for gap in islice(slowed, 3))
    assert job.await_event(event="inject", kind="slow")["args"] == {"seconds": SLOW, "duration": None}
    code, out, _ = inject(capsys, "slow", "0", "--rank", "0")
    assert code == 0 and out.endswith(": steps no longer slowed\n")
    assert any(gap < SLOW for gap in islice(since(gaps, time.monotonic()), 8))

    code, out, err = inject(capsys, "kill", "--rank", "9")
    assert (code, out) == (2, "") and err.startswith("ftrun: error: no live rank 9 in job ") \
        and err.endswith("(its ranks: 0, 1, 2, 3)\n") and err.count("\n") == 1

    for kind, rank, world in (("kill", 3, 4), ("exception", 2, 3), ("hang", 1, 2)):
        code, out, _ = inject(capsys, kind, "--rank", str(rank))
        assert code == 0 and out.startswith(f"run {job.run_id}: rank {rank} (pid "), out
        injected = job.await_event(event="inject", kind=kind, rank=rank)
        if kind == "hang":
            hang = job.await_event(event="hang", pid=injected["pid"])
            assert hang["stopped"] and hang["silent_for"] >= 3
        check_in_place(job.await_event(event="recovery", lost_uids=[injected["uid"]]), rank, world)

    assert job.finish() == 0, "".join(job.stderr)[-3000:]
    exits = {e["uid"]: e["exitcode"] for e in job.of("worker_exit")}
    # rank 2 raised: it exits with 1. A teardown that outlasts --hang-timeout (seen on loaded machines) is a
    # hang: its stack dump is asked for, and it is killed DUMP_GRACE s later unless its exit (1) comes first, as
    # it did in one CI run. Only a rank the watchdog flagged is killed.
    hung = {e["uid"] for e in job.of("hang")}
    assert exits[2] == 1 or (exits[2] == -9 and 2 in hung), (exits, hung)
    assert {uid: code for uid, code in exits.items() if uid != 2} == {0: 0, 1: -9, 3: -9} and 1 in hung
    # the stopped rank 1 was killed as it was: resumed for a stack dump, it would train on, and the dump of its
    # running threads could crash it (SIGSEGV, not SIGKILL)
    assert 2 in hung or "most recent call first" not in "".join(job.stderr)
    assert "InjectedFault: exception injected by ftrun inject into rank 2" in "".join(job.stderr)
    job.check_losses(held_baseline)


def test_chaos_injects_seeded_faults_each_recovered_in_place(held_job, held_baseline, capsys):
    """Chaos at a 0.5 s MTBF over kill, hang and exception takes ranks until one is left, each recovered."""
    job = held_job()
    next(step for _, step in job.commits(uid=0) if step >= 3)
    code, out, err = inject(capsys, "chaos", "--mtbf", "0.5", "--duration", "60", "--kinds", "kill,hang,exception",
                            "--seed", "26")
    assert code == 0, out + err
    assert out.startswith(f"chaos: run {job.run_id}, MTBF 0.5 s")
    assert out.count(": recovered in ") == 3 and "one live rank left" in out, out
    assert job.finish() == 0, "".join(job.stderr)[-3000:]
    injected = job.of("inject")
    recoveries = job.of("recovery")
    assert len(injected) == len(recoveries) == 3
    schedule, ranks, expected = ChaosSchedule(0.5, ("kill", "hang", "exception"), seed=26), {0, 1, 2, 3}, []
    for _ in range(3):  # the seed decides: each fault takes a live rank out of the draw
        _, kind, rank = schedule.next(ranks)
        expected.append((kind, rank))
        ranks.remove(rank)
    assert [(e["kind"], e["rank"]) for e in injected] == expected
    assert [r["lost_uids"] for r in recoveries] == [[e["uid"]] for e in injected]
    assert [r["world_after"] for r in recoveries] == [3, 2, 1] and all(r["steps_lost"] == 0 for r in recoveries)
    job.check_losses(held_baseline)


def test_xid_and_ecc_drills_go_through_the_gpu_health_policy(held_job, held_baseline, capsys):
    """On a CPU job each local rank stands for a GPU: Xid 48 and an uncorrected ECC error evict the GPU (its
    rank is lost, the others recover in place); Xid 92 is only recorded."""
    job = held_job()
    next(step for _, step in job.commits(uid=0) if step >= 3)
    for args, rank, world, action in ((["xid", "48"], 3, 4, "evict_gpu"), (["ecc"], 2, 3, "evict_gpu"),
                                      (["xid", "92"], 0, None, "ignore")):
        code, out, _ = inject(capsys, *args, "--rank", str(rank))
        assert code == 0 and f": {action} (GPU {rank}: " in out, out
        injected = job.await_event(event="inject", kind=args[0], rank=rank)  # written after the drill is done
        (health,) = [e for e in job.of("gpu_health") if e["local_rank"] == rank]
        assert (health["source"], health["kind"], health["value"], health["action"]) == (
            "inject", "xid" if args[0] == "xid" else "ecc_uncorrected", int(args[1]) if len(args) > 1 else 1, action)
        if world is not None:
            check_in_place(job.await_event(event="recovery", lost_uids=[injected["uid"]]), rank, world)
    # a sealed command that `ftrun inject` would refuse (another version's, or a hand-made one): the agent answers
    # it did not act, and no worker is asked to sleep for ever (time.sleep(inf) raises OverflowError)
    store = Job.connect(job_store(job.run_id, None, None)).store
    for seconds, duration, refused in ((math.inf, None, "slow needs 0 to 1,000,000 SECONDS, not inf"),
                                       (1e300, None, "slow needs 0 to 1,000,000 SECONDS, not 1e+300"),
                                       (1, math.nan, "--for needs more than 0 and at most 1,000,000 SECONDS, not nan")):
        answer = store.request(keys.node_box(0), {"cmd": protocol.INJECT, "kind": "slow", "rank": 0,
                                                  "seconds": seconds, "duration": duration})
        assert answer == {"ok": False, "run": job.run_id, "error": refused}
    assert job.finish() == 0, "".join(job.stderr)[-3000:]
    assert len(job.of("recovery")) == 2 and {e["gpu"] for e in job.of("gpu_health")} == {3, 2, 0}
    assert not [e for e in job.of("inject") if e["kind"] == "slow"]
    job.check_losses(held_baseline)


def test_an_exception_drill_needs_the_worker_api_and_is_refused_in_one_line(live_job, workload, tmp_path, capsys):
    live_job("--nproc-per-node", 2, workload("wait_forever.py"), tmp_path)
    code, out, err = inject(capsys, "exception", "--rank", "1")
    assert (code, out) == (2, "") and err.startswith("ftrun: error: ") and err.count("\n") == 1, err
    assert "rank 1 does not use the ftrun worker API" in err


@pytest.mark.parametrize("args, code, message", [
    (["kill", "--rank", "0"], 3, "no ftrun job is running on this machine"),
    (["kill", "--rank", "0", "--run-id", "gone"], 3, "no ftrun job is running with run id 'gone'"),
    (["frobnicate", "--rank", "0"], 2, "unknown drill 'frobnicate'"),
    (["kill"], 2, "inject kill needs --rank R"),
    (["chaos", "--mtbf", "1"], 2, "inject chaos needs --mtbf SECONDS and --duration SECONDS"),
    (["kill", "--rank", "0", "--endpoint", "127.0.0.1:1"], 3, "cannot reach a job at 127.0.0.1:1"),
    (["kill", "--rank", "0", "--endpoint", "h:1", "--run-id", "x"], 2, "--endpoint names the job already"),
])
def test_bad_targets_are_one_line(args, code, message, private_registry):
    result = subprocess.run([sys.executable, "-m", "ftrun", "inject", *args], env=private_registry, capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == code and result.stdout == ""
    assert result.stderr.startswith("ftrun: error: " + message) and result.stderr.count("\n") == 1, result.stderr


# ---------------------------------------------------------------------------------- waits that end
class NotAStore:
    """A real listening socket that is no job's store: one that accepts and never answers ("silent"), one
    that never accepts ("backlog": the kernel completes the handshake), or an HTTP server ("http")."""

    def __init__(self, kind: str) -> None:
        self.held: list[socket.socket] = []
        if kind == "http":
            self.server = http.server.HTTPServer(("127.0.0.1", 0), http.server.BaseHTTPRequestHandler)
            self.port = self.server.server_address[1]
            threading.Thread(target=self.server.serve_forever, daemon=True).start()
            return
        self.server = socket.create_server(("127.0.0.1", 0), backlog=16)
        self.port = self.server.getsockname()[1]
        if kind == "silent":
            threading.Thread(target=self._hold, daemon=True).start()

    def _hold(self) -> None:
        while True:
            connection, _ = self.server.accept()
            self.held.append(connection)


@pytest.mark.parametrize("kind", ["silent", "backlog", "http"])
def test_inject_at_a_port_that_is_no_store_gives_up_in_its_timeout_with_one_line(kind, private_registry):
    target = NotAStore(kind)
    result = subprocess.run([sys.executable, "-m", "ftrun", "inject", "kill", "--rank", "0", "--endpoint",
                             f"127.0.0.1:{target.port}"], env=private_registry, capture_output=True, text=True,
                            timeout=120)  # torch's client alone waited 900 s and more
    assert result.returncode == 3 and result.stdout == "", result.stderr
    last = result.stderr.splitlines()[-1]
    assert last.startswith(f"ftrun: error: cannot reach a job at 127.0.0.1:{target.port}: "), result.stderr
    if kind != "http":
        assert result.stderr == f"ftrun: error: cannot reach a job at 127.0.0.1:{target.port}: no TCPStore " \
                                "answered within 5 s (is another service listening there?)\n"


def test_chaos_stops_with_one_line_once_the_agent_is_gone(live_job, workload, tmp_path, private_registry):
    proc, _ = live_job("--nproc-per-node", 2, workload("wait_forever.py"), tmp_path)
    chaos = subprocess.Popen([sys.executable, "-m", "ftrun", "inject", "chaos", "--mtbf", "3600", "--duration",
                              "1000000", "--kinds", "kill", "--seed", "1"], env=private_registry,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert re.match(r"chaos: run \S+, MTBF 3600 s", chaos.stdout.readline())  # it follows the job now
        proc.kill()  # the agent, and the store it hosts, are gone at once; no `end` reaches the event log
        proc.wait(timeout=60)
        out, err = chaos.communicate(timeout=60)
    finally:
        chaos.kill()
    # (torch's store client may log the reset connection on stderr itself: gone with ftrun's own client)
    assert chaos.returncode == 1 and "ftrun: error" not in err and "Traceback" not in err, err
    assert re.fullmatch(r"chaos \+\d+\.\d\d s: the job is gone \(.+\); stopping", out.strip()), out


@pytest.mark.fast
def test_waiting_for_a_recovery_ends_once_the_job_is_gone(tmp_path):
    (tmp_path / "events.jsonl").write_text("")
    settled = await_settled(EventFollower(tmp_path / "events.jsonl"), uid=2, alive=lambda: False, poll=0.01)
    assert settled["event"] == GONE


@pytest.mark.fast
def test_a_drill_without_the_runs_secret_is_refused_before_it_is_sent(tmp_path, monkeypatch, capsys):
    from datetime import timedelta

    from torch.distributed import TCPStore

    from ftrun.store import keys
    from ftrun.store.auth import Seal, new_secret, write_secret_file
    from ftrun.store.job import JobStore

    monkeypatch.delenv("FTRUN_SECRET_FILE", raising=False)
    server = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30))
    JobStore(server, Seal(new_secret())).write_job({"run_id": "r", "nnodes": 1})
    other = tmp_path / "other"
    write_secret_file(other, new_secret())
    endpoint = f"127.0.0.1:{server.port}"
    for args, message in (((), f"the job at {endpoint} signs its store with its secret: pass --secret-file"),
                          (("--secret-file", str(other)), "does not sign its records with this secret")):
        code, out, err = inject(capsys, "kill", "--rank", "0", "--endpoint", endpoint, *args)
        assert (code, out) == (2, "") and err.count("\n") == 1 and message in err, err
    assert not server.check([keys.mail_count(keys.node_box(0))])  # nothing was posted


def test_with_two_jobs_running_inject_lists_them_and_touches_neither(live_job, workload, tmp_path, capsys):
    jobs = [live_job("--nproc-per-node", 1, workload("wait_forever.py"), tmp_path) for _ in range(2)]
    code, out, err = inject(capsys, "kill", "--rank", "0")
    assert (code, out) == (2, "") and err.count("\n") == 1 and "2 ftrun jobs are running: " in err, err
    assert all(entry.run_id in err for _, entry in jobs)
    assert all(proc.poll() is None for proc, _ in jobs)  # nobody was killed
    code, out, _ = inject(capsys, "kill", "--rank", "0", "--run-id", jobs[1][1].run_id)
    assert code == 0 and out.startswith(f"run {jobs[1][1].run_id}: rank 0 (pid "), out
    assert jobs[0][0].poll() is None


@pytest.mark.fast
def test_drill_messages_and_a_seeded_schedule():
    assert drill_message("xid", "79", 2, None) == {"cmd": "inject", "kind": "xid", "rank": 2, "value": 79}
    assert drill_message("ecc", None, 0, None)["value"] == 1
    assert drill_message("slow", "0.5", 1, 10)["duration"] == 10
    for bad in (("xid", None, 1, None), ("slow", "-1", 1, None), ("kill", "3", 1, None), ("hang", None, 1, 5)):
        with pytest.raises(UsageError):
            drill_message(*bad)
    def draws(seed: int) -> list[tuple[float, str, int]]:
        schedule = ChaosSchedule(2.0, ("kill", "hang"), seed=seed)
        return [schedule.next(range(4)) for _ in range(5)]

    assert draws(5) == draws(5) != draws(6)
    assert all(gap > 0 and kind in ("kill", "hang") and rank in range(4) for gap, kind, rank in draws(5))


@pytest.mark.fast
def test_the_worker_raises_once_and_sleeps_while_slowed():
    drills = WorkerDrills()
    assert not drills.on_message({"t": protocol.PLAN})
    assert drills.on_message({"t": protocol.RAISE, "message": "drill"})
    with pytest.raises(InjectedFault, match="drill"):
        drills.at_step()
    drills.at_step()  # raised once only
    assert drills.on_message({"t": protocol.SLOW, "seconds": 0.1, "duration": 0.3})
    started = time.monotonic()
    drills.at_step()
    assert time.monotonic() - started >= 0.1
    while time.monotonic() - started < 0.3:  # until the --for duration has passed
        drills.at_step()
    started = time.monotonic()
    drills.at_step()
    assert time.monotonic() - started < 0.1


@pytest.mark.fast
def test_the_event_follower_skips_lines_that_are_no_event_and_waits_for_one_being_written(tmp_path):
    import json
    import os

    from ftrun import events

    path = tmp_path / "events.jsonl"
    log = events.EventLog(path)
    joiner = log.write(events.WORKER_START, uid=2, rank=None, local_rank=2, pid=7, joiner=True, attempt=0, node=0)
    log.close()
    recovery = {"v": 1, "time": 1700000002.0, "event": "recovery", "kind": "fault", "gen": 1, "lost_ranks": [1],
                "lost_uids": [1], "world_before": 3, "world_after": 3, "joiners": [2], "steps_lost": 0,
                "resumed_at_step": 5, "latency": 0.25, "phases": {"detect": 0.01}, "data_plane": "formed"}
    line = json.dumps(recovery).encode() + b"\n"
    with open(path, "ab") as f:
        f.write(b'{"event": "recovery", "lost_uids": 1}\n[1]\n\xff\n' + line[:20])
    follower = EventFollower(path)
    assert follower.new() == [joiner]
    with open(path, "ab") as f:
        f.write(line[20:])
    assert follower.new() == [recovery] and follower.reader.skipped == 3
    os.mkfifo(tmp_path / "fifo")
    with pytest.raises(UsageError, match="fifo: not a regular file$"):
        EventFollower(tmp_path / "fifo").new()
