"""Node leases: every follower renews one in the store; the leader declares a node lost when it stops.

A renewal is a sealed count that only grows, so neither a forged value nor an old one written again renews a
lease. The leader declares a node lost once it has seen no renewal for ``--node-timeout``; a follower that
cannot renew for :data:`FENCE_FRACTION` of that stops its own workers (fences itself) first, so a node cut
off from the store never trains on alone, and has stopped before the others carry on without it. One the
leader evicted learns so when it next looks for its eviction, every :data:`EVICTION_CHECK_EVERY` renewals (a
store request each): an idle follower costs the store about 0.6 requests a second at ``--node-timeout 10``.

Where the backend keeps leases itself (etcd), a node's lease is an etcd lease with ``--node-timeout`` as
its TTL, and its lease key sits on it: a renewal is a keep-alive, and etcd deletes the key once no keep-alive
came for the TTL, on etcd's clock. A watcher then counts a node lost as soon as its key is gone, not after a
timeout of its own; a keeper whose keep-alive finds the lease ended fences at once. The leader's eviction ends
the node's lease too, so its keeper learns of it from its next keep-alive and never looks for the mark. A
keep-alive goes every third of the TTL, as etcd's own client sends them (:data:`KEEPALIVES_PER_TTL`): 0.3
requests a second per idle follower at ``--node-timeout 10``.

Fencing does not depend on the cadence: a keeper fences :data:`FENCE_FRACTION` of the timeout after the
last renewal that went through, counted from when it was sent, and the store (the leader's clock, or etcd's
TTL) counts the node lost no sooner than the full timeout after it reached it. What the cadence sets is how
many tries a keeper has before it fences; a renewal that fails is tried again :data:`RETRY_AFTER` seconds
later rather than at the next renewal (etcd's client waits as long before it tries again), so a lost
keep-alive, an etcd member going away or an etcd election costs a retry, not a fence.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable

from ftrun.store.job import JobStore

START_GRACE = 60.0
"""Seconds a node has to renew for the first time (its agent may still be starting over ssh), unless
``--rdzv-conf join_timeout`` says."""
RENEWALS_PER_TIMEOUT = 5
"""A follower renews this many times per ``--node-timeout`` in a store that does not keep leases (the
embedded one), where the leader counts the timeout from the renewals it sees at its looks."""
KEEPALIVES_PER_TTL = 3
"""A follower keeps its lease alive this many times per TTL (``--node-timeout``) where the store keeps leases
(etcd): clientv3 sends a keep-alive every TTL/3 (``lease.go``). At five per TTL, the keep-alives were two
thirds of an idle job's requests to etcd."""
RETRY_AFTER = 0.5
"""Seconds after a failed renewal before the next try (clientv3's ``retryConnWait``), unless the next renewal is
due sooner."""
LEADER_LOOKS_PER_TIMEOUT = 5
"""With etcd, a follower looks at its leader's lease this many times per ``--node-timeout`` (every 2 s at
10 s), so it knows the leader lost within a fifth of the timeout of etcd ending the lease. A watch on the
lease key answers the looks (no request); one look per timeout is a read
(:data:`LEADER_READS_PER_TIMEOUT`): 0.1 requests a second at 10 s. Twenty looks, each a mere look at what
the watch knows, cost 1,024 simulated agents on two cores more than the leases themselves (failover 46 s
against 14 s)."""
LEADER_READS_PER_TIMEOUT = 1
"""Of a follower's looks at its leader's lease, this many per ``--node-timeout`` read the key rather than
take the watch's word: a watch whose connection to its member was cut without a word (a partition that drops
packets) stays open and hears nothing. (A member cut off from etcd's leader ends its watches itself:
:data:`~ftrun.store.etcd_http.REQUIRE_LEADER`.)"""
EVICTION_CHECK_EVERY = 2
"""A follower looks for the leader's eviction mark at every this many renewals (the mark is a backstop: a
node cut off long enough to be evicted has fenced itself already)."""
FENCE_FRACTION = 0.75
"""A follower fences after this fraction of ``--node-timeout`` without a renewal: the leader, which counts
from when it saw the last renewal (later still), evicts it at the full timeout. The rest of the timeout is
the margin in which the fenced node's agent notices (every ``--monitor-interval``) and kills its workers;
``ftrun.config`` refuses a timeout that leaves no margin."""


