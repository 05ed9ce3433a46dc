"""`ftrun status`: find the job(s), build their documents, print them (table, --json, or --watch)."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

from rich.console import Console
from rich.live import Live

from ftrun.errors import UsageError
from ftrun.status.document import exit_code
from ftrun.status.render import render_all
from ftrun.status.sources import Target, find_targets

WATCH_INTERVAL = 1.0
"""Seconds between two refreshes of --watch (the agents publish about once a second)."""
PIPE_WIDTH = 160
"""Columns of the table when the output is not a terminal."""


def status(endpoint: str | None, run_id: str | None, log_dir: Path | None, as_json: bool, watch: bool,
           secret_file: str | None = None) -> int:
    """Show the job the flags name; returns the exit code: 0 healthy, 1 degraded, (NoSuchJob: 3)."""
    if as_json and watch:
        raise UsageError("--json and --watch do not go together (run --json again to poll)")
    if endpoint and (run_id or log_dir):
        raise UsageError("--endpoint names the job already; drop --run-id / --log-dir")
    targets = find_targets(endpoint, run_id, log_dir, secret_file)
    docs = [target.document() for target in targets]
    if as_json:
        json.dump({"time": time.time(), "jobs": docs}, sys.stdout, indent=2)
        sys.stdout.write("\n")
        return exit_code(docs)
    console = Console()
    if not console.is_terminal and "COLUMNS" not in os.environ:
        console.width = PIPE_WIDTH  # a file or pipe has room: do not cut the table to 80 columns
    if not watch:
        console.print(render_all(docs))
        return exit_code(docs)
    return _watch(console, targets, docs)


def _watch(console: Console, targets: list[Target], docs: list[dict]) -> int:
    """Refresh the screen in place until Ctrl-C, or until every job shown has ended."""
    with Live(render_all(docs), console=console, auto_refresh=False) as live:
        try:
            while any(doc["state"] != "ended" for doc in docs):
                time.sleep(WATCH_INTERVAL)
                docs = [target.document() for target in targets]
                live.update(render_all(docs), refresh=True)
        except KeyboardInterrupt:
            pass
    return exit_code(docs)
