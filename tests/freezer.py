"""Processes that will not die: the cgroup v1 freezer holds them in uninterruptible sleep until thawed.

A frozen process shows state D (disk-sleep), as a worker stuck in a GPU driver or on a hung file system
does, and SIGKILL does not end it: the signal waits until the group is thawed. (cgroup v2's freezer lets
SIGKILL through, so it cannot stand in for such a worker.) Needs root and the v1 freezer hierarchy.
"""

from __future__ import annotations

import errno
import os
import time
from pathlib import Path

ROOT = Path("/sys/fs/cgroup/freezer")
SETTLE = 30.0
"""Seconds a freeze or a thaw may take to settle (every task of the group stopped or running)."""


def unsupported() -> str | None:
    """Why no freezer group can be used here, or None when one can."""
    if not (ROOT / "freezer.state").exists() and not (ROOT / "cgroup.procs").exists():
        return f"{ROOT} is not a cgroup v1 freezer hierarchy"
    if not os.access(ROOT, os.W_OK):
        return f"{ROOT} is not writable (not root?)"
    return None


class Freezer:
    """One freezer group: add processes, freeze them, thaw them."""

    def __init__(self, path: Path) -> None:
        self.path = path

    @classmethod
    def create(cls, name: str) -> Freezer:
        """Make the group ``name`` under the freezer hierarchy."""
        path = ROOT / name
        path.mkdir()
        return cls(path)

    def add(self, pid: int) -> None:
        """Move process ``pid`` (all its threads) into the group."""
        (self.path / "cgroup.procs").write_text(str(pid))

    def freeze(self) -> None:
        """Freeze every process of the group; returns once they all are."""
        self._set("FROZEN")

    def thaw(self) -> None:
        """Let the group's processes run again (and act on the signals that waited, SIGKILL first)."""
        self._set("THAWED")

    def pids(self) -> list[int]:
        """The processes in the group."""
        return [int(pid) for pid in (self.path / "cgroup.procs").read_text().split()]

    def delete(self) -> None:
        """Thaw, hand the processes left back to the root group, remove the group."""
        self.thaw()
        for pid in self.pids():
            try:
                (ROOT / "cgroup.procs").write_text(str(pid))
            except OSError:
                pass  # it ended meanwhile
        deadline = time.monotonic() + SETTLE
        while True:  # a task killed as it thawed holds the group (EBUSY) until it has finished exiting
            try:
                self.path.rmdir()
                return
            except OSError as exc:
                if exc.errno != errno.EBUSY or time.monotonic() > deadline:
                    raise
            time.sleep(0.01)

    def _set(self, state: str) -> None:
        (self.path / "freezer.state").write_text(state)
        deadline = time.monotonic() + SETTLE
        while (self.path / "freezer.state").read_text().strip() != state:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.path} did not become {state} within {SETTLE:g} s")
            time.sleep(0.01)  # the kernel settles the group's tasks one by one
