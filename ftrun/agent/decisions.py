"""Every decision of the recovery protocol, as pure functions of (what the leader knows, what happened, now).

Which workers a fault took, the next generation, whether the survivors can recover in place or the group
must restart (after saving their state, or at once), when a recovery or a wait for joiners has taken too
long, when a rescue is over, and what a finished recovery cost. Each returns its decision with the reason a
person reads; none touches a process, the store, the clock or the log (``now`` is ``time.monotonic()``,
passed in). :mod:`ftrun.agent.leader` carries the decisions out.
"""

from __future__ import annotations

import enum
from collections import Counter
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ftrun.protocol import RECOVERY_PHASES, Plan


@dataclass
class Membership:
    """What the leader knows of the current attempt's workers (all nodes), by uid."""

    plan: Plan
    target: int  # training workers the attempt started with: joiners top a generation up to it
    adopted: set[int] = field(default_factory=set)  # joined through the worker API (ftrun.init)
    ready: list[int] = field(default_factory=list)  # joiners waiting to be placed, oldest first
    finished: set[int] = field(default_factory=set)  # exited with code 0
    trained: set[int] = field(default_factory=set)  # committed at least one step
    joiners: set[int] = field(default_factory=set)  # placed after the start (spares, respawned workers)
    left_loop: set[int] = field(default_factory=set)  # finished their step loop: the training is complete
    last_step: dict[int, int] = field(default_factory=dict)  # last committed step, per worker


@dataclass(frozen=True)
class RecoveryOptions:
    """The flags recovery decisions depend on."""

    enabled: bool = True
    min_nproc: int = 1
    recovery_timeout: float = 30.0
    join_timeout: float = 60.0


@dataclass
class Recovery:
    """One recovery in progress: from the first fault noticed (or joiner ready) to the first step after it."""

    kind: str  # "fault" or "join"
    began: float  # monotonic: its deadline counts from here
    started: float  # wall clock: when the fault happened, as far as is known (latencies are measured from it)
    noticed: float  # wall clock: when ftrun learned of it (later than ``started`` for a lost node)
    before: Plan  # the generation the fault hit: lost ranks are named by their rank in it
    last_steps: dict[int, int]  # the last step each worker had committed when it began, by uid
    lost_ranks: list[int] = field(default_factory=list)
    lost_uids: list[int] = field(default_factory=list)
    plan_sent: float = 0.0  # wall clock
    gen: int = -1  # the generation planned for it (none yet: a step committed in the one the fault hit ends nothing)
    reports: dict[int, dict[str, Any]] = field(default_factory=dict)  # uid -> its ``recovered`` message
    waiting_since: float | None = None  # monotonic: below --min-nproc, waiting for joiners since

    @property
    def committed_before(self) -> int:
        """The highest step a surviving worker had committed when the recovery began (-1 before the first).

        A step that only a lost worker reached was in flight, not lost: a rank can finish a step's
        collectives and die before its last sends reach the others, and its state leaves with it.
        """
        return max((step for uid, step in self.last_steps.items() if uid not in self.lost_uids), default=-1)


@dataclass
class Rescue:
    """Before a group restart: the live workers write their last committed state, within a deadline."""

    reason: str
    deadline: float  # monotonic
    waiting: set[int]
    saved: dict[int, int] = field(default_factory=dict)  # uid -> committed step written
    errors: dict[int, str] = field(default_factory=dict)  # uid -> why it could not write its state


class Act(enum.Enum):
    """What a decision asks the leader to do."""

    NONE = "none"  # nothing (the reason says why, where there is one)
    NEW_PLAN = "new_plan"  # issue ``plan``: the survivors (and joiners) recover in place
    WAIT = "wait"  # below --min-nproc: keep ``plan`` (the survivors) and wait for joiners
    RESCUE = "rescue"  # no in-place recovery: the live workers save their state, then the group restarts
    RESTART = "restart"  # no in-place recovery and no state worth saving: restart the group now
    EXCLUDE = "exclude"  # links among live members do not connect: stop the members in ``exclude``


@dataclass(frozen=True)
class Decision:
    """A decision and its reason; ``plan`` for NEW_PLAN and WAIT, ``exclude`` (uids) for EXCLUDE."""

    act: Act
    reason: str = ""
    plan: Plan | None = None
    exclude: tuple[int, ...] = ()


