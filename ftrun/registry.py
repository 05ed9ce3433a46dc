"""The run registry: one small JSON file per running job of this user on this machine, so `ftrun status` and
`ftrun inject` find a job (its endpoint and its secret) without being told.

The registry's directory and every run directory are created for this user alone (0700), and each entry
is a 0600 file: an entry holds the run's secret, which lets its holder command the job.
"""

from __future__ import annotations

import json
import math
import os
import tempfile
from collections.abc import Callable
from dataclasses import MISSING, asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

import psutil

from ftrun.errors import NoSuchJob, UsageError
from ftrun.paths import Unreadable, is_dir, read_small_file
from ftrun.protocol import MAX_HOST_NAME


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


ENTRY_LIMIT = 64 << 10
"""Bytes a registry entry may hold: ftrun writes a few hundred; a bigger file is not one of its entries."""
MAX_PID = 2**31 - 1
"""The largest process id a system gives (a C pid_t); a larger one in an entry is not a process."""
MAX_TEXT = 4096
"""Characters a text field of an entry may hold: the longest path Linux takes."""


def _text(value: Any) -> bool:
    """A string a name or a path can be: at most MAX_TEXT characters, none NUL, and each one a path can hold
    (undecodable bytes come as surrogate escapes; a lone surrogate of another kind cannot be written out)."""
    if not isinstance(value, str) or len(value) > MAX_TEXT:
        return False
    try:
        return b"\0" not in os.fsencode(value)
    except UnicodeEncodeError:
        return False


def _name(value: Any) -> bool:
    """A non-empty :func:`_text`."""
    return _text(value) and value != ""


def _optional_name(value: Any) -> bool:
    return value is None or _name(value)


def _host(value: Any) -> bool:
    return _name(value) and len(value) <= MAX_HOST_NAME


def _secret(value: Any) -> bool:
    """Printable ASCII, as a secret file holds it and a run's own secret is made."""
    return _name(value) and value.isascii() and value.isprintable()


def _port(value: Any) -> bool:
    return type(value) is int and 0 < value < 65536


def _pid(value: Any) -> bool:
    return type(value) is int and 0 < value <= MAX_PID


def _time(value: Any) -> bool:
    """A time since the epoch: a finite number, not negative (a process's start time)."""
    return type(value) in (int, float) and math.isfinite(value) and value >= 0


_FIELD_CHECKS: dict[str, Callable[[Any], bool]] = {
    "run_id": _name, "rdzv_id": _text, "host": _host, "port": _port, "pid": _pid, "run_dir": _name,
    "started": _time, "secret": _secret, "store_url": _optional_name,
}
"""What each field of an entry must hold: an entry read back is used without more checks."""
_REQUIRED = frozenset(f.name for f in fields(RunEntry) if f.default is MISSING)


def parse_entry(raw: bytes) -> RunEntry | None:
    """The entry a registry file's bytes hold, or None when they are not one: not JSON, not an object with
    RunEntry's fields and no others, or a field of the wrong type or out of its range."""
    try:
        data = json.loads(raw)
    except (ValueError, RecursionError):  # UnicodeDecodeError and too long a number are ValueErrors
        return None
    if not isinstance(data, dict) or not _REQUIRED <= data.keys() <= _FIELD_CHECKS.keys():
        return None
    if not all(_FIELD_CHECKS[name](value) for name, value in data.items()):
        return None
    return RunEntry(**data)


def read_entry(path: Path) -> RunEntry | None:
    """The entry in the registry file at ``path``, or None when it is not one to use: not a regular file this
    user owns (never waited on, as a FIFO would be, nor followed as a link), over ENTRY_LIMIT bytes, or not an
    entry (:func:`parse_entry`)."""
    try:
        if path.lstat().st_uid != os.getuid():
            return None  # not written by this user: not to be trusted with a secret
        raw, _ = read_small_file(path, ENTRY_LIMIT, follow=False)
    except (OSError, Unreadable):
        return None
    return parse_entry(raw)


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
        entry = read_entry(path)
        if entry is None:
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
