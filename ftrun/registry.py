"""The run registry: one small JSON file per running job on this machine, so `ftrun status` and
`ftrun inject` find a job without being told its endpoint."""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

import psutil


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

    @property
    def endpoint(self) -> str:
        """HOST:PORT of the job's store."""
        return f"{self.host}:{self.port}"


def default_runs_root() -> Path:
    """Where runs without --log-dir keep their event logs and error files: ``<cache>/ftrun/runs``."""
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    root = Path(cache) / "ftrun" / "runs"
    try:
        root.mkdir(parents=True, exist_ok=True)
        return root
    except OSError:
        return Path(tempfile.mkdtemp(prefix="ftrun_"))


def registry_dir() -> Path:
    """``$XDG_RUNTIME_DIR/ftrun/runs`` when there is one, else ``<cache>/ftrun/registry``."""
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    if runtime and os.path.isdir(runtime):
        return Path(runtime) / "ftrun" / "runs"
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(cache) / "ftrun" / "registry"


def register(entry: RunEntry) -> Path:
    """Record ``entry`` (atomically); returns the file to pass to :func:`unregister`."""
    folder = registry_dir()
    folder.mkdir(parents=True, exist_ok=True)
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
    for path in sorted(folder.glob("*.json")) if folder.is_dir() else []:
        try:
            entry = RunEntry(**json.loads(path.read_text(encoding="utf-8")))
        except (OSError, ValueError, TypeError):
            continue
        if _alive(entry):
            entries.append(entry)
        else:
            unregister(path)
    return sorted(entries, key=lambda e: e.started)


def find(run_id: str) -> list[RunEntry]:
    """Running jobs whose run id is ``run_id``, or whose --rdzv-id is (several launches may share one)."""
    return [e for e in running() if run_id in (e.run_id, e.rdzv_id)]


def new_entry(run_id: str, rdzv_id: str, host: str, port: int, run_dir: Path) -> RunEntry:
    """The entry for the launch running in this process."""
    return RunEntry(run_id=run_id, rdzv_id=rdzv_id, host=host, port=port, pid=os.getpid(), run_dir=str(run_dir),
                    started=psutil.Process().create_time())
