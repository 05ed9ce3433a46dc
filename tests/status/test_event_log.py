"""Reading an event log back: the lines that are no event (cut short, corrupted, of the wrong shape, too long)
are skipped and counted, never a traceback, a hang, or memory without bound."""

from __future__ import annotations

import json
import os
import tracemalloc
from pathlib import Path

import pytest

from ftrun import events
from ftrun.event_log import MAX_LINE, MAX_TIME, EventReader, event_problem, read_events
from ftrun.events import EventLog
from ftrun.paths import Unreadable

pytestmark = pytest.mark.fast


def write_run(path: Path) -> list[dict]:
    """A short run with a fault recovered in place, as the agent writes it; its records."""
    log = EventLog(path)
    records = [
        log.write(events.START, run_id="r", command=["train.py"], node=0, nproc=2, world_size=2, store_port=29500),
        *(log.write(events.WORKER_START, uid=uid, rank=uid, local_rank=uid, pid=100 + uid, joiner=False, attempt=0,
                    node=0) for uid in (0, 1)),
        log.write(events.FAULT, uid=1, rank=1, pid=101, how="signal SIGKILL", message="", gen=0),
        log.write(events.GENERATION, gen=1, members=[0], reason="fault", lost=[1], joiners=[], world_size=1),
        log.write(events.RECOVERY, kind="fault", gen=1, lost_ranks=[1], lost_uids=[1], world_before=2, world_after=1,
                  joiners=[], steps_lost=0, resumed_at_step=5, latency=0.25, phases={"detect": 0.01, "plan": 0.24},
                  data_plane="formed"),
        log.write(events.PROGRESS, step=9, steps_per_s=3.5, world_size=1, gen=1),
        log.write(events.END, outcome="succeeded"),
    ]
    log.close()
    return records


def skipped(path: Path) -> tuple[list[dict], dict]:
    """The events of the log at ``path`` and what its reader skipped."""
    reader = EventReader()
    found = read_events(path, reader)
    return found, reader.skipped_lines()


GOOD = {"v": 1, "time": 1700000001.0, "event": "generation", "gen": 1, "members": [0], "reason": "fault", "lost": [1],
        "joiners": [], "world_size": 1}
RECOVERY = {"v": 1, "time": 1700000002.0, "event": "recovery", "kind": "fault", "gen": 1, "lost_ranks": [1],
            "lost_uids": [1], "world_before": 2, "world_after": 1, "joiners": [], "steps_lost": 0,
            "resumed_at_step": 5, "latency": 0.25, "phases": {"detect": 0.01}, "data_plane": "formed"}
BAD_LINES = {
    "cut short": b'{"event": "end", "ti',
    "not UTF-8": b'{"v": 1, "time": 1700000001.0, "event": "end", "outcome": "\xff\xfe"}',
    "nested 100,000 deep": b"[" * 100_000 + b"]" * 100_000,
    "nested 20 deep": json.dumps({**GOOD, "reason": [[[[[[[[[[[[[[[[[[[[]]]]]]]]]]]]]]]]]]]]}).encode(),
    "not an object": b"[1]",
    "a string": b'"x"',
    "nulls": b'{"v": 1, "event": "generation", "time": 1700000001.0, "gen": null, "world_size": null, '
             b'"members": null, "reason": "", "lost": [], "joiners": []}',
    "a latency that is text": json.dumps({**RECOVERY, "latency": "x"}).encode(),
    "a phase that is text": json.dumps({**RECOVERY, "phases": {"detect": "x"}}).encode(),
    "a latency of a year": json.dumps({**RECOVERY, "latency": 3e7}).encode(),
    "no event": json.dumps({k: v for k, v in GOOD.items() if k != "event"}).encode(),
    "no time": json.dumps({k: v for k, v in GOOD.items() if k != "time"}).encode(),
    "no field it has": json.dumps({k: v for k, v in GOOD.items() if k != "members"}).encode(),
    "an unknown event": json.dumps({**GOOD, "event": "surprise"}).encode(),
    "an unhashable event": json.dumps({**GOOD, "event": [1]}).encode(),
    "a newer schema": json.dumps({**GOOD, "v": 2}).encode(),
    "year 31 billion": json.dumps({**GOOD, "time": 1e18}).encode(),
    "before 1970": json.dumps({**GOOD, "time": -1.0}).encode(),
    "a NaN time": json.dumps({**GOOD, "time": float("nan")}).encode(),
    "an infinite time": json.dumps({**GOOD, "time": float("inf")}).encode(),
    "a time of 1e999": json.dumps(GOOD).encode().replace(b"1700000001.0", b"1e999"),
    "a NaN anywhere": json.dumps({**GOOD, "reason": float("nan")}).encode(),
    "an integer of 5,000 digits": json.dumps(GOOD).encode().replace(b'"gen": 1', b'"gen": ' + b"9" * 5000),
    "a huge generation": json.dumps({**GOOD, "gen": 2**64}).encode(),
    "a bool for a number": json.dumps({**GOOD, "world_size": True}).encode(),
    "a member twice": json.dumps({**GOOD, "members": [0, 0]}).encode(),
    "a last step that is text, on any event": json.dumps({**GOOD, "last_step": "x"}).encode(),
    "a lone surrogate": json.dumps({**GOOD, "reason": "\ud800"}).encode(),
}


