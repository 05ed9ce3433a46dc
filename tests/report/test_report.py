"""`ftrun report`: a run's timeline drawn from its event log, for a real run with faults and for plain data."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from ftrun import events
from ftrun.cli import main
from ftrun.events import SCHEMA_VERSION, EventLog
from ftrun.report import command
from ftrun.report.command import read_losses
from ftrun.report.svg import nice_ticks, render_svg
from ftrun.report.timeline import Mark, build_timeline, parse_losses

SVG = "{http://www.w3.org/2000/svg}"


def texts(svg: str) -> list[str]:
    """Every text and tooltip of an SVG document (which must parse)."""
    root = ET.fromstring(svg)
    return [e.text or "" for e in root.iter() if e.tag in (f"{SVG}text", f"{SVG}title")]


def write_run(run_dir: Path) -> None:
    """A run directory whose event log has a start and an end, as the agent writes them."""
    log = EventLog(run_dir / "events.jsonl")
    log.write(events.START, run_id="r", command=["train.py"], node=0, nproc=2, world_size=2, store_port=29500)
    log.write(events.END, outcome="succeeded")
    log.close()


def test_a_run_with_two_faults_is_drawn_with_its_world_size_recoveries_and_loss(run_ftrun, workload, tmp_path, capsys):
    log_dir = tmp_path / "logs"
    result = run_ftrun("--nproc-per-node", "3", "--log-dir", log_dir, workload("faulty_train.py"), "--steps", "12",
                       "--width", "256", env={"FAULTS": "kill:4:2,exception:8:1"}, timeout=150)
    assert result.returncode == 0, result.stderr
    (run_dir,) = [p for p in log_dir.iterdir() if p.is_dir()]
    events = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]
    assert {e["v"] for e in events} == {SCHEMA_VERSION}

    capsys.readouterr()
    with pytest.raises(SystemExit) as exited:
        main(["report", str(log_dir)])  # a --log-dir: its newest run
    assert exited.value.code == 0
    written = Path(capsys.readouterr().out.strip())
    assert written == run_dir / "report.svg"
    shown = texts(written.read_text())
    assert "ftrun run " + run_dir.name in shown
    assert any(t.startswith("succeeded") and "2 workers lost, 2 recoveries in place" in t for t in shown), shown
    assert "rank 2: signal SIGKILL" in shown and "rank 1: exit code 1" in shown
    assert sum(t.startswith("detect: ") for t in shown) == 2  # one bar per recovery, each with its phases
    assert any(t.endswith("rank 2 lost: world 3 -> 2") for t in shown)
    assert any(t.endswith("rank 1 lost: world 2 -> 1") for t in shown)
    assert "Loss, as the workers printed it" in shown

    timeline = build_timeline(events, [], run_dir.name)
    assert [size for _, size in timeline.world] == [3, 2, 1, 1]


@pytest.mark.fast
def test_report_of_nothing_or_into_an_unwritable_file_is_one_line(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))  # the default runs folder: empty
    for args, code, words in ((["report", "no-such-run", "--log-dir", str(tmp_path)], 3, "no run with id 'no-such-run'"),
                              (["report", str(tmp_path / "missing")], 3, "missing: no such directory"),
                              (["report"], 3, "holds no run")):
        with pytest.raises(SystemExit) as exited:
            main(args)
        err = capsys.readouterr().err
        assert exited.value.code == code and err.count("\n") == 1 and words in err, err
    write_run(tmp_path / "run")
    with pytest.raises(SystemExit) as exited:
        main(["report", str(tmp_path / "run"), "-o", str(tmp_path / "no" / "such" / "dir.svg")])
    assert exited.value.code == 2 and "choose another file with -o FILE" in capsys.readouterr().err


EVENTS = [
    {"time": 100.0, "event": "start", "world_size": 4},
    {"time": 110.0, "event": "progress", "step": 50, "steps_per_s": 5.0, "world_size": 4, "gen": 0},
    {"time": 111.0, "event": "inject", "kind": "kill", "rank": 2},
    {"time": 111.2, "event": "fault", "rank": 2, "how": "signal SIGKILL"},
    {"time": 111.25, "event": "generation", "gen": 1, "world_size": 3},
    {"time": 111.4, "event": "recovery", "kind": "fault", "lost_ranks": [2], "world_before": 4, "world_after": 3,
     "latency": 0.2, "phases": {"detect": 0.01, "plan": 0.01, "abort": 0.02, "rendezvous": 0.06, "agree": 0.02,
                                "transfer": 0.03, "first_step": 0.05}},
    {"time": 120.0, "event": "gpu_health", "gpu": 1, "action": "evict_gpu"},
    {"time": 121.0, "event": "attempt_end", "succeeded": False},
    {"time": 125.0, "event": "worker_start", "attempt": 1},
    {"time": 130.0, "event": "end", "outcome": "succeeded"},
]


@pytest.mark.fast
def test_the_timeline_follows_world_size_faults_drills_restarts_and_recoveries():
    timeline = build_timeline(EVENTS, [(0, 0.5), (1, 0.4)], "r_1")
    assert timeline.world == [(0.0, 4), (11.25, 3), (21.0, 0), (25.0, 4), (30.0, 4)]
    assert timeline.faults == [Mark(11.2, "rank 2: signal SIGKILL"), Mark(20.0, "GPU 1: evict_gpu")]
    assert timeline.drills == [Mark(11.0, "drill: kill rank 2")] and timeline.restarts == [Mark(25.0, "group restart 1")]
    (span,) = timeline.recoveries
    assert (round(span.start, 6), span.end, span.label) == (11.2, 11.4, "rank 2 lost: world 4 -> 3")
    assert timeline.rate == [(10.0, 5.0)] and timeline.outcome == "succeeded" and timeline.duration == 30.0
    shown = texts(render_svg(timeline))
    assert "succeeded, 30.0 s; 1 worker lost, 1 recovery in place (median 200 ms), 1 group restart, 1 drill" in shown
    assert "group restart 1" in shown and "200 ms  rank 2 lost: world 4 -> 3" in shown


@pytest.mark.fast
def test_an_empty_run_still_draws_and_losses_are_read_as_workers_print_them():
    shown = texts(render_svg(build_timeline([{"time": 5.0, "event": "start", "world_size": 2}], [], "r")))
    assert "no progress recorded (the run committed no step, or ended within 5 s)" in shown and "none" in shown
    lines = ["[default0]: step=3 loss=0.25", "commit uid=1 rank=0 world=4 step=4 loss=2.5e-01", "step: 5 loss 0.125",
             "final step=6 loss=.5", "no numbers here", "step=7 accuracy=0.9"]
    assert parse_losses(lines) == {3: 0.25, 4: 0.25, 5: 0.125, 6: 0.5}
    assert nice_ticks(0, 181.5, 8) == [0, 50, 100, 150] and nice_ticks(0, 1.0, 4) == [0, 0.5, 1.0]


def report(capsys, *args: str) -> tuple[int, str, str]:
    """`ftrun report ARGS` in this process: its exit code, stdout and stderr."""
    capsys.readouterr()
    with pytest.raises(SystemExit) as exited:
        main(["report", *args])
    out, err = capsys.readouterr()
    return exited.value.code, out, err


@pytest.mark.fast
def test_a_run_directory_whose_name_is_not_text_is_printed_as_its_own_bytes(tmp_path):
    """Where stdout takes only UTF-8, a run directory's name that is not UTF-8 still prints: as its bytes, which a
    shell can use."""
    run_dir = Path(os.fsdecode(os.fsencode(tmp_path) + b"/run\xff"))
    write_run(run_dir)
    done = subprocess.run([sys.executable, "-m", "ftrun", "report", str(run_dir)], capture_output=True,
                          env={**os.environ, "PYTHONIOENCODING": "utf-8:strict"}, timeout=60)
    assert done.returncode == 0 and done.stdout == os.fsencode(run_dir / "report.svg") + b"\n", done.stderr
    assert (run_dir / "report.svg").is_file()


@pytest.mark.fast
def test_lines_of_the_log_that_are_no_event_are_skipped_and_said_so_in_one_line(tmp_path, capsys):
    write_run(tmp_path / "run")
    with open(tmp_path / "run" / "events.jsonl", "ab") as log:
        log.write(b'[1]\n{"v": 1, "event": "generation", "time": 1.0, "gen": null, "world_size": null, '
                  b'"members": null, "reason": "", "lost": [], "joiners": []}\n{"event": "end", "ti')
    code, out, err = report(capsys, str(tmp_path / "run"))
    assert code == 0 and out == f"{tmp_path / 'run' / 'report.svg'}\n"
    assert err == (f"ftrun: {tmp_path / 'run' / 'events.jsonl'}: skipped 3 lines that are no event (the last: line 5: "
                   "not JSON, cut short or corrupted)\n")
    assert "succeeded, 0.0 s; 0 workers lost, no recovery in place, 0 group restarts, 0 drills" in \
        texts((tmp_path / "run" / "report.svg").read_text())
    (tmp_path / "run" / "events.jsonl").write_bytes(b"\xff\n" * 3)
    code, out, err = report(capsys, str(tmp_path / "run"))
    assert code == 2 and not out and err.count("\n") == 1, err
    assert err.endswith("holds no event: skipped 3 lines that are no event (the last: line 3: not JSON, cut short "
                        "or corrupted)\n"), err


@pytest.mark.fast
def test_worker_logs_that_are_no_regular_file_and_folders_that_are_no_attempt_are_passed_over(tmp_path):
    for name in ("attempt_1/0", "attempt_1/1", "attempt_1/2", "attempt_1/3/stdout.log", "attempt_old/0", "attempt_2"):
        (tmp_path / name).mkdir(parents=True)
    (tmp_path / "attempt_1/0/stdout.log").write_text("step=1 loss=0.5\nstep=2 loss=0.25")
    (tmp_path / "attempt_old/0/stdout.log").write_text("step=1 loss=9\n")
    os.mkfifo(tmp_path / "attempt_1/1/stdout.log")  # read, it would wait for a writer for ever
    (tmp_path / "attempt_1/2/stdout.log").symlink_to("/dev/zero")  # read, it would never end
    (tmp_path / "attempt_10").write_text("a file")
    assert read_losses(tmp_path) == [(1, 0.5), (2, 0.25)]


@pytest.mark.fast
def test_only_the_end_of_a_long_worker_log_is_read(tmp_path, monkeypatch):
    (tmp_path / "attempt_0/0").mkdir(parents=True)
    (tmp_path / "attempt_0/0/stdout.log").write_text("".join(f"step={n:03d} loss=1.{n:03d}\n" for n in range(100)))
    monkeypatch.setattr(command, "WORKER_LOG_TAIL", 3 * len("step=000 loss=1.000\n") + 5)
    assert read_losses(tmp_path) == [(97, 1.097), (98, 1.098), (99, 1.099)]


@pytest.mark.fast
def test_losses_are_found_in_time_linear_in_the_line_and_only_where_they_are_numbers_to_draw():
    started = time.perf_counter()
    assert parse_losses(["step=1 acc=0.5 " * 20_000, "step=2 " + "loss " * 20_000]) == {}
    assert time.perf_counter() - started < 2  # 60 s and more for a search that scans each step's rest
    assert parse_losses(["step=1 loss=1e999", "step=2 loss=-1e200", f"step={'9' * 5000} loss=1", "step=3 loss=4"]) \
        == {3: 4.0}


@pytest.mark.fast
def test_text_no_xml_allows_and_a_vanishing_span_still_draw():
    start = {"time": 0.0, "event": "start", "world_size": 1}
    fault = {"time": 5e-324, "event": "fault", "rank": 0, "how": "\x01\ud800 <gone>"}
    shown = texts(render_svg(build_timeline([start, fault], [(1, 1e-320)], "run_\udcff")))
    assert "rank 0: ?? <gone>" in shown and "ftrun run run_?" in shown
