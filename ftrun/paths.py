"""What is at a path a user or a script named, asked without raising, and the small files ftrun reads.

``Path.is_file()`` and ``Path.is_dir()`` answer False for a path that does not exist, but up to Python 3.13
they raise for one the system refuses to look up: a name too long (ENAMETOOLONG), a directory that cannot be
searched (EACCES). A path that cannot be looked up holds nothing ftrun could use, so these answer False, as
Python 3.14's do.

A file a flag names (a hostfile, an Xid policy, a secret, a password) is read by :func:`read_small_file`: a FIFO
there would make ``open()`` wait for a writer for ever, and ``/dev/zero`` would be read until memory runs out.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path


class Unreadable(Exception):
    """A file :func:`read_small_file` does not read; the message says why, in a few words."""


def read_small_file(path: str | os.PathLike[str], limit: int, follow: bool = True) -> tuple[bytes, int]:
    """The bytes of the regular file at ``path`` and its mode; Unreadable when it cannot be opened or read, is not
    a regular file (never waited on, never read without end), or holds more than ``limit`` bytes. ``follow``:
    whether a symbolic link there is followed."""
    try:
        fd, info = open_regular(path, follow)
    except (OSError, ValueError) as exc:  # ValueError: a NUL byte in the path
        raise Unreadable(getattr(exc, "strerror", None) or str(exc)) from None
    try:
        chunks, size = [], 0
        while size <= limit:
            chunk = os.read(fd, limit + 1 - size)
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
    except OSError as exc:
        raise Unreadable(exc.strerror or str(exc)) from None
    finally:
        os.close(fd)
    if size > limit:
        raise Unreadable(f"larger than {limit:,} bytes")
    return b"".join(chunks), info.st_mode


def open_regular(path: str | os.PathLike[str], follow: bool = True) -> tuple[int, os.stat_result]:
    """A descriptor of the regular file at ``path``, open to read, and its status; Unreadable when something
    else is there (a FIFO is opened without waiting for a writer, and a device is never read); OSError when it
    cannot be opened (a symbolic link, where ``follow`` is False: ELOOP)."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | (0 if follow else os.O_NOFOLLOW))
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise Unreadable("not a regular file")
    except BaseException:
        os.close(fd)
        raise
    return fd, info


def is_file(path: Path) -> bool:
    """Whether ``path`` is a regular file (or a link to one); False where it cannot be looked up."""
    try:
        return path.is_file()
    except OSError:
        return False


def is_dir(path: Path) -> bool:
    """Whether ``path`` is a directory (or a link to one); False where it cannot be looked up."""
    try:
        return path.is_dir()
    except OSError:
        return False
