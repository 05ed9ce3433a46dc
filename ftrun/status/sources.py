"""Where `ftrun status` reads a job from: the store of a running job, or the event log of one that ended."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ftrun import registry
from ftrun.errors import NoSuchJob
from ftrun.events import read_events
from ftrun.status.document import ended_document, live_document
from ftrun.store.client import STORE_START_WAIT, connect
from ftrun.store.job import JobStore, MalformedValue

FIRST_RECORD_WAIT = 5.0
"""Seconds to wait for a job's first status record (it is written within a second of the start)."""


@dataclass
class Target:
    """One job to show: its store endpoint while it runs, its run directory where it is known here."""

    endpoint: str | None
    run_dir: Path | None
    registered: bool = False  # found in this machine's registry: its store may not be served yet
    store: JobStore | None = field(default=None, repr=False)  # the connection, kept between --watch refreshes

    def document(self) -> dict[str, Any]:
        """The job's status document: live from its store, else (it ended) from its event log."""
        if self.endpoint is not None:
            try:
                return self._live()
            except NoSuchJob:
                if self.run_dir is None or not (self.run_dir / "events.jsonl").is_file():
                    raise
                self.endpoint = None  # it ended: from now on, its event log
        return ended_document(read_events(self.run_dir / "events.jsonl"), self.run_dir)

    def _live(self) -> dict[str, Any]:
        first = self.store is None
        if first:
            self.store = JobStore(connect(self.endpoint, connect_timeout=STORE_START_WAIT if self.registered else None))
        try:
            job = self.store.read_job_status(FIRST_RECORD_WAIT if first else 0.0)
            if job is None:
                raise NoSuchJob(f"no ftrun status record at {self.endpoint} within {FIRST_RECORD_WAIT:.0f} s "
                                f"(not an ftrun job's store, or an ftrun without `status`)")
            records = (self.store.read_node_status(n) for n in range(job["nnodes"]))
            nodes = [record for record in records if record is not None]  # the published ones
        except RuntimeError as exc:  # the store went away: the job ended
            raise NoSuchJob(f"the job at {self.endpoint} is gone ({str(exc).splitlines()[0]})") from None
        except MalformedValue as exc:
            raise NoSuchJob(f"the status records at {self.endpoint} are unreadable ({exc})") from None
        return live_document(job, nodes, self.endpoint, time.time())


def find_targets(endpoint: str | None, run_id: str | None, log_dir: Path | None) -> list[Target]:
    """The jobs the flags name: --endpoint, --run-id (running here, else its run directory), --log-dir, or every
    job running on this machine. Raises NoSuchJob, with what was looked at, when there is none."""
    if endpoint:
        return [Target(endpoint, None)]
    running = registry.running()
    if run_id is None and log_dir is None:
        if not running:
            raise NoSuchJob("no ftrun job is running on this machine (name one with --endpoint HOST:PORT, "
                            "or a past one with --run-id ID or --log-dir DIR)")
        return [Target(e.endpoint, Path(e.run_dir), registered=True) for e in running]
    live = [e for e in running if run_id in (e.run_id, e.rdzv_id)] if log_dir is None else []
    if live:
        return [Target(e.endpoint, Path(e.run_dir), registered=True) for e in live]
    root = log_dir or registry.default_runs_root()
    if not root.is_dir():
        raise NoSuchJob(f"--log-dir {root}: no such directory")
    found = run_dirs(root, run_id)
    if not found and run_id:
        raise NoSuchJob(f"no job with run id {run_id!r}: none is running here and {root} holds no such run")
    if not found:
        raise NoSuchJob(f"{root} holds no run (no events.jsonl in it or in its folders)")
    newest = found[-1]
    entry = next((e for e in running if Path(e.run_dir) == newest), None)
    return [Target(entry.endpoint if entry else None, newest, registered=entry is not None)]


def run_dirs(root: Path, run_id: str | None) -> list[Path]:
    """Run directories (holding an events.jsonl) at or under ``root`` whose name is, or starts with,
    ``run_id`` (any when None), oldest first."""
    if (root / "events.jsonl").is_file() and (run_id is None or root.name.startswith(run_id)):
        return [root]
    found = [d for d in root.iterdir() if (d / "events.jsonl").is_file()
             and (run_id is None or d.name == run_id or d.name.startswith(f"{run_id}_"))]
    return sorted(found, key=lambda d: (d / "events.jsonl").stat().st_mtime)