NOTHING = Decision(Act.NONE)


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


def split_lost(m: Membership, uids: Sequence[int]) -> tuple[list[int], list[int]]:
    """The lost workers that were members of the current generation, and the joiners (not yet placed)."""
    members = [uid for uid in uids if uid not in m.ready and uid in m.plan.members]
    return members, [uid for uid in uids if uid not in members]


def survivors(m: Membership, lost: Collection[int]) -> list[int]:
    """The members that are neither lost nor finished, in rank order."""
    return [uid for uid in m.plan.members if uid not in lost and uid not in m.finished]


def lost_ranks(before: Plan, current: Plan, lost: Sequence[int]) -> list[int]:
    """The ranks of ``lost`` members in ``before`` (the generation the fault hit), else in ``current``."""
    return [before.rank_of(uid) if uid in before.members else current.rank_of(uid) for uid in lost]


def decide_fault(m: Membership, options: RecoveryOptions, lost: Sequence[int], ranks: Sequence[int],
                 replacements: int, rescuing: bool) -> Decision:
    """What to do when the members ``lost`` (ranks ``ranks`` where the fault hit) failed together.

    ``replacements`` of them get a new worker (``--respawn``, a GPU restart), which counts toward
    ``--min-nproc`` like a ready joiner. While a rescue runs, nothing more is decided: the group restarts.
    """
    if not options.enabled:
        return Decision(Act.RESTART, "in-place recovery is off (--no-recovery)")
    if rescuing or not lost:
        return NOTHING
    alive = survivors(m, lost)
    reason = why_not_in_place(m.plan.members, m.adopted, len(alive), len(m.ready) + replacements, options.min_nproc)
    if reason is not None:
        save = all(uid in m.adopted for uid in m.plan.members)
        return Decision(Act.RESCUE if save else Act.RESTART, reason)
    if len(alive) + len(m.ready) < options.min_nproc:
        return Decision(Act.WAIT, f"{len(alive)} workers left, below --min-nproc {options.min_nproc}: waiting for "
                                  "joiners", Plan(m.plan.gen, alive))
    what = f"lost rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}"
    return Decision(Act.NEW_PLAN, what, next_plan(m.plan, lost, m.ready, m.target, what))


def decide_join(m: Membership, options: RecoveryOptions, recovery: Recovery | None, rescuing: bool = False,
                warming: int = 0) -> Decision:
    """Whether ready joiners fill the current generation now (NEW_PLAN), must wait for more (WAIT), or not;
    ``rescuing``: the live workers are saving their state for a group restart; ``warming``: joiners started
    and not ready yet (those that start together, a late node's, join together, in one generation, unless the
    ready ones fill it already)."""
    if rescuing:  # a joiner ready just after the recovery gave up would get a plan the stopping group never forms
        return Decision(Act.NONE, "the group is restarting; joiners are not placed")
    if recovery is not None and recovery.waiting_since is None:
        return Decision(Act.NONE, "a recovery is under way; joiners are placed once it is done")
    if not m.ready or len(m.plan.members) >= m.target or m.left_loop or m.finished:
        return NOTHING  # nobody to place, full, or the training is over
    if warming and len(m.plan.members) + len(m.ready) < m.target:
        return Decision(Act.NONE, f"{warming} more joiner{'s' if warming > 1 else ''} starting: they join together")
    if len(m.plan.members) + len(m.ready) < options.min_nproc:
        return Decision(Act.WAIT, f"below --min-nproc {options.min_nproc}: waiting for more joiners", m.plan)
    return Decision(Act.NEW_PLAN, "joiner ready", next_plan(m.plan, (), m.ready, m.target, "joiner ready"))


def decide_deadline(recovery: Recovery | None, options: RecoveryOptions, now: float) -> Decision:
    """RESCUE when a wait for joiners or an in-place recovery has outlived its timeout at monotonic ``now``."""
    if recovery is None:
        return NOTHING
    if recovery.waiting_since is not None:
        if now - recovery.waiting_since > options.join_timeout:
            return Decision(Act.RESCUE, f"no joiner came within --join-timeout {options.join_timeout:g} s "
                                        f"to reach --min-nproc {options.min_nproc}")
    elif now - recovery.began > options.recovery_timeout:
        return Decision(Act.RESCUE, f"in-place recovery did not finish within --recovery-timeout "
                                    f"{options.recovery_timeout:g} s")
    return NOTHING


