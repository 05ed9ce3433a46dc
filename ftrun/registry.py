"""The run registry: one small JSON file per running job of this user on this machine, so `ftrun status` and
`ftrun inject` find a job (its endpoint and its secret) without being told.

The registry's directory and every run directory are created for this user alone (0700), and each entry
is a 0600 file: an entry holds the run's secret, which lets its holder command the job.
"""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path

import psutil

from ftrun.errors import NoSuchJob, UsageError
from ftrun.paths import is_dir


@dataclass(frozen=True)
class RunEntry:
    """A job launched from this machine: where its store listens and where its run directory is."""

    run_id: str  # the run directory's name: <rdzv id>_<8 hex>, unique per launch
    rdzv_id: str  # --rdzv-id / --run-id as given (often "none")
    host: str  # the store's host, as reachable from this machine
    port: int
    pid: int  # the launching ftrun process
    run_dir: str
    started: float
    secret: str = field(repr=False)  # the run's secret: signs what its clients write to its store
    store_url: str | None = None  # an etcd job's store (etcd://...): ftrun's own keys are there

    @property
    def endpoint(self) -> str:
        """Where the job's records are: HOST:PORT of its TCPStore, or its etcd URL."""
        return self.store_url or f"{self.host}:{self.port}"


def xdg_dir(variable: str) -> str | None:
    """The XDG base directory ``variable`` names (XDG_CACHE_HOME, XDG_RUNTIME_DIR), or None when it is unset,
    empty or relative: the XDG specification has a relative path ignored (it would put ftrun's files under
    whatever directory a command happens to run in)."""
    value = os.environ.get(variable, "")
    return value if os.path.isabs(value) else None


def cache_home() -> Path:
    """``$XDG_CACHE_HOME``, else ``~/.cache``."""
    return Path(xdg_dir("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"))


def default_runs_root() -> Path:
    """Where runs without --log-dir keep their event logs and error files: ``<cache>/ftrun/runs``."""
    root = cache_home() / "ftrun" / "runs"
    try:
        root.mkdir(parents=True, exist_ok=True)
        return root
    except OSError:
        return Path(tempfile.mkdtemp(prefix="ftrun_"))


def private_dir(path: Path) -> Path:
    """``path``, created if needed as a directory only this user can enter (0700; its parents as usual)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        path.mkdir(mode=0o700)
    except FileExistsError:
        pass
    return path


def registry_dir() -> Path:
    """``$XDG_RUNTIME_DIR/ftrun/runs`` when there is one, else ``<cache>/ftrun/registry``."""
    runtime = xdg_dir("XDG_RUNTIME_DIR")
    if runtime and os.path.isdir(runtime):
        return Path(runtime) / "ftrun" / "runs"
    return cache_home() / "ftrun" / "registry"


def register(entry: RunEntry) -> Path:
    """Record ``entry`` (atomically); returns the file to pass to :func:`unregister`."""
    folder = private_dir(registry_dir())
    path = folder / f"{entry.run_id}.json"
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=".", suffix=".tmp")
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        json.dump(asdict(entry), f)
    os.replace(tmp, path)
    return path


def unregister(path: Path) -> None:
    """Remove a job's entry when it ends."""
    try:
        path.unlink()
    except FileNotFoundError:
        pass


def _alive(entry: RunEntry) -> bool:
    try:
        return psutil.Process(entry.pid).create_time() <= entry.started + 1
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return False


def running() -> list[RunEntry]:
    """Jobs registered on this machine whose launcher is still alive, oldest first; stale entries are removed."""
    folder = registry_dir()
    entries = []
    for path in sorted(folder.glob("*.json")) if is_dir(folder) else []:
        try:
            if path.stat().st_uid != os.getuid():
                continue  # not written by this user: not to be trusted with a secret
            entry = RunEntry(**json.loads(path.read_text(encoding="utf-8")))
        except (OSError, ValueError, TypeError, RecursionError):
            continue
        if _alive(entry):
            entries.append(entry)
        else:
            unregister(path)
    return sorted(entries, key=lambda e: e.started)


def find(run_id: str) -> list[RunEntry]:
    """Running jobs whose run id is ``run_id``, or whose --rdzv-id is (several launches may share one)."""
    return [e for e in running() if run_id in (e.run_id, e.rdzv_id)]


def new_entry(run_id: str, rdzv_id: str, host: str, port: int, run_dir: Path, secret: str,
              store_url: str | None = None) -> RunEntry:
    """The entry for the launch running in this process."""
    return RunEntry(run_id=run_id, rdzv_id=rdzv_id, host=host, port=port, pid=os.getpid(), run_dir=str(run_dir),
                    started=psutil.Process().create_time(), secret=secret, store_url=store_url)


def only_running(run_id: str | None, elsewhere: str) -> RunEntry:
    """The one job of this user running here named ``run_id`` (its run id or --rdzv-id), or the only one.

    NoSuchJob (its message ending with ``elsewhere``, how to name a job not found here) when there is none;
    UsageError listing them when there are several, so that a command meant for one job never reaches another.
    """
    jobs = find(run_id) if run_id else running()
    if not jobs:
        where = f"with run id {run_id!r}" if run_id else "on this machine"
        raise NoSuchJob(f"no ftrun job is running {where} ({elsewhere})")
    if len(jobs) > 1:
        listed = "; ".join(f"{job.run_id} (rdzv id {job.rdzv_id}, pid {job.pid})" for job in jobs)
        raise UsageError(f"{len(jobs)} ftrun jobs are running: {listed}: name one with --run-id RUN_ID")
    return jobs[0]
