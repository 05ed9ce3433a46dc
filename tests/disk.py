"""A tiny disk for full-disk tests: a tmpfs of a few pages, mounted with mount(2) (root), filled to the brim.

No process is started: mount(2) and umount2(2) are called through libc, so tests that use it can be fast.
"""

from __future__ import annotations

import ctypes
import errno
import os
from pathlib import Path

_libc = ctypes.CDLL(None, use_errno=True)
_MNT_DETACH = 2
FILLER = ".filler"


class TinyDisk:
    """A tmpfs mounted at ``path``; :meth:`fill` leaves no byte free, :meth:`free` gives it all back."""

    def __init__(self, path: Path) -> None:
        self.path = path

    @classmethod
    def mount(cls, path: Path, size: int) -> TinyDisk:
        """Mount a tmpfs of ``size`` bytes at ``path`` (made if missing); OSError with the kernel's reason."""
        path.mkdir(parents=True, exist_ok=True)
        if _libc.mount(b"tmpfs", os.fsencode(path), b"tmpfs", 0, f"size={size}".encode()) != 0:
            code = ctypes.get_errno()
            raise OSError(code, f"mount -t tmpfs -o size={size} {path}: {os.strerror(code)}")
        return cls(path)

    def fill(self, leave: int = 0) -> None:
        """Write a filler file until the disk is full, then give back ``leave`` bytes (whole pages)."""
        with open(self.path / FILLER, "ab", buffering=0) as f:
            chunk = b"\0" * 4096
            try:
                while True:
                    f.write(chunk)
            except OSError as exc:
                if exc.errno != errno.ENOSPC:
                    raise
            if leave:
                f.truncate(max(0, f.tell() - leave))

    def free(self) -> None:
        """Remove the filler: the disk has room again."""
        (self.path / FILLER).unlink(missing_ok=True)

    def unmount(self) -> None:
        """Unmount (lazily: a file still open there does not keep it mounted)."""
        _libc.umount2(os.fsencode(self.path), _MNT_DETACH)
