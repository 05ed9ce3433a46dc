"""Pure decisions of the recovery protocol: the next generation, and whether to recover in place."""

from __future__ import annotations

from collections.abc import Collection, Sequence

from ftrun.protocol import Plan


def next_plan(current: Plan, lost: Collection[int], ready: Sequence[int], target: int, reason: str) -> Plan:
    """The generation after ``current`` without the ``lost`` workers, topped up from ``ready`` joiners.

    Survivors keep their relative order (so ranks shift down past a lost one); joiners take the last
    ranks, as many as it takes to return to ``target`` workers.
    """
    survivors = [uid for uid in current.members if uid not in lost]
    joiners = list(ready[: max(0, target - len(survivors))])
    return Plan(current.gen + 1, survivors + joiners, reason, lost=sorted(lost), joiners=joiners)


def why_not_in_place(members: Collection[int], adopted_api: Collection[int], survivors: int,
                     available_joiners: int, min_nproc: int) -> str | None:
    """The reason a fault must be handled by a group restart, or None when in-place recovery can go ahead.

    ``survivors`` excludes the lost workers; joiners that are ready count toward ``min_nproc``.
    """
    missing = [uid for uid in members if uid not in adopted_api]
    if missing:
        return ("not every worker had joined through ftrun.init(): the script does not use the worker API, "
                "or was still starting, so it cannot recover in place")
    if survivors == 0:
        return "no worker survived"
    if survivors + available_joiners < min_nproc:
        return f"only {survivors} workers left, below --min-nproc {min_nproc}"
    return None