def test_a_log_as_the_agent_writes_it_reads_whole(tmp_path):
    written = write_run(tmp_path / "events.jsonl")
    assert all(event_problem(record) is None for record in [*written, GOOD, RECOVERY])
    assert skipped(tmp_path / "events.jsonl") == (written, {"count": 0, "last": None})
    assert read_events(tmp_path / "none.jsonl") == []  # no log (yet): no event


@pytest.mark.parametrize("bad", BAD_LINES.values(), ids=BAD_LINES.keys())
def test_a_line_that_is_no_event_is_skipped_and_counted(tmp_path, bad):
    path = tmp_path / "events.jsonl"
    written = write_run(path)
    lines = path.read_bytes().splitlines(keepends=True)
    path.write_bytes(b"".join(lines[:3]) + bad + b"\n\n" + b"".join(lines[3:]))  # and a blank line: uncounted
    found, skips = skipped(path)
    assert found == written and skips["count"] == 1 and skips["last"].startswith("line 4: "), skips


def test_the_reasons_say_what_is_wrong_and_a_line_cut_short_at_the_end_is_skipped(tmp_path):
    path = tmp_path / "events.jsonl"
    written = write_run(path)
    assert event_problem(json.loads(BAD_LINES["not an object"])) == "not a JSON object but list"
    assert event_problem(json.loads(BAD_LINES["no field it has"])) == "generation: no field 'members'"
    assert event_problem(json.loads(BAD_LINES["nulls"])) == "generation: field 'gen' has a wrong type or value"
    assert event_problem(json.loads(BAD_LINES["an unknown event"])) == "unknown event 'surprise'"
    assert event_problem(json.loads(BAD_LINES["no event"])) == "no field 'event'"
    with open(path, "ab") as log:
        log.write(b'{"v": 1, "time": 17000')  # the agent was killed as it wrote
    found, skips = skipped(path)
    assert found == written and skips == {"count": 1, "last": f"line {len(written) + 1}: not JSON, cut short or "
                                                                "corrupted"}
    path.write_bytes(path.read_bytes()[:-len(b'{"v": 1, "time": 17000')] + json.dumps(GOOD).encode())
    assert skipped(path) == ([*written, GOOD], {"count": 0, "last": None})  # a whole last line, with no newline


def test_a_line_without_end_is_skipped_without_being_held_whole(tmp_path):
    path = tmp_path / "events.jsonl"
    written = write_run(path)
    lines = path.read_bytes().splitlines(keepends=True)
    with open(path, "wb") as log:
        log.write(lines[0])
        log.truncate(16 * MAX_LINE)  # a sparse hole of 64 MiB: one line of NUL bytes
        log.seek(0, os.SEEK_END)
        log.write(b"\n" + b"".join(lines[1:]))
    tracemalloc.start()
    try:
        found, skips = skipped(path)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert found == written and skips == {"count": 1, "last": f"line 2: longer than {MAX_LINE:,} bytes"}
    assert peak < 3 * MAX_LINE, peak


def test_a_long_valid_log_is_read_whole(tmp_path):
    path = tmp_path / "events.jsonl"
    log = EventLog(path)
    for step in range(20_000):
        log.write(events.PROGRESS, step=step, steps_per_s=1.5, world_size=64, gen=0)
    log.close()
    found, skips = skipped(path)
    assert [e["step"] for e in found] == list(range(20_000)) and skips["count"] == 0


def test_times_are_those_a_clock_can_show():
    assert event_problem({**GOOD, "time": 0}) is None and event_problem({**GOOD, "time": MAX_TIME}) is None
    assert event_problem({**GOOD, "time": MAX_TIME + 1}) == "generation: field 'time' has a wrong type or value"


def test_a_log_that_is_no_regular_file_is_refused_not_waited_on(tmp_path):
    (tmp_path / "dir").mkdir()
    os.mkfifo(tmp_path / "fifo")
    (tmp_path / "zero").symlink_to("/dev/zero")
    for name in ("dir", "fifo", "zero"):
        with pytest.raises(Unreadable, match="^not a regular file$"):
            read_events(tmp_path / name)
