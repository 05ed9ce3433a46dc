"""A job's store as ftrun uses it: records, mailboxes, leases and plans over any :class:`KeyValue` backend."""

from __future__ import annotations

import json
import uuid
from datetime import timedelta
from typing import Any

from ftrun.errors import UsageError
from ftrun.protocol import Plan
from ftrun.store import keys
from ftrun.store.auth import MalformedValue, Seal
from ftrun.store.kv import BatchingKeyValue, KeyValue, LeasingKeyValue

__all__ = ["JobStore", "MalformedValue", "decode_object"]


def decode_object(raw: bytes | str) -> dict[str, Any]:
    """A JSON object read from the store; :class:`MalformedValue` for anything else."""
    try:
        value = json.loads(raw)
    except (ValueError, UnicodeDecodeError, RecursionError) as exc:
        raise MalformedValue(f"not JSON: {type(exc).__name__}") from None
    if not isinstance(value, dict):
        raise MalformedValue(f"not a JSON object but {type(value).__name__}")
    return value


LEASES_READ_ONE_BY_ONE = 2
"""Below this many nodes (one: a follower watching its leader), a look at native leases reads their keys (or
takes a watch's word for them) rather than every node's lease in one range: a follower reads one key, not a
thousand. From two on, the one range costs one request where the keys read one by one cost one each (etcd's
reads go as plain ranges, never a transaction of reads only: see :mod:`ftrun.store.etcd`); a leader of 16
nodes made 7.5 requests a second that way."""