def rescue_outcome(rescue: Rescue, now: float) -> str | None:
    """None while live workers are still saving (before the deadline); then why the group restarts."""
    if rescue.waiting and now < rescue.deadline:
        return None
    best = max(rescue.saved.values(), default=-1)
    if best >= 0:
        return f"{rescue.reason}; the state of step {best} was saved for the restart"
    if rescue.errors:
        return f"{rescue.reason}; no state could be saved for the restart: {next(iter(rescue.errors.values()))}"
    return rescue.reason


def why_no_restart_here(node_evicted: bool, usable: int, nproc: int, min_nproc: int, multinode: bool) -> str | None:
    """Why this node cannot take part in a group restart after GPU evictions, or None.

    ``usable``: the GPUs of its ``nproc`` local ranks left. One node restarts with as few as --min-nproc;
    across nodes every node starts --nproc-per-node workers, which the others' ranks count on.
    """
    if node_evicted:
        return "this node is evicted"
    floor, what = (nproc, f"--nproc-per-node {nproc}, which every node must start again") if multinode else \
        (min_nproc, f"--min-nproc {min_nproc}")
    if usable < floor:
        return f"GPU evictions left {usable} usable GPU{'s' if usable != 1 else ''} on this node, below {what}"
    return None


def rescue_source(attempt: int, rescued: bool, run_dir: Path, resumed: Path | None) -> Path | None:
    """The rescue directory attempt ``attempt``'s workers start from, or None (from scratch).

    ``rescued``: an earlier attempt of this launch saved a state before its group restart (in ``run_dir``'s);
    that is the newest. Else ``resumed``, the saved state of the earlier launch ``--resume-from`` names, if any.
    """
    if attempt > 0 and rescued:
        return run_dir / "rescue"
    return resumed


def waiting_for(m: Membership, options: RecoveryOptions, recovery: Recovery | None, rescue: Rescue | None,
                warming: int, now: float) -> str | None:
    """What the job waits for at monotonic ``now``, in a few words for a progress line; None when it trains.

    ``warming``: joiners started but not ready yet (spares and replacements importing their libraries).
    """
    if rescue is not None:
        saved = len(rescue.saved)
        return (f"saving the live workers' state before a group restart: {saved} of {saved + len(rescue.waiting)} "
                f"saved, {max(0.0, rescue.deadline - now):.0f} s left")
    if recovery is not None and recovery.waiting_since is not None:
        have = len(m.plan.members) + len(m.ready)
        left = max(0.0, options.join_timeout - (now - recovery.waiting_since))
        return (f"waiting for joiners to reach --min-nproc {options.min_nproc}: {have} of {options.min_nproc}"
                f"{f' ({warming} starting)' if warming else ''}, {left:.0f} s left")
    if recovery is not None and now - recovery.began > 1.0:
        return (f"recovering in place into generation {recovery.gen}: {len(recovery.reports)} of "
                f"{m.plan.world_size} workers rejoined, {now - recovery.began:.0f} s so far")
    if warming:
        return f"{warming} joiner{'s' if warming > 1 else ''} starting"
    return None


REFORM_GRACE = 0.5
"""Seconds a reported collective failure waits for a death to explain it before the same members re-form."""
MAX_REFORMS = 2
"""Re-forms of the same members in a row (without a step committed between) before the group restarts."""


@dataclass
class LinkTrouble:
    """Collective failures in one generation that no death explains (yet): reports, a stall, a probe."""

    gen: int
    since: float  # monotonic: the first sign
    reasons: list[str] = field(default_factory=list)  # the members' reports, in a few words each
    stuck_nodes: set[int] = field(default_factory=set)  # nodes whose every rank waits in a collective, timed out
    unreachable: dict[int, list[int]] | None = None  # a probe's matrix: uid -> the members it could not reach
    acted: bool = False  # decided upon: later reports of this generation change nothing


def links_to_cut(unreachable: Mapping[int, Collection[int]], members: Sequence[int]) -> list[int]:
    """The fewest members to exclude so that every remaining pair connects (a greedy vertex cover of the
    failed links): the member with the most failed links first, the later rank on a tie (rank 0 stays)."""
    edges = {frozenset((a, b)) for a, peers in unreachable.items() for b in peers
             if a != b and a in members and b in members}
    cut: list[int] = []
    while edges:
        degree = Counter(uid for edge in edges for uid in edge)
        worst = max(degree, key=lambda uid: (degree[uid], members.index(uid)))
        cut.append(worst)
        edges = {edge for edge in edges if worst not in edge}
    return cut


