"""`ftrun report`: a run's timeline drawn from its event log, for a real run with faults and for plain data."""

from __future__ import annotations

import json
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from ftrun.cli import main
from ftrun.events import SCHEMA_VERSION
from ftrun.report.svg import nice_ticks, render_svg
from ftrun.report.timeline import Mark, build_timeline, parse_losses

SVG = "{http://www.w3.org/2000/svg}"


def texts(svg: str) -> list[str]:
    """Every text and tooltip of an SVG document (which must parse)."""
    root = ET.fromstring(svg)
    return [e.text or "" for e in root.iter() if e.tag in (f"{SVG}text", f"{SVG}title")]


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
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "events.jsonl").write_text(json.dumps({"v": 1, "time": 1.0, "event": "start"}) + "\n")
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
