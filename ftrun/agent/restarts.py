"""Group restarts (``--max-restarts``): whether the leader restarts the group after an attempt, and whether a
follower the leader told to can take part. A refusal is added to the attempt's reason, which the end says."""

from __future__ import annotations

from ftrun.agent.decisions import why_no_restart_here
from ftrun.agent.failures import AttemptResult
from ftrun.agent.gpu_health import GpuHealth
from ftrun.agent.ports import Coordination, Restart
from ftrun.config import LaunchConfig
from ftrun.console import Console


class GroupRestarts:
    """This node's side of a group restart."""

    def __init__(self, config: LaunchConfig, gpu_health: GpuHealth, console: Console) -> None:
        self.config = config
        self.gpu_health = gpu_health
        self.console = console

    def refusal_here(self) -> str | None:
        """Why this node cannot take part in a group restart (GPU evictions), or None."""
        nproc, health = self.config.nproc_per_node, self.gpu_health
        return why_no_restart_here(health.node_evicted, len(health.usable_ranks(nproc)), nproc,
                                   self.config.recovery.min_nproc, self.config.multinode)

    def leader_restarts(self, result: AttemptResult, restarts: int, fenced: bool, coordination: Coordination) -> bool:
        """Whether the leader restarts the group after this attempt (``restarts`` made so far; within
        --max-restarts, on every node)."""
        if result.succeeded or result.signal is not None or restarts >= self.config.max_restarts:
            return False
        refused = ("this node was fenced: the other nodes go on without it" if fenced else None) \
            or self.refusal_here() or result.why_no_restart() or coordination.why_no_restart()
        if refused is not None:
            result.reason = f"{result.reason}; no group restart: {refused}"
        return refused is None

    def follower_restart(self, result: AttemptResult, coordination: Coordination) -> Restart | None:
        """The restart a follower makes because the leader told it to restart the group, or None (the reason
        says why not when it cannot)."""
        restart = coordination.restart_to
        if restart is None:
            return None
        refused = self.refusal_here()
        if refused is not None:
            result.reason = f"the leader restarts the group, but this node cannot: {refused}"
            return None
        self.console.notice(f"ftrun: node {self.config.node_rank}: the leader restarts the group (restart "
                            f"{restart.attempt} of {self.config.max_restarts})", style="bold yellow")
        return restart