def first_renewal_delay(interval: float, draw: float) -> float:
    """Seconds from a keeper's start to its first renewal, for a ``draw`` in [0, 1): somewhere in the first
    renewal ``interval``, so that the agents of a job, started in the same second, do not renew in the same
    instant ever after (a thousand keep-alives at once, every interval, where a thousand spread over it)."""
    return interval * (0.1 + 0.9 * draw)


def next_renewal(due: float, now: float, interval: float) -> float:
    """When the renewal after the one that was ``due`` then, and starts ``now``, is due: one ``interval`` after
    that one was due, so that a slow store's late answer does not put the next renewal off by as long (with
    each renewal an interval after the last answer, answers taking 8 s spaced the keep-alives of a 10 s etcd
    lease by 10 s, and it ended between two); at once if that is past when the answer comes. A renewal that
    starts more than an interval late (its thread held up) is followed at once by one more, then the cadence
    resumes from it: the renewals missed are not made up in a burst."""
    return max(due + interval, now)


def renewal_interval(timeout: float, native_leases: bool) -> float:
    """Seconds between a keeper's renewals, for ``--node-timeout`` ``timeout``, in a store that keeps leases
    itself (``native_leases``: etcd) or not."""
    return timeout / (KEEPALIVES_PER_TTL if native_leases else RENEWALS_PER_TIMEOUT)


def retry_at(due: float, now: float) -> float:
    """When to try again after a renewal that failed ``now``, the next being ``due``: :data:`RETRY_AFTER` on,
    or when it is due if that is sooner."""
    return min(due, now + RETRY_AFTER)


def fence_margin(node_timeout: float) -> float:
    """Seconds between a cut-off follower's fencing and its eviction by the leader, at the latest."""
    return node_timeout * (1 - FENCE_FRACTION)


class LeaseKeeper:
    """A node's lease: a thread renews it on a store connection of its own, with a short timeout (every
    follower's; node 0's too where the store outlives node 0, etcd, so that the followers see the leader go)."""

    def __init__(self, connect: Callable[[], JobStore], node_rank: int, timeout: float,
                 where: str = "the store") -> None:
        self.node_rank = node_rank
        self.where = where  # the store, as the fencing line names it
        self.timeout = timeout
        self.renewals = 0
        self.renewed = time.monotonic()
        self.evicted = False
        self.lapsed = False  # native leases: the store ended this node's lease
        self.held: int | None = None  # native leases: the store's lease id
        self._connect = connect
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="ftrun-lease", daemon=True)

    def start(self) -> None:
        """Start renewing."""
        self._thread.start()

    def stop(self) -> None:
        """Stop renewing, and wait for a renewal under way to end (it gives up within its connection's timeout):
        a thread still inside torch's store client when the interpreter exits aborts the process."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(self.timeout)

    def fence_reason(self, now: float) -> str | None:
        """Why this node must stop its workers at monotonic time ``now``, or None while its lease holds."""
        if self.evicted:
            return "the leader declared this node lost: stopping its workers"
        if self.lapsed:
            return (f"this node's lease in {self.where} ended (no keep-alive reached it for --node-timeout "
                    f"{self.timeout:g}, or the leader declared this node lost): the others count it lost; fencing")
        silent = now - self.renewed
        if silent > self.timeout * FENCE_FRACTION:
            return (f"could not renew this node's lease in {self.where} for {silent:.1f} s (--node-timeout "
                    f"{self.timeout:g}): fencing, so that a cut-off node does not train on alone")
        return None

    def _run(self) -> None:
        store = None
        interval = self.timeout / RENEWALS_PER_TIMEOUT  # the first renewal takes the lease, in any store
        due = time.monotonic() + first_renewal_delay(interval, random.random())
        while not self._stop.wait(max(0.0, due - time.monotonic())):
            sent = time.monotonic()  # the store saw the renewal after this: fencing counts from here
            due = next_renewal(due, sent, interval)
            try:
                store = store or self._connect()
                interval = renewal_interval(self.timeout, store.native_leases)  # from the next renewal on
                if not self._renew(store):
                    self.lapsed = True
                    return
                self.renewals += 1
                self.renewed = sent
                if not store.native_leases and self.renewals % EVICTION_CHECK_EVERY == 0:
                    self.evicted = store.is_evicted(self.node_rank)  # native: the eviction ends the lease
            except RuntimeError:
                store = None  # reconnect on the next try
                due = retry_at(due, time.monotonic())

    def _renew(self, store: JobStore) -> bool:
        """One renewal; False once the store ended this node's (native) lease."""
        if not store.native_leases:
            store.renew_lease(self.node_rank, self.renewals + 1)
            return True
        if self.held is None:
            self.held = store.take_lease(self.node_rank, self.renewals + 1, self.timeout)
            return True
        return store.keep_lease(self.held)


