"""A full disk is not a crash: the event log and the worker logs drop what a real (tmpfs) full disk refuses,
say so once, keep every line in the file whole, and record what was lost once there is room again."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from ftrun import events
from ftrun.agent.output import LogFiles, WorkerOutput
from ftrun.console import STDOUT
from ftrun.event_log import read_events
from ftrun.events import EventLog

pytestmark = pytest.mark.fast

SIZE = 64 * 1024


def lines(path) -> list[dict]:
    """Every line of a file, each of which must be a whole JSON record."""
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_the_event_log_drops_what_a_full_disk_refuses_and_records_how_much_once_there_is_room(tiny_disk):
    disk = tiny_disk(SIZE)
    notices, seen = [], []
    log = EventLog(disk.path / "run" / "events.jsonl", notices.append)
    log.listeners.append(seen.append)
    disk.fill()
    for rank in range(3):
        log.write(events.JOINER_READY, uid=rank, pid=100 + rank)  # no exception: dropped
    assert [r["uid"] for r in seen] == [0, 1, 2]  # the live status still sees every event
    assert log.path.read_text() == ""
    assert len(notices) == 1 and notices[0].startswith(f"ftrun: cannot write the event log {log.path} "
                                                       "(No space left on device)")
    disk.free()
    log.write(events.GROUP_FAILURE, reason="after")
    dropped, after = lines(log.path)
    assert (dropped["event"], dropped["count"], dropped["error"], dropped["what"]) == \
        ("writes_dropped", 3, "No space left on device", f"the event log {log.path}")
    assert dropped["since"] <= after["time"] and after["reason"] == "after"

    disk.fill(leave=4096)  # room for a short record, not for a long one: the long one is not left in part
    log.write(events.GROUP_FAILURE, reason="x" * 20_000)
    log.write(events.GROUP_FAILURE, reason="short")  # it fits: what the long one dropped is recorded first
    assert [(e["event"], e.get("reason", e.get("count"))) for e in lines(log.path)[2:]] == \
        [("writes_dropped", 1), ("group_failure", "short")]
    assert len(notices) == 1  # one line for the person, however often the disk fills up again
    log.close()
    assert read_events(log.path)[-1]["reason"] == "short"


def test_worker_logs_on_a_full_disk_drop_their_lines_say_so_once_for_all_workers_and_come_back(tiny_disk):
    disk = tiny_disk(SIZE)
    notices, console_lines = [], []
    console = SimpleNamespace(notice=lambda text, style="": notices.append(text),
                              line=lambda stream, prefix, colour, text, owner=None: console_lines.append(text))
    log = EventLog(disk.path / "run" / "events.jsonl")
    files = LogFiles(console, log, disk.path / "run")
    disk.fill()
    outputs = [WorkerOutput(console, f"[{rank}]:", rank, 3, disk.path / "run" / str(rank), files) for rank in (0, 1)]
    for rank, output in enumerate(outputs):
        output.feed(STDOUT, f"step 1 from {rank}\n".encode())
    assert console_lines == ["step 1 from 0", "step 1 from 1"]  # the console still gets every line
    assert len(notices) == 1 and notices[0].startswith(f"ftrun: cannot write the worker logs under {disk.path / 'run'} ")
    disk.free()
    outputs[0].feed(STDOUT, b"step 2 from 0\n")
    for output in outputs:
        output.close()
    assert (disk.path / "run" / "0" / "stdout.log").read_text() == "step 2 from 0\n"
    assert (disk.path / "run" / "1" / "stdout.log").read_text() == ""
    recorded = [e for e in lines(log.path) if e["event"] == "writes_dropped"]
    assert [(e["what"], e["count"]) for e in recorded] == [(f"the worker logs under {disk.path / 'run'}", 2)]
