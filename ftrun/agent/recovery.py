"""The recovery coordinator: turns worker faults into new generations (placeholder until in-process recovery)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ftrun.agent.agent import Agent
    from ftrun.agent.failures import WorkerFailure
    from ftrun.agent.workers import Worker


class Coordinator:
    """Decides, for each fault, between in-process recovery and a group restart."""

    def __init__(self, agent: Agent, store: Any) -> None:
        self.agent = agent
        self.store = store

    def on_message(self, worker: Worker, message: dict[str, Any]) -> None:
        """A control message from a worker."""

    def on_finished(self, worker: Worker) -> None:
        """A worker ended with exit code 0."""

    def on_fault(self, worker: Worker, failure: WorkerFailure) -> bool:
        """A worker failed; True when recovered in place, False to restart the group."""
        return False

    def tick(self, now: float) -> str | None:
        """Called every monitor interval; returns a reason to fall back to a group restart, or None."""
        return None