class NodeLeases:
    """Which nodes stopped renewing their leases: the leader's view of the followers (and, with etcd, a
    follower's view of the leader)."""


    def __init__(self, store: JobStore, nodes: list[int], timeout: float, now: float, evicts: bool = True,
                 looks_per_timeout: int = RENEWALS_PER_TIMEOUT, start_grace: float = START_GRACE,
                 reads_per_timeout: int | None = None) -> None:
        self.store = store
        self.evicts = evicts  # the leader marks a lost node evicted; a follower watching the leader does not
        self.look_every = timeout / looks_per_timeout
        # where fewer reads than looks (by default every look reads): the others take a watch's word
        self.read_every = max(1, looks_per_timeout // (reads_per_timeout or looks_per_timeout))
        self.looks = 0
        self.timeout = timeout
        self.start_grace = start_grace
        self.seen: dict[int, tuple[int, float]] = {n: (0, now + start_grace - timeout) for n in nodes}
        self.next_check = now

    def expired(self, now: float) -> list[tuple[int, float]]:
        """Nodes whose lease expired since the last call, with how many seconds ago each renewed last (at least
        the timeout)."""
        if now < self.next_check:
            return []
        self.next_check = now + self.look_every  # the leader: one look per renewal period
        lost = []
        native = self.store.native_leases  # a lease key there is a lease held; one gone, a lease ended
        renewals = self.store.lease_renewals(list(self.seen), watched=self.looks % self.read_every != 0)
        self.looks += 1
        for node, (count, when) in list(self.seen.items()):
            current = renewals[node]
            if current is not None and (current > count or (native and current == count)):
                self.seen[node] = (current, now)
            elif (native and count and current is None) or now - when > self.timeout:
                # an ended etcd lease was last kept alive at least its TTL ago, however recently it was seen held
                lost.append((node, max(now - when, self.timeout)))
        for node, _ in lost:
            self.forget(node)
        return lost

    def watch(self, node: int, now: float) -> None:
        """Count ``node``'s lease from ``now`` unless it has renewed already: a node that joined the running
        job, or one heard from (its workers started) before its first renewal. Lost if it does not renew within
        the timeout from then: a node cut off before its first renewal is not left to the start grace."""
        count, _ = self.seen.get(node, (0, now))
        if count == 0:
            self.seen[node] = (0, now)

    def forget(self, node: int) -> None:
        """Stop watching ``node`` (lost, or done) and tell it, should it come back, that it was evicted."""
        if self.seen.pop(node, None) is not None and self.evicts:
            try:
                self.store.evict(node)
            except RuntimeError:
                pass  # the mark is a backstop: a node cut off that long has fenced itself


def watch_leader_lease(store: JobStore, leader: int, timeout: float, now: float,
                       start_grace: float = START_GRACE) -> NodeLeases:
    """A follower's view of its leader's lease (etcd): :data:`LEADER_LOOKS_PER_TIMEOUT` looks per timeout, of
    which :data:`LEADER_READS_PER_TIMEOUT` read the key and the others take a watch's word; it marks nothing
    evicted."""
    return NodeLeases(store, [leader], timeout, now, evicts=False, looks_per_timeout=LEADER_LOOKS_PER_TIMEOUT,
                      start_grace=start_grace, reads_per_timeout=LEADER_READS_PER_TIMEOUT)
