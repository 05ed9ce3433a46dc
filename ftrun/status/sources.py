"""Where `ftrun status` reads a job from: the store of a running job, or the event log of one that ended."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ftrun import registry
from ftrun.errors import NoSuchJob, UsageError
from ftrun.event_log import EventReader, read_events
from ftrun.paths import Unreadable, is_dir, is_file
from ftrun.status.document import ended_document, live_document
from ftrun.store.client import STORE_START_WAIT, check_endpoint, connect_job
from ftrun.store.job import JobStore, MalformedValue

FIRST_RECORD_WAIT = 5.0
"""Seconds to wait for a job's first status record (it is written within a second of the start)."""


@dataclass
class Target:
    """One job to show: its store endpoint (and the run's secret) while it runs, its run directory where it is
    known here."""

    endpoint: str | None
    run_dir: Path | None
    registered: bool = False  # found in this machine's registry: its store may not be served yet
    secret: str | None = field(default=None, repr=False)  # None: from secret_file (or FTRUN_SECRET_FILE)
    secret_file: str | None = None
    store: JobStore | None = field(default=None, repr=False)  # the connection, kept between --watch refreshes

    def document(self) -> dict[str, Any]:
        """The job's status document: live from its store, else (it ended) from its event log."""
        if self.endpoint is not None:
            try:
                return self._live()
            except NoSuchJob:
                if self.run_dir is None or not is_file(self.run_dir / "events.jsonl"):
                    raise
                self.endpoint = None  # it ended: from now on, its event log
        events, reader = read_run_log(self.run_dir)
        return ended_document(events, self.run_dir, reader.skipped_lines())

    def _live(self) -> dict[str, Any]:
        first = self.store is None
        if first:
            self.store = connect_job(self.endpoint, self.secret, self.secret_file,
                                     STORE_START_WAIT if self.registered else None)
        try:
            job = self.store.read_job_status(FIRST_RECORD_WAIT if first else 0.0)
            if job is None:
                raise NoSuchJob(f"no ftrun status record at {self.endpoint} within {FIRST_RECORD_WAIT:.0f} s "
                                f"(not an ftrun job's store, or an ftrun without `status`)")
            nodes = [record for record in map(self._node, range(job["nnodes"])) if record is not None]
        except RuntimeError as exc:  # the store went away: the job ended
            raise NoSuchJob(f"the job at {self.endpoint} is gone ({str(exc).splitlines()[0]})") from None
        except MalformedValue:
            raise UsageError(f"the job at {self.endpoint} does not sign its status with this secret: give its own "
                             "(--secret-file)") from None
        return live_document(job, nodes, self.endpoint, time.time())

    def _node(self, node_rank: int) -> dict[str, Any] | None:
        """A node's published record; None before its first, or while what is there is not its agent's (the
        next record replaces it within a second)."""
        try:
            return self.store.read_node_status(node_rank)
        except MalformedValue:
            return None


def read_run_log(run_dir: Path) -> tuple[list[dict[str, Any]], EventReader]:
    """The events of a run directory's event log, and the reader that counted the lines that are none;
    UsageError, in one line, when the log is not a regular file or cannot be read."""
    reader = EventReader()
    try:
        return read_events(run_dir / "events.jsonl", reader), reader
    except Unreadable as exc:
        raise UsageError(f"{run_dir / 'events.jsonl'}: {exc}") from None


def find_targets(endpoint: str | None, run_id: str | None, log_dir: Path | None,
                 secret_file: str | None = None) -> list[Target]:
    """The one job the flags name: --endpoint (with its secret), --run-id (running here, else its run
    directory), --log-dir, or the only job running on this machine. Raises NoSuchJob, with what was looked
    at, when there is none, and UsageError, listing them, when several jobs running here would match."""
    if endpoint:
        check_endpoint(endpoint)
        return [Target(endpoint, None, secret_file=secret_file)]
    if secret_file:
        raise UsageError("--secret-file goes with --endpoint: a job running here is found with its secret")
    if log_dir is None:
        try:
            entry = registry.only_running(run_id, "name one with --endpoint HOST:PORT, or a past one with --run-id "
                                                  "ID or --log-dir DIR")
            return [Target(entry.endpoint, Path(entry.run_dir), registered=True, secret=entry.secret)]
        except NoSuchJob:
            if run_id is None:
                raise
    root = log_dir or registry.default_runs_root()
    if not is_dir(root):
        raise NoSuchJob(f"--log-dir {root}: no such directory")
    found = run_dirs(root, run_id)
    if not found and run_id:
        raise NoSuchJob(f"no job with run id {run_id!r}: none is running here and {root} holds no such run")
    if not found:
        raise NoSuchJob(f"{root} holds no run (no events.jsonl in it or in its folders)")
    newest = found[-1]
    entry = next((e for e in registry.running() if Path(e.run_dir) == newest), None)
    return [Target(entry.endpoint, newest, registered=True, secret=entry.secret) if entry else Target(None, newest)]


def run_dirs(root: Path, run_id: str | None) -> list[Path]:
    """Run directories (holding an events.jsonl) at or under ``root`` whose name is, or starts with,
    ``run_id`` (any when None), oldest first; NoSuchJob when ``root`` cannot be listed."""
    if is_file(root / "events.jsonl") and (run_id is None or root.name.startswith(run_id)):
        return [root]
    try:
        entries = list(root.iterdir())
    except OSError as exc:
        raise NoSuchJob(f"{root}: cannot list it ({exc.strerror})") from None
    found = [d for d in entries if is_file(d / "events.jsonl")
             and (run_id is None or d.name == run_id or d.name.startswith(f"{run_id}_"))]
    return sorted(found, key=lambda d: (d / "events.jsonl").stat().st_mtime)