class JobStore:
    """The one interface the agents, the hostfile launcher, ``ftrun status`` and ``ftrun inject`` use.

    Every key comes from :mod:`ftrun.store.keys`; every value ftrun writes is a JSON object sealed for its key
    with the run's secret (:class:`~ftrun.store.auth.Seal`), and every value read is checked: one that is
    not, whoever wrote it, raises :class:`MalformedValue`, never reaches a caller as data. Counters (mailbox
    indices) are the backend's own and carry no seal. A store backend plugs in below as the
    :class:`KeyValue` it wraps. Calls raise ``RuntimeError`` when the store does not answer.
    """

    def __init__(self, kv: KeyValue, seal: Seal) -> None:
        self.kv = kv
        self.seal = seal
        # once: a protocol's isinstance costs tens of µs, and a node renews its lease and reads its leader's
        # several times a second
        self._batching = isinstance(kv, BatchingKeyValue)
        self._leases: LeasingKeyValue | None = kv if isinstance(kv, LeasingKeyValue) else None

    def _set(self, key: str, value: dict[str, Any]) -> None:
        self.kv.set(key, self.seal.seal(key, json.dumps(value).encode()))

    def _get(self, key: str) -> dict[str, Any]:
        return decode_object(self.seal.open(key, self.kv.get(key)))

    def _get_if_there(self, key: str) -> dict[str, Any] | None:
        return self._get(key) if self.kv.check([key]) else None

    # ------------------------------------------------------------ records
    def write_job(self, info: dict[str, Any]) -> None:
        """The job's description (run id, nodes, world size, run directory): written by the leader at start."""
        self._set(keys.JOB, info)

    def read_job(self, wait: float) -> dict[str, Any] | None:
        """The job's description, waiting up to ``wait`` s for a job that has just started; None if absent."""
        return self._read_waiting(keys.JOB, wait)

    def write_status(self, node_rank: int, record: dict[str, Any]) -> None:
        """Node ``node_rank``'s live status record."""
        self._set(keys.status_node(node_rank), record)

    def write_job_status(self, record: dict[str, Any]) -> None:
        """The job's live status record (the leader's)."""
        self._set(keys.STATUS_JOB, record)

    def read_job_status(self, wait: float = 0.0) -> dict[str, Any] | None:
        """The job's live status record, waiting up to ``wait`` s for the first; None if there is none."""
        return self._read_waiting(keys.STATUS_JOB, wait)

    def read_node_status(self, node_rank: int) -> dict[str, Any] | None:
        """Node ``node_rank``'s live status record, None until it published one."""
        return self._get_if_there(keys.status_node(node_rank))

    def _read_waiting(self, key: str, wait: float) -> dict[str, Any] | None:
        if wait > 0:
            try:
                self.kv.wait([key], timedelta(seconds=wait))
            except RuntimeError:  # torch raises DistStoreError (a RuntimeError) on timeout
                return None
        return self._get_if_there(key)

    def publish_group_store(self, host: str, port: int) -> None:
        """Where node 0 serves the process groups' TCPStore (with the etcd backend, the other nodes learn it here)."""
        self._set(keys.GROUP_STORE, {"host": host, "port": port})

    def read_group_store(self, wait: float) -> tuple[str, int] | None:
        """Where node 0 serves the process groups' TCPStore, waiting up to ``wait`` s; None if it did not say
        (or what is there is not a host and a port)."""
        try:
            where = self._read_waiting(keys.GROUP_STORE, wait)
        except MalformedValue:
            return None
        if where is None or not isinstance(where.get("host"), str) or type(where.get("port")) is not int:
            return None
        return where["host"], where["port"]

    def stand_for_leader(self, term: int) -> bool:
        """Whether this node won the election of ``term`` (the first to claim it: an atomic add, or where the
        store has it, a create that only one claim can make, so that a thousand claims cost a request each)."""
        if self.native_leases:
            return self._leasing().create(keys.leader_claim(term), "1")
        return self.kv.add(keys.leader_claim(term), 1) == 1

    def announce_leader(self, term: int, node: int, host: str, port: int) -> None:
        """Node ``node`` leads from ``term`` on, and serves the process groups' store at ``host:port``."""
        self._set(keys.leader_of(term), {"node": node, "host": host, "port": port})

    def read_leader(self, term: int, wait: float) -> tuple[int, str, int] | None:
        """(node, store host, store port) of ``term``'s leader, waiting up to ``wait`` s; None if none said so."""
        try:
            said = self._read_waiting(keys.leader_of(term), wait)
        except MalformedValue:
            return None
        if said is None or type(said.get("node")) is not int or not isinstance(said.get("host"), str) \
                or type(said.get("port")) is not int:
            return None
        return said["node"], said["host"], said["port"]

    # ------------------------------------------------------------ mailboxes
    def post(self, box: str, message: dict[str, Any]) -> int:
        """Append the command ``message`` to mailbox ``box`` (from any client); returns its index.

        The index is part of the sealed key: a command cannot be replayed at another index.
        """
        index = self.kv.add(keys.mail_count(box), 1)
        self._set(keys.mail_item(box, index), message)
        self.ring(box)
        return index

    def send(self, box: str, sender: str, index: int, message: dict[str, Any]) -> None:
        """Write ``sender``'s ``index``-th message to ``box`` (agents number their own: see ``Outbox``)."""
        self.send_many(sender, [(box, index, message)])

    def send_many(self, sender: str, messages: list[tuple[str, int, dict[str, Any]]]) -> None:
        """Write ``sender``'s messages, each ``(box, index, message)``, then ring each box once: in one write
        where the backend takes several at once (etcd: a transaction), so a broadcast to every node costs
        about one write, not two per node."""
        items = []
        for box, index, message in messages:
            key = keys.sent_item(box, sender, index)
            items.append((key, self.seal.seal(key, json.dumps(message).encode())))
        items += [(keys.bell(box), b"") for box in dict.fromkeys(box for box, _, _ in messages)
                  if box != keys.BROADCAST]  # the readers of broadcasts wait for the message's key itself
        broadcasts = [index for box, index, _ in messages if box == keys.BROADCAST]
        if broadcasts:
            count = keys.broadcast_count(sender)
            items.append((count, self.seal.seal(count, json.dumps({"n": broadcasts[-1]}).encode())))
        set_many = getattr(self.kv, "set_many", None)
        if set_many is not None:
            set_many(items)
        else:
            for key, value in items:
                self.kv.set(key, value)

    def ring(self, box: str) -> None:
        """Wake ``box``'s reader: set its bell, after the message (the reader deletes the bell before it looks,
        so a message written before a ring it consumed is always seen). Only the bell's presence counts: a
        value anyone writes there wakes the reader, nothing more."""
        self.kv.set(keys.bell(box), b"")

    def await_ring(self, box: str, timeout: float, also: dict[str, str]) -> dict[str, bytes | None]:
        """Wait up to ``timeout`` s for ``box``'s bell, or for one of the keys ``also`` (the next broadcasts,
        each to the one after it, which the backend may start waiting for as it reads it): the keys seen set
        (none: empty), with the raw value of each of ``also`` that came. The reader deletes
        the bell with its next look (:meth:`look_at_mail`). A backend that cannot wait for several keys at
        once waits for the bell alone (the broadcasts are then read when it rings, or at the timeout). A store
        that stopped answering looks like silence here and raises at the caller's next call."""
        bell = keys.bell(box)
        try:
            if also and self._batching:
                return self.kv.wait_any([bell, *also], timeout, list(also), also)  # type: ignore[attr-defined]
            self.kv.wait([bell], timedelta(seconds=timeout))
        except RuntimeError:
            return {}
        return {bell: None}

    def look_at_mail(self, discard: list[str], read: list[str], box: str | None = None) -> list[bytes | None]:
        """Delete the mailbox keys in ``discard`` (read, given up on, or a bell that rang), then what is stored
        at each key in ``read`` (None where nothing is), unopened: in one round trip where the backend batches
        calls (:class:`~ftrun.store.kv.BatchingKeyValue`), else a few calls a key. The keys of ``box`` (the
        reader's own: its unread messages and counter, nothing else) may be read in one read of the box (etcd:
        a leader's look at a thousand followers' lanes is one request, not two thousand)."""
        if self._batching:
            spans = [keys.mailbox(box)] if box is not None else []
            return self.kv.read_many(read, discard, spans)  # type: ignore[attr-defined]
        for key in discard:
            self.kv.delete_key(key)
        return [self.kv.get(key) if self.kv.check([key]) else None for key in read]

    def open_mail(self, key: str, raw: bytes) -> dict[str, Any]:
        """The message ``raw`` read at mailbox key ``key``; MalformedValue if ftrun did not write it there."""
        return decode_object(self.seal.open(key, raw))

    def read_mail(self, key: str) -> dict[str, Any]:
        """The message at mailbox key ``key`` (something is there); MalformedValue if ftrun did not write it."""
        return self._get(key)

    def discard_mail(self, discard: list[str]) -> None:
        """Delete the mailbox keys in ``discard`` (broadcasts every reader is past), in one round trip where the
        backend batches calls."""
        self.look_at_mail(discard, [])

    def request(self, box: str, message: dict[str, Any], timeout: float = 10.0) -> dict[str, Any]:
        """Post a command to ``box`` and wait for the reader's answer (UsageError when the store does not take
        it, or no answer comes)."""
        token = uuid.uuid4().hex
        try:
            self.post(box, {**message, "reply_to": token})
        except RuntimeError as exc:  # a counter someone set to something else than a number: the store drops us
            raise UsageError(f"the job's store did not take the command ({str(exc)[:200]})") from None
        key = keys.reply(token)
        try:
            self.kv.wait([key], timedelta(seconds=timeout))
        except RuntimeError:
            raise UsageError(f"the job did not answer within {timeout:.0f} s (is it still running?)") from None
        try:
            return self._get(key)
        except MalformedValue as exc:
            raise UsageError(f"the job's answer was not understood ({exc})") from None
        finally:
            self.kv.delete_key(key)

    def reply(self, message: dict[str, Any], answer: dict[str, Any]) -> None:
        """Answer a command posted with :meth:`request` (nothing to do for one without ``reply_to``)."""
        token = message.get("reply_to")
        if isinstance(token, str) and token:
            self._set(keys.reply(token), answer)

    # ------------------------------------------------------------ leases
    @property
    def native_leases(self) -> bool:
        """Whether the backend keeps leases itself (etcd): a node's lease key then goes when its lease ends, on
        the store's clock, instead of its count ceasing to grow."""
        return self._leases is not None

    def renew_lease(self, node_rank: int, renewals: int) -> None:
        """Record node ``node_rank``'s ``renewals``-th renewal of its lease. The count only ever grows: an old
        lease value written again renews nothing."""
        self._set(keys.lease(node_rank), {"renewals": renewals})

    def take_lease(self, node_rank: int, renewals: int, ttl: float) -> int:
        """With :attr:`native_leases`: a new store lease of ``ttl`` s for node ``node_rank``, its lease key
        (count ``renewals``) written on it; the lease's id, for :meth:`keep_lease`."""
        kv = self._leasing()
        lease = kv.grant_lease(ttl)
        key = keys.lease(node_rank)
        kv.set_leased(key, self.seal.seal(key, json.dumps({"renewals": renewals}).encode()), lease)
        return lease

    def keep_lease(self, lease: int) -> bool:
        """Keep a lease from :meth:`take_lease` alive; False once the store has ended it."""
        return self._leasing().keep_alive(lease)

    def _leasing(self) -> LeasingKeyValue:
        if self._leases is None:
            raise TypeError("this store keeps no leases of its own")
        return self._leases

    def lease_renewals(self, nodes: list[int], watched: bool = False) -> dict[int, int | None]:
        """How often each of ``nodes`` has renewed its lease; None before its first renewal, when the value
        there is not its agent's, or (native leases) once its lease ended. Native leases: one read of every
        node's lease, or for fewer than :data:`LEASES_READ_ONE_BY_ONE` nodes (a follower watching its leader),
        a read of theirs, or where ``watched``, what watches on their leases keep known (no request
        once they are open); otherwise, once every node has renewed, one request per node and one for them all."""
        if self.native_leases and self._batching and len(nodes) < LEASES_READ_ONE_BY_ONE:
            wanted = [keys.lease(node) for node in nodes]
            reading = self._leasing().read_watched if watched else self.kv.read_many  # type: ignore[attr-defined]
            values = reading(wanted)
            return {node: self._count(key, raw) for node, key, raw in zip(nodes, wanted, values)}
        if self.native_leases:
            found = self._leasing().read_prefix(keys.LEASE_PREFIX)
            return {node: self._count(keys.lease(node), found.get(keys.lease(node))) for node in nodes}
        every_lease = bool(nodes) and self.kv.check([keys.lease(node) for node in nodes])
        return {node: self._renewals(node, every_lease) for node in nodes}

    def _renewals(self, node_rank: int, there: bool) -> int | None:
        """Node ``node_rank``'s renewal count; ``there``: its lease key is known to exist."""
        key = keys.lease(node_rank)
        return self._count(key, self.kv.get(key) if there or self.kv.check([key]) else None)

    def _count(self, key: str, raw: bytes | None) -> int | None:
        """The renewal count in the lease value ``raw`` read from ``key``; None if absent or not its agent's."""
        if raw is None:
            return None
        try:
            renewals = decode_object(self.seal.open(key, raw)).get("renewals")
        except MalformedValue:
            return None
        return renewals if type(renewals) is int else None

    def say_ended(self, node_rank: int) -> None:
        """Node ``node_rank``'s agent is ending: it needs the store no longer."""
        self._set(keys.ended(node_rank), {"ended": True})

    def await_ended(self, nodes: list[int], timeout: float) -> None:
        """Wait up to ``timeout`` seconds for each of ``nodes`` to say it is ending (a mark anyone wrote counts:
        it only ends the wait early)."""
        try:
            self.kv.wait([keys.ended(node) for node in nodes], timedelta(seconds=timeout))
        except RuntimeError:  # a timeout, or the store no longer answers: the wait is a courtesy
            pass

    def evict(self, node_rank: int) -> None:
        """Mark node ``node_rank`` lost: should it come back, it learns it must stop. With native leases its
        lease is ended too, so that its next keep-alive tells it at once (it looks for the mark no more)."""
        self._set(keys.evicted(node_rank), {"evicted": True})
        if self.native_leases:
            self._leasing().end_lease_of(keys.lease(node_rank))

    def is_evicted(self, node_rank: int) -> bool:
        """Whether the leader declared node ``node_rank`` lost (a mark the leader did not write counts for nothing)."""
        try:
            return self._get_if_there(keys.evicted(node_rank)) == {"evicted": True}
        except MalformedValue:
            return False

    # ------------------------------------------------------------ plans
    def publish_plan(self, attempt: int, plan: Plan) -> None:
        """Record ``plan`` as the current generation of ``attempt`` (for people and tools: workers get their
        plans from their agent)."""
        self._set(keys.plan(attempt, plan.gen), plan.message())
        self._set(keys.current_gen(attempt), {"gen": plan.gen})
