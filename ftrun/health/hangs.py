"""Hang detection: how long a rank may go without progress, and which silent rank is the culprit.

Pure functions over plain numbers, so the policy is tested without processes; the agent feeds them the
progress its workers report on their control channels (one message per committed step, one when a step's
first collective starts -- node-local, no store round trip).
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass


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
    warmup_steps: int = 3
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
    """What the agent knows of one rank: when it last said anything, and how far it got."""

    silent_for: float  # seconds since its last progress message
    timeout: float  # its current hang timeout
    entered_step: int  # the last step whose first collective it started
    stopped: bool  # the process is stopped (SIGSTOP, a debugger)


def hung_ranks(activity: Mapping[int, RankActivity]) -> tuple[list[int], bool]:
    """The ranks to treat as hung, and whether the whole group is stuck with no culprit to name.

    A rank past its timeout is the culprit when its process is stopped, or when it never started the
    collective of a step its peers already wait in; the peers blocked in that collective are victims.
    If every rank is past its timeout and none stands out, the group as a whole is stuck.
    """
    silent = {rank: a for rank, a in activity.items() if a.silent_for > a.timeout}
    if not silent:
        return [], False
    furthest = max(a.entered_step for a in activity.values())
    culprits = sorted(r for r, a in silent.items() if a.stopped or a.entered_step < furthest)
    return culprits, not culprits and len(silent) == len(activity)
