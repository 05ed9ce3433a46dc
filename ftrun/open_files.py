"""The open files a launch needs: how many (pure arithmetic on what it starts), and the soft limit raised to
that number where it is lower, within the hard limit.

An agent holds a few files per worker (its output pipes, its pidfd, its channel), and the ``--hostfile``
launcher a few per host (an agent's pipes; over ssh, its stdin too). Past the soft limit (often 1024) a launch
of a few hundred workers or hosts failed halfway with ``OSError: Too many open files``. Raising the soft
limit up to the hard one is what any process may do; the workers inherit it, which costs a program nothing
(one that opens more than the old limit failed before).
"""

from __future__ import annotations

import resource

from ftrun.errors import UsageError

BASE = 128
"""Files a launch holds whatever it starts: the store, the event log, selectors, signal pipes, NVML."""
PER_WORKER = 6
"""Files an agent holds per worker or spare (4 measured while they run: two output pipes, a pidfd, the
channel), with two for the pipe a start opens for a moment."""
PER_HOST = 5
"""Files the ``--hostfile`` launcher holds per host (3 for a remote agent: its stdin, stdout and stderr), with
two for the pipe a start opens for a moment."""


def needed(processes: int, each: int) -> int:
    """Open files a launch that starts ``processes`` children holding ``each`` files apiece needs."""
    return BASE + processes * each


def soft_limit_for(needed_files: int, soft: int, hard: int) -> int | None:
    """The soft limit to set so that ``needed_files`` can be open: None when ``soft`` already allows it.
    Raises :class:`UsageError` when the hard limit does not (``resource.RLIM_INFINITY`` is no limit)."""
    if soft == resource.RLIM_INFINITY or soft >= needed_files:
        return None
    if hard != resource.RLIM_INFINITY and hard < needed_files:
        raise UsageError(f"this launch needs about {needed_files} open files and this machine allows {hard} "
                         "(`ulimit -Hn`): raise the hard limit, or start fewer")
    return needed_files


def allow(processes: int, each: int, what: str) -> None:
    """Raise this process's soft open-file limit for a launch of ``processes`` children of ``each`` files;
    a hard limit too low for it is one line naming ``what`` (UsageError)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    try:
        raised = soft_limit_for(needed(processes, each), soft, hard)
    except UsageError as refused:
        raise UsageError(f"{what}: {refused}") from None
    if raised is not None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (raised, hard))
