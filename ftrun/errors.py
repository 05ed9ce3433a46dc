"""Errors that ftrun reports to the user as one line instead of a traceback."""

from __future__ import annotations

EXIT_OK = 0
"""Every worker finished with exit code 0."""
EXIT_WORKERS_FAILED = 1
"""A worker failed and no restart or recovery was left."""
EXIT_USAGE = 2
"""Bad input: a flag, a file, a port; nothing was started."""
EXIT_NO_JOB = 3
"""`ftrun status`: no such job (nothing running, endpoint unreachable, unknown run id)."""
EXIT_SIGNAL_BASE = 128
"""ftrun itself was stopped by signal N: it exits with 128 + N after stopping its workers."""


class UsageError(Exception):
    """Bad input from the user: printed as one line on stderr, exit code 2.

    The message says what is wrong and how to fix it.
    """

    exit_code = EXIT_USAGE


class NoSuchJob(UsageError):
    """The job asked about is not there (not running, unreachable, unknown run id): one line, exit code 3."""

    exit_code = EXIT_NO_JOB


def quoted(text: str, limit: int = 60) -> str:
    """``text`` as an error line quotes it: its first ``limit`` characters, and "..." where there are more."""
    return repr(text[:limit]) + ("..." if len(text) > limit else "")
