"""Every message ftrun's processes exchange, by kind, with its fields; and generation plans.

- A worker and its agent: JSON objects, one per line, over the socket pair the worker inherits as
  ``FTRUN_CHANNEL_FD`` (``"t"`` is the kind).
- Agents across nodes, and the hostfile launcher: JSON objects posted to an agent's mailbox in the store
  (``"t"`` is the kind).
- Commands (``ftrun inject``, ``ftrun status``...): JSON objects with ``"cmd"`` posted to an agent's mailbox,
  answered through the store (``"reply_to"``).

This module is shared by the worker runtime and the agent, so it imports neither.
"""

from __future__ import annotations

import json
import signal
from dataclasses import asdict, dataclass, field
from typing import Any

STACK_DUMP_SIGNAL = signal.SIGRTMIN + 5
"""Sent by the agent to a hung worker, which dumps every thread's Python stack to stderr (faulthandler).

A real-time signal, so that SIGUSR1/SIGUSR2, which schedulers use for preemption notices, stay the user's.
"""

# worker -> agent
HELLO = "hello"  # the worker adopted the API: {uid, pid, spare}
READY = "ready"  # a joiner (spare or respawned worker) waits to be placed: {uid}
PROGRESS = "progress"  # a step committed: {gen, step, time, step_time}
ENTERED = "entered"  # the first collective of a step started: {step}
FINISHED = "finished"  # the worker left the step loop: no more progress is to be expected
RECOVERED = "recovered"  # the worker finished recovery for a generation: {gen, step, timings}
SAVED = "saved"  # the worker wrote its state for a group restart: {step}
UNRECOVERABLE = "unrecoverable"  # the new generation cannot recover in place (a shard in no memory): {reason}
# agent -> worker
PLAN = "plan"  # a new generation: Plan fields
SAVE = "save"  # recovery failed: write your state to FTRUN_RUN_DIR/rescue before the group restart
RAISE = "raise"  # a drill (`ftrun inject exception`): raise InjectedFault(message) at the next step: {message}
SLOW = "slow"  # a drill (`ftrun inject slow`): sleep `seconds` in each step, for `duration` s (None: until cleared)

# a follower or the hostfile launcher -> the leader's mailbox
WORKER_STARTED = "worker_start"  # a follower's worker started: {uid, pid, local_rank, rank, joiner}
WORKER_MESSAGE = "msg"  # a follower's worker said something on its channel: {uid, msg}
WORKER_EXITED = "exit"  # a follower's worker ended: {uid, code, failure (a WorkerFailure's fields) unless code 0}
NODE_GONE = "node_gone"  # the hostfile launcher saw a node's agent end: {node, reason, since (wall clock)}
# the leader -> a follower's mailbox
RELAY = "relay"  # control messages for one of its workers: {uid, data (JSON lines)}
SIGNAL = "signal"  # signal one of its workers: {uid, sig}
START_WORKER = "start_worker"  # start the replacement of its worker: {uid, local_rank, rank}
STOP = "stop"  # the leader gave up: stop every worker: {reason}

# commands, in any agent's mailbox: {"cmd": ..., "reply_to": token, ...}, answered {"ok": bool, ...}
PING = "ping"  # who are you: {} -> {node_rank, pid, attempt, ranks: {rank: pid}}
INJECT = "inject"  # a drill: {kind, rank, ...} -> see ftrun.agent.drills
DRILL_KINDS = ("kill", "hang", "exception", "slow", "xid", "ecc")
"""The drills one ``inject`` command can carry (chaos is a client-side series of them)."""


UID_STRIDE = 100_000
"""Worker uids of node ``n`` are ``n * UID_STRIDE + i``: unique across nodes without a round trip."""


def initial_members(sizes: list[int] | tuple[int, ...]) -> list[int]:
    """Generation 0 in rank order: node ``n``'s workers are uids ``n * UID_STRIDE + i``, ``i < sizes[n]``."""
    return [node * UID_STRIDE + i for node, size in enumerate(sizes) for i in range(size)]


@dataclass(frozen=True)
class Plan:
    """One generation: who is in the group, in rank order, and why it changed."""

    gen: int
    members: list[int]  # worker uids in rank order
    reason: str = "start"
    lost: list[int] = field(default_factory=list)
    joiners: list[int] = field(default_factory=list)

    @property
    def world_size(self) -> int:
        """Number of ranks in this generation."""
        return len(self.members)

    def rank_of(self, uid: int) -> int | None:
        """The rank ``uid`` has in this generation, or None when it is not a member."""
        try:
            return self.members.index(uid)
        except ValueError:
            return None

    def message(self) -> dict[str, Any]:
        """The plan as a control message."""
        return {"t": PLAN, **asdict(self)}

    @staticmethod
    def from_message(message: dict[str, Any]) -> Plan:
        """Read a plan back from a control message."""
        return Plan(**{k: v for k, v in message.items() if k != "t"})


def encode(kind: str, **fields: Any) -> bytes:
    """One control message as a JSON line."""
    return (json.dumps({"t": kind, **fields}) + "\n").encode()