def decide_link_fault(m: Membership, trouble: LinkTrouble | None, nodes: Collection[int], reforms: int,
                      now: float, recovery: Recovery | None = None) -> Decision:
    """What to do about collective failures that no death explains, at monotonic ``now``.

    Nothing while ``recovery`` waits for joiners (below --min-nproc): the member it lost explains them.

    A probe's matrix with a broken link: EXCLUDE the fewest members that leave every pair connected. A
    member's report (after REFORM_GRACE, in case a death explains it) or a stall on every node of
    ``nodes`` (those holding members): re-form the same members with a probe (NEW_PLAN), unless that
    was tried MAX_REFORMS times in a row (RESCUE: the group restarts).
    """
    if trouble is None or trouble.acted or trouble.gen != m.plan.gen:
        return NOTHING
    if recovery is not None and recovery.waiting_since is not None:
        return NOTHING
    if trouble.unreachable is not None:
        cut = links_to_cut(trouble.unreachable, m.plan.members)
        if cut:
            ranks = ", ".join(str(m.plan.rank_of(uid)) for uid in cut)
            return Decision(Act.EXCLUDE, f"links among the workers do not connect: excluding rank"
                                         f"{'s' if len(cut) > 1 else ''} {ranks}", exclude=tuple(cut))
    stalled = bool(nodes) and set(nodes) <= trouble.stuck_nodes
    if stalled:
        why = "every rank waits in a collective past its hang timeout"
    elif trouble.reasons and now - trouble.since >= REFORM_GRACE:
        why = f"a collective failed with every worker alive ({trouble.reasons[0]})"
    else:
        return NOTHING
    if reforms >= MAX_REFORMS:
        return Decision(Act.RESCUE, f"{why}, again after {reforms} re-forms of the same workers")
    reason = f"re-forming the same workers: {why}"
    return Decision(Act.NEW_PLAN, reason, Plan(m.plan.gen + 1, list(m.plan.members), reason, probe=True))


def succeeded(m: Membership) -> bool:
    """Whether every member of the current generation finished with exit code 0.

    A joiner placed as the others were finishing, which never committed a step, does not count.
    """
    counted = [uid for uid in m.plan.members if uid not in m.joiners or uid in m.trained]
    return bool(counted) and all(uid in m.finished for uid in counted)


def recovery_summary(recovery: Recovery, first_commit: dict[str, Any], world_after: int) -> dict[str, Any]:
    """The ``recovery`` event's fields once the first step of the new generation committed.

    Phases: detect (fault to ftrun knowing), plan (to the plan sent), abort, rendezvous, agree and transfer
    (the slowest worker's), first_step (from the last worker done recovering to the commit); steps lost:
    committed steps the survivors no longer hold.
    """
    reports = recovery.reports.values()
    done = first_commit["time"]
    phases = {"detect": round(max(0.0, recovery.noticed - recovery.started), 6),
              "plan": round(recovery.plan_sent - max(recovery.noticed, recovery.started), 6)}
    for name in RECOVERY_PHASES:
        phases[name] = max((r["timings"][name] for r in reports), default=0.0)
    recovered_at = max((r["plan_received"] + sum(r["timings"].values()) for r in reports), default=recovery.plan_sent)
    phases["first_step"] = round(done - recovered_at, 6)
    # the survivors say what they held when the plan reached them: the agent's own count of their commits is
    # told only now and then (and, from another node, relayed now and then)
    before = max([recovery.committed_before, *(r["held"] for r in reports)])
    after = min((r["step"] for r in reports), default=before)
    return {"kind": recovery.kind, "gen": recovery.gen, "lost_ranks": recovery.lost_ranks,
            "lost_uids": recovery.lost_uids, "world_before": recovery.before.world_size, "world_after": world_after,
            "steps_lost": max(0, before - max(after, first_commit["step"] - 1)),
            "resumed_at_step": first_commit["step"], "latency": round(done - recovery.started, 6), "phases": phases,
            "data_plane": "reconfigured" if reports and all(r.get("data_plane") == "reconfigured" for r in reports)
            else "formed"}
