"""How often each node writes what it publishes now and then, so that a job's store load stays bounded whatever
the number of its nodes.

Two kinds of writes recur on every node while a job trains: its status record (for ``ftrun status``) and its
workers' commits told to the leader (the leader's view of each rank's step). At a fixed cadence their sum grows
with the job: a record a second from each of 1,000 nodes is 1,000 writes a second to etcd (and as many revisions
kept until compaction), and a commit of each of 8 workers every half second, 16,000 messages a second that the
leader's one interpreter cannot read. So each kind gets a cadence per node that stretches with the number of
nodes, keeping the whole job's writes of that kind near :data:`JOB_WRITES_PER_S`; a small job keeps the least.
"""

from __future__ import annotations

from typing import Any

from ftrun import protocol

JOB_WRITES_PER_S = 200.0
"""Writes per second of one periodic kind that a whole job makes at most, once it is large enough that its nodes'
least cadence would make more: a fraction of what one etcd member or the embedded store serves, and of what the
leader reads."""


def periodic_interval(nodes: int, least: float) -> float:
    """Seconds between two of one node's periodic writes of one kind in a job of up to ``nodes`` nodes:
    ``least``, or longer where the nodes together would write more than :data:`JOB_WRITES_PER_S` a second."""
    return max(least, nodes / JOB_WRITES_PER_S)


class ProgressRelay:
    """Which of this node's workers' commits go to the leader, and when (no I/O: the caller sends what it
    takes).

    The leader needs a worker's first commit of each generation at once (it ends a recovery, and it is the
    step a restarted group resumed from); later ones only keep its view of each rank's step fresh, and its own
    workers, which commit the same steps, keep the job's step fresh. So a later commit is held, only the
    latest per worker, and the held ones go together (one message, :data:`~ftrun.protocol.COMMITS`, one store
    write) once ``every`` seconds have passed since the last went, or with the next message this node sends the
    leader for another reason.
    """

    def __init__(self, every: float) -> None:
        self.every = every
        self._held: dict[int, dict[str, Any]] = {}  # uid -> its latest commit not yet taken
        self._generation: dict[int, int] = {}  # uid -> the generation of its last commit taken
        self._taken = 0.0  # monotonic: when the held commits were last taken

    def commit(self, uid: int, message: dict[str, Any]) -> bool:
        """Hold ``message``, worker ``uid``'s latest commit; whether it is to go now (its first of a
        generation)."""
        self._held[uid] = message
        return self._generation.get(uid) != message["gen"]

    def due(self, now: float) -> bool:
        """Whether held commits are to go now (monotonic ``now``)."""
        return bool(self._held) and now - self._taken >= self.every

    def take(self, now: float) -> dict[str, Any] | None:
        """The message that tells the leader the held commits (in the order their workers first committed since
        the last take), or None when none is held; none is held after."""
        if not self._held:
            return None
        taken, self._held, self._taken = self._held, {}, now
        self._generation.update((uid, message["gen"]) for uid, message in taken.items())
        return {"t": protocol.COMMITS, "commits": [{"uid": uid, "msg": message} for uid, message in taken.items()]}
