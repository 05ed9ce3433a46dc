"""What is at a path a user or a script named, asked without raising.

``Path.is_file()`` and ``Path.is_dir()`` answer False for a path that does not exist, but up to Python 3.13
they raise for one the system refuses to look up: a name too long (ENAMETOOLONG), a directory that cannot be
searched (EACCES). A path that cannot be looked up holds nothing ftrun could use, so these answer False, as
Python 3.14's do.
"""

from __future__ import annotations

from pathlib import Path


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
