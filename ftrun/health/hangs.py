"""Hang detection: how long a rank may go without progress, and which silent rank is the culprit.

Pure functions over plain numbers, so the policy is tested without processes; the agent feeds them the
progress its workers report on their control channels (committed steps, told now and then; a step's first
collective that is still waiting 0.2 s later -- node-local, no store round trip).
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from ftrun.protocol import PROGRESS_FIRST


@dataclass(frozen=True)
class HangPolicy:
    """Bounds of the adaptive hang timeout, in seconds.

    The timeout is ``multiplier`` times the median of recent step times, kept within ``[floor,
    ceiling]``; until ``warmup_steps`` steps have committed (imports, compilation, the first
    collectives) it is ``warmup``. ``fixed`` (``--hang-timeout``) replaces the adaptive value after warmup.
    """

    multiplier: float = 10.0
    floor: float = 30.0
    ceiling: float = 1800.0
    warmup: float = 600.0
    warmup_steps: int = PROGRESS_FIRST  # workers tell each of these commits
    fixed: float | None = None

    def __post_init__(self) -> None:
        if not 0 < self.floor <= self.ceiling:
            raise ValueError("hang timeout: need 0 < floor <= ceiling")
        if self.fixed is not None and self.fixed <= 0:
            raise ValueError("--hang-timeout must be a positive number of seconds")


def hang_timeout(policy: HangPolicy, recent_step_times: Sequence[float], steps_committed: int) -> float:
    """Seconds a rank may stay silent before it is declared hung."""
    if steps_committed < policy.warmup_steps or not recent_step_times:
        return max(policy.warmup, policy.fixed or 0.0)
    if policy.fixed is not None:
        return policy.fixed
    return min(policy.ceiling, max(policy.floor, policy.multiplier * statistics.median(recent_step_times)))


@dataclass(frozen=True)
class RankActivity:
    """What the agent knows of one rank: how long it has been silent, and where it went quiet."""

    silent_for: float  # seconds since its last progress message
    timeout: float  # its current hang timeout
    in_collective: bool  # it started the collectives of a step it has not committed: it waits on peers
    stopped: bool  # the process is stopped (SIGSTOP, a debugger); only read for a rank past its timeout


def hung_ranks(activity: Mapping[int, RankActivity]) -> tuple[list[int], bool]:
    """The ranks to treat as hung, and whether the whole group is stuck with no culprit to name.

    A rank past its timeout is a culprit when its process is stopped, or when it went quiet outside any
    collective (a hang in its own code): the peers blocked in a collective waiting for it are victims.
    A stopped process explains its peers' silence, wherever they wait (some collectives, such as DDP's
    bucket rebuild in a forward pass, are not reported): while one is stopped, only stopped ranks are
    culprits. If every rank is past its timeout and each waits in a collective, the group is stuck.
    """
    silent = {rank: a for rank, a in activity.items() if a.silent_for > a.timeout}
    stopped = sorted(rank for rank, a in silent.items() if a.stopped)
    culprits = stopped or sorted(rank for rank, a in silent.items() if not a.in_collective)
    return culprits, bool(silent) and not culprits and len(silent) == len(activity)
