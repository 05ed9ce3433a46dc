"""`ftrun report`: find the run, read its event log and its workers' printed losses, write the picture."""

from __future__ import annotations

import re
import sys
from collections.abc import Iterator
from pathlib import Path

from ftrun import registry
from ftrun.errors import NoSuchJob, UsageError
from ftrun.event_log import BoundedLines, read_chunks, skipped_words
from ftrun.paths import Unreadable, is_dir
from ftrun.report.svg import render_svg
from ftrun.report.timeline import build_timeline, parse_losses
from ftrun.status.sources import read_run_log, run_dirs

WORKER_LOG_TAIL = 64 << 20
"""The bytes read of each worker's stdout.log, from its end: the losses of its last steps."""
MAX_LOG_LINE = 64 << 10
"""The longest line of a worker's log searched for a loss, in bytes; a longer one is passed over."""
_ATTEMPT = re.compile(r"attempt_(\d{1,9})")
"""The folder of one attempt's worker logs."""


def find_run(run: str | None, log_dir: Path | None) -> Path:
    """The run directory RUN names: a run directory, a directory of runs (its newest), or a run id (under
    ``log_dir`` or the default runs folder; the newest with that id). NoSuchJob when there is none."""
    if run is not None and ("/" in run or is_dir(Path(run))):  # run ids have no slash
        root, run_id = Path(run), None
    else:
        root, run_id = log_dir or registry.default_runs_root(), run
    if not is_dir(root):
        raise NoSuchJob(f"{root}: no such directory")
    found = run_dirs(root, run_id)
    if not found:
        what = f"no run with id {run_id!r} in {root}" if run_id else f"{root} holds no run"
        raise NoSuchJob(f"{what} (no events.jsonl there or in its folders)")
    return found[-1]


def read_losses(run_dir: Path) -> list[tuple[int, float]]:
    """The losses the workers printed, from their stdout logs (written with --log-dir), by step; a later
    attempt's value replaces an earlier one's for a step it ran again. Only the last WORKER_LOG_TAIL bytes of
    each log are read; a folder not named ``attempt_<number>``, and a log that is not a regular file (a FIFO,
    a directory, a symbolic link) or cannot be read, are passed over."""
    losses: dict[int, float] = {}
    for attempt in _attempts(run_dir):
        for log in sorted(attempt.glob("*/stdout.log")):
            losses.update(parse_losses(_log_lines(log)))
    return sorted(losses.items())


def _attempts(run_dir: Path) -> list[Path]:
    """The attempt folders of a run directory, in the order they ran."""
    numbered = [(int(match[1]), path) for path in run_dir.glob("attempt_*") if (match := _ATTEMPT.fullmatch(path.name))]
    return [path for _, path in sorted(numbered)]


def _log_lines(log: Path) -> Iterator[str]:
    """The lines of the last WORKER_LOG_TAIL bytes of a worker's log, as text, but those longer than
    MAX_LOG_LINE; none when it is not a regular file or cannot be read."""
    lines = BoundedLines(MAX_LOG_LINE)
    try:
        for chunk in read_chunks(log, last=WORKER_LOG_TAIL, follow=False):
            yield from (line.decode(errors="replace") for line in lines.feed(chunk) if line is not None)
    except Unreadable:
        return
    rest = lines.rest()
    if rest:
        yield rest.decode(errors="replace")


def report(run: str | None, log_dir: Path | None, output: Path | None) -> Path:
    """Draw the run's timeline into ``output`` (default: report.svg in its run directory); the file written.
    The lines of the event log that are no event are skipped, and said so in one line on stderr."""
    run_dir = find_run(run, log_dir)
    events, reader = read_run_log(run_dir)
    log = run_dir / "events.jsonl"
    if not events and reader.skipped:
        raise UsageError(f"{log} holds no event: {skipped_words(reader.skipped_lines())}")
    if not events:
        raise NoSuchJob(f"{log} is empty: the run recorded nothing yet")
    if reader.skipped:
        print(f"ftrun: {log}: {skipped_words(reader.skipped_lines())}", file=sys.stderr)
    svg = render_svg(build_timeline(events, read_losses(run_dir), run_dir.name))
    target = output or run_dir / "report.svg"
    try:
        target.write_text(svg, encoding="utf-8")
    except OSError as exc:
        raise UsageError(f"cannot write {target}: {exc.strerror}; choose another file with -o FILE") from None
    return target
