"""Leader failover with the etcd backend: when node 0's lease runs out, the other nodes elect a new leader
through etcd, and it serves the process groups' store from then on.

The election is one create per candidate of the term's claim key (a transaction on its create revision: the
first to create it leads). The first three nodes by rank after the lost leader stand at once; the others
wait for their word first, and stand only if none comes. The winner serves a new TCPStore on its own node,
then says in etcd that it leads and where that store is; the others read it there. Who leads is decided once
per term, so two nodes can never both believe they lead the same term.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from ftrun.agent.follower import Follower
from ftrun.agent.forkserver import ForkServer
from ftrun.agent.leader import Leader
from ftrun.agent.node_links import NodeLinks
from ftrun.agent.nodes import Takeover
from ftrun.agent.store_access import STORE_TIMEOUT, StoreAccess
from ftrun.config import Endpoint
from ftrun.launcher.hosts import address_toward
from ftrun.protocol import node_of
from ftrun.store import keys
from ftrun.store.host import StoreHost
from ftrun.store.job import JobStore
from ftrun.store.leases import NodeLeases, watch_leader_lease
from ftrun.store.wire import StoreClient


@dataclass(frozen=True)
class Election:
    """The outcome of one term's election: who leads, and where it serves the process groups' store."""

    term: int
    node: int
    host: str
    port: int

    @property
    def store(self) -> str:
        """The store's "host:port", as plans carry it."""
        return f"{self.host}:{self.port}"


FIRST_CANDIDATES = 3
"""When the leader is lost, this many nodes (the first by rank after it) stand for leader at once; every other
node first waits for their word. A thousand nodes standing at once are a thousand writes through etcd's log
in the same second (measured: 14 s for a node's claim to be answered at 1,024 simulated nodes on 2 cores),
where three are three."""
PATIENCE = 0.5
"""How long a node that is not a first candidate waits for their word before it stands itself (should they
be lost too), as a fraction of --node-timeout (5 s at 10 s): time for them to see the lease end (at their
next look, up to a fifth of the timeout after it), serve the store and say so, and for their word to reach a
thousand nodes' watches on a loaded etcd (it took 1 to 13 s at 1,024 simulated nodes on 2 cores: a node
whose patience ran out before then stood, and a thousand claims came after all)."""


def stands_at_once(node: int, lost: int, nodes: int) -> bool:
    """Whether ``node`` stands for leader the moment it sees ``lost``, the leader, gone: one of the
    :data:`FIRST_CANDIDATES` ranks that follow ``lost`` among the job's ``nodes`` (wrapping around past the
    last)."""
    return 0 < (node - lost) % nodes <= FIRST_CANDIDATES


def elect(store: JobStore, term: int, node: int, lost: int, nodes: int, serve: Callable[[], tuple[str, int]],
          wait: float) -> Election | None:
    """Node ``node`` of ``nodes`` elects the leader of ``term`` after ``lost``: the winner serves the store
    (``serve``: its host and port) and announces itself; the others wait up to ``wait`` s (--node-timeout) for
    that announcement. A node that does not stand at once (:func:`stands_at_once`) first waits for the first
    candidates' word, for a :data:`PATIENCE` of ``wait``. None when no word came (the winner was
    lost too). Store errors (RuntimeError) are the caller's."""
    if not stands_at_once(node, lost, nodes):
        said = store.read_leader(term, wait * PATIENCE)
        if said is not None:
            return Election(term, *said)
    if store.stand_for_leader(term):
        host, port = serve()
        store.announce_leader(term, node, host, port)
        return Election(term, node, host, port)
    said = store.read_leader(term, wait)
    return Election(term, *said) if said is not None else None


def follow_elected(won: Election, lost: int, links: NodeLinks, follower: Follower, store: JobStore,
                   timeout: float) -> None:
    """Another node was elected: read its mail (and no more of the lost leader's, should it come back), watch
    its lease, and tell it of this node's workers."""
    leases = watch_leader_lease(store, won.node, timeout, time.monotonic())
    links.mail.drop_sender(keys.node_box(lost))
    links.mail.add_sender(keys.node_box(won.node), store, broadcasts=True)
    links.leader_lease = leases
    follower.follow(won.node, won.term, leases)


def watch_followers(links: NodeLinks, store: JobStore, lost: int, others: list[int], timeout: float) -> None:
    """This node was elected: read the other nodes' mail (and no more of the lost leader's), and judge their
    leases (no leader's to watch now)."""
    links.mail.drop_sender(keys.node_box(lost))
    for node in others:
        links.mail.add_sender(keys.node_box(node), store)
    links.leader_lease = None
    links.node_leases = NodeLeases(store, others, timeout, time.monotonic())


def start_leading(leader: Leader, follower: Follower, won: Election, takeover: Takeover) -> None:
    """What this node knew as a follower becomes its plan's starting point: the current generation, and its
    own workers' use of the worker API and last commits (the other nodes tell it of theirs). The lost leader's
    members used the API if this node's did: every rank runs the same script. They are lost once the other
    nodes have told of their workers; the plans from then on carry the new store."""
    m = leader.members
    m.plan = follower.plan
    m.adopted |= set(follower.joined)
    if follower.joined:
        m.adopted |= {uid for uid in follower.plan.members if node_of(uid) == takeover.lost}
    m.last_step.update(follower.last_step)
    m.trained |= set(follower.last_step)
    for uid in follower.joined:
        leader.watchdog.started(uid)
    leader.store_address = won.store
    leader.nodes.take_over(follower.plan, takeover)


def serve_group_store(access: StoreAccess, fork_server: ForkServer | None, toward: Endpoint) -> tuple[str, int]:
    """Serve a new store for the process groups on this node, on its address toward the old one (``toward``:
    the network the nodes share), once it answers: its host and port."""
    host = address_toward(toward.host, toward.port)
    access.store_host = StoreHost(Endpoint(host, 0), host)
    access.serve_hosted(fork_server)
    with StoreClient(host, access.store_host.port, STORE_TIMEOUT, wakeable=False) as served:
        served.check([keys.JOB])  # served: a client that came sooner could be turned away
    return host, access.store_host.port
