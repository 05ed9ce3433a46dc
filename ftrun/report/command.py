"""`ftrun report`: find the run, read its event log and its workers' printed losses, write the picture."""

from __future__ import annotations

from pathlib import Path

from ftrun import registry
from ftrun.errors import NoSuchJob, UsageError
from ftrun.events import read_events
from ftrun.paths import is_dir
from ftrun.report.svg import render_svg
from ftrun.report.timeline import build_timeline, parse_losses
from ftrun.status.sources import run_dirs


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
    attempt's value replaces an earlier one's for a step it ran again."""
    losses: dict[int, float] = {}
    attempts = sorted(run_dir.glob("attempt_*"), key=lambda p: int(p.name.split("_")[1]))
    for attempt in attempts:
        for log in sorted(attempt.glob("*/stdout.log")):
            with open(log, encoding="utf-8", errors="replace") as lines:
                losses.update(parse_losses(lines))
    return sorted(losses.items())


def report(run: str | None, log_dir: Path | None, output: Path | None) -> Path:
    """Draw the run's timeline into ``output`` (default: report.svg in its run directory); the file written."""
    run_dir = find_run(run, log_dir)
    events = read_events(run_dir / "events.jsonl")
    if not events:
        raise NoSuchJob(f"{run_dir}/events.jsonl is empty: the run recorded nothing yet")
    svg = render_svg(build_timeline(events, read_losses(run_dir), run_dir.name))
    target = output or run_dir / "report.svg"
    try:
        target.write_text(svg, encoding="utf-8")
    except OSError as exc:
        raise UsageError(f"cannot write {target}: {exc.strerror}; choose another file with -o FILE") from None
    return target
