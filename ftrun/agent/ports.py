"""The narrow interfaces the agent's helpers depend on, instead of on the agent itself.

Each helper (the leader's and a follower's coordination, the hang watchdog, GPU health, drills, the status
record) is given the few of these it needs; the agent (and a test's stand-in) provides them. Nothing here
imports the agent, so no helper does either.
"""

from __future__ import annotations

import signal
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol

from ftrun.config import Endpoint

if TYPE_CHECKING:
    from collections import deque

    from ftrun.agent.failures import WorkerFailure
    from ftrun.agent.workers import Worker, WorkerSlot
    from ftrun.protocol import Plan


class Restart(NamedTuple):
    """A group restart: the attempt the group starts as, and the store its workers rendezvous in (a new, empty
    one: no key of the attempt before, whatever the server can list or delete, pytorch#135712)."""

    attempt: int
    store: Endpoint


class Notices(Protocol):
    """ftrun's own lines on the console."""

    def notice(self, text: str, style: str = "bold") -> None:
        """Print one line for the person watching."""

    def progress(self, text: str | None) -> None:
        """Say what the job is waiting for (None: it is not waiting)."""


class WorkerHandle(Protocol):
    """A worker the coordination addresses: this node's own process, or another node's through its agent."""

    slot: WorkerSlot
    pid: int
    exitcode: int | None

    @property
    def uid(self) -> int:
        """The worker's id in generation plans."""

    def send(self, data: bytes) -> None:
        """Write control messages (JSON lines) to the worker."""

    def send_signal(self, sig: int) -> None:
        """Signal the worker (a finished one is left alone)."""


class LocalWorkers(Protocol):
    """This node's workers of the current attempt."""

    def get(self, uid: int) -> Worker | None:
        """Worker ``uid`` (ended or not), or None when it is not this node's."""

    def all(self) -> list[Worker]:
        """Every worker of the attempt, ended ones included."""

    def live(self) -> list[Worker]:
        """The workers that have not ended."""


class WorkerControl(Protocol):
    """What coordination may do to this node's workers and to the attempt."""

    def start_worker(self, local_rank: int, rank: int | None, respawn_of: WorkerSlot | None = None) -> Worker:
        """Start a worker on ``local_rank``; ``rank`` None makes it a joiner."""

    def stop_all(self, sig: int = signal.SIGTERM) -> None:
        """Signal every live worker of the job, and escalate to SIGKILL after --shutdown-timeout."""

    def save_and_stop(self) -> None:
        """Ask the workers that use the worker API to save their committed state, then stop every worker."""

    def worker_message(self, worker: WorkerHandle, message: dict[str, Any]) -> None:
        """A control message from a worker of the job (another node's, relayed by its agent)."""

    def stopping(self) -> bool:
        """Whether the attempt is being stopped (no fault is recovered from any more)."""

    def abandon(self, worker: WorkerHandle, waited: float) -> None:
        """Give up on a worker still there ``waited`` seconds after SIGKILL: report it, and count it lost."""

    def workers_failed(self, faults: list[tuple[WorkerHandle, WorkerFailure]]) -> None:
        """Workers failed together: recover in place if the coordination can, else end the attempt."""

    def end_attempt(self, reason: str) -> None:
        """Kill every worker of this node now: the attempt fails with ``reason``."""

    def leader_lost(self, node: int, silent: float) -> str | None:
        """The leader (``node``) has not renewed its lease for ``silent`` s: elect another (with etcd), lead or follow it;
        None once one leads, else why this node stops."""


class GpuUse(Protocol):
    """What recovery needs to know of GPU health on this node."""

    restarts: set[int]
    """Uids killed by a GPU health restart: each gets a replacement on the same GPU."""

    def usable(self, local_rank: int) -> bool:
        """Whether a worker may run on ``local_rank`` (its GPU is not evicted)."""


class LeaderInbox(Protocol):
    """What the leader's view of the other nodes hands on to the leader's coordination."""

    def on_message(self, worker: WorkerHandle, message: dict[str, Any]) -> None:
        """A control message from another node's worker."""

    def on_finished(self, worker: WorkerHandle) -> None:
        """Another node's worker ended with exit code 0."""

    def node_stuck(self, node: int, gen: int, reason: str) -> None:
        """Every rank of ``node`` waits in a collective of generation ``gen`` past its hang timeout."""

    def seen_generation(self, gen: int) -> None:
        """Another node knew of generation ``gen`` (a new leader hears it): the next plan comes after it."""

    def grow(self, workers: int) -> int:
        """A node joined with ``workers`` more training workers: the generation's target grows by them; the
        new target."""


class Progress(Protocol):
    """What the hang watchdog knows of one worker's progress."""

    last: float
    """Monotonic time of its last progress message."""
    step_times: deque[float]
    """Its recent step times, seconds."""


class HangView(Protocol):
    """What the status record reads of a hang watchdog."""

    progress: dict[int, Progress]
    """Per worker uid that has joined through the API."""
    killing: dict[int, float]
    """Workers declared hung, about to be killed (uid -> when)."""


class Coordination(Protocol):
    """The leader's or a follower's part in an attempt: what the agent's loop tells it and asks of it.

    :class:`ftrun.agent.leader.Leader` plans every generation of the job; :class:`ftrun.agent.follower.Follower`
    relays its node's news to the leader and carries out the leader's word.
    """

    plan: Plan
    """The current generation, as this node knows it."""
    last_step: dict[int, int]
    """The last step each worker (uid) committed, as far as this node knows."""
    watchdog: HangView
    """The hang watchdog of this node's workers."""

    @property
    def recovering(self) -> bool:
        """Whether an in-place recovery is under way."""

    @property
    def restarting(self) -> bool:
        """Whether the group is about to restart (its live workers are saving their state)."""

    @property
    def saved_step(self) -> int:
        """The step whose state this attempt's workers saved for a group restart (-1: none)."""

    def adopted(self, uid: int) -> bool:
        """Whether worker ``uid`` joined through the worker API."""

    def remote_workers(self) -> list[WorkerHandle]:
        """The other nodes' live workers this coordination answers for (the leader's), else none."""

    def on_start(self, worker: Worker) -> None:
        """This node started ``worker``."""

    def on_message(self, worker: Worker, message: dict[str, Any]) -> None:
        """A control message from one of this node's workers."""

    def on_finished(self, worker: Worker) -> None:
        """One of this node's workers ended with exit code 0."""

    def on_faults(self, faults: list[tuple[WorkerHandle, WorkerFailure]]) -> bool:
        """Workers failed together; False when the attempt must end (no recovery in place)."""

    def on_mail(self, message: dict[str, Any]) -> None:
        """A message posted to this node's mailbox by another node or the hostfile launcher."""

    def tick(self, now: float) -> str | None:
        """Housekeeping at monotonic ``now``: the reason to end the attempt, or None."""

    def succeeded(self) -> bool:
        """Whether this node's part of the attempt succeeded, once every worker has ended."""

    @property
    def restart_to(self) -> Restart | None:
        """The group restart the leader told this follower of (None: not told; the leader's)."""

    def why_no_restart(self) -> str | None:
        """Why the job's group cannot restart on the same nodes (the leader knows: a node was lost), or None."""

    def awaiting(self, now: float) -> bool:
        """Whether the attempt goes on with no worker of this node left (a follower waits for the leader's word)."""

    def close(self, reason: str | None, restart: Restart | None = None) -> None:
        """The attempt is over (``reason``: why it failed, None if it succeeded; ``restart``: the group restarts,
        as that attempt, in that store)."""
