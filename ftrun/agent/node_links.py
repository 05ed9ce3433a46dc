"""A node's standing links to the other nodes through the job's store: its mailbox reader, its outbox, and
the leases (its own, and those it watches)."""

from __future__ import annotations

import time
from dataclasses import dataclass

from ftrun import protocol
from ftrun.agent.store_access import StoreAccess
from ftrun.config import LaunchConfig
from ftrun.store import keys
from ftrun.store.job import JobStore
from ftrun.store.leases import LeaseKeeper, NodeLeases, watch_leader_lease
from ftrun.store.mailbox import MailReader, Outbox


@dataclass
class NodeLinks:
    """What a node's agent keeps open to the others for the whole run."""

    mail: MailReader
    """This node's mailbox, read by a thread that rings the agent's loop."""
    outbox: Outbox
    """This agent's messages to the other agents, numbered for the run."""
    node_leases: NodeLeases | None
    """The leader's view of the followers' leases (several nodes)."""
    lease: LeaseKeeper | None
    """This node's own lease: a follower's, and node 0's too with etcd (which outlives it)."""
    leader_lease: NodeLeases | None
    """With etcd, a follower's view of node 0's lease."""

    def stop(self) -> None:
        """Stop the mailbox reader and the lease's renewals."""
        self.mail.stop()
        if self.lease is not None:
            self.lease.stop()


def start_links(config: LaunchConfig, leader: bool, store: JobStore, access: StoreAccess, mail_w: int) -> NodeLinks:
    """Start this node's mailbox reader (ringing ``mail_w``) and lease, each thread with its own connection
    to the store (from ``access``); ``store`` is the agent's."""
    senders = [keys.node_box(n) for n in range(1, config.max_nodes)] if leader else [keys.LEADER_BOX]
    if leader and config.under_launcher:
        senders.append(keys.LAUNCHER)
    mail = MailReader(access.connect, keys.node_box(config.node_rank), mail_w, protocol.mail_problem, tuple(senders),
                      broadcasts=() if leader else (keys.LEADER_BOX,))
    mail.start()
    node_leases = lease = leader_lease = None
    if config.multinode and leader:
        node_leases = NodeLeases(store, list(range(1, config.min_nodes)), config.node_timeout, time.monotonic(),
                                 start_grace=config.node_start_timeout)
    if config.multinode and (not leader or config.etcd is not None):
        # a renewal that hangs gives up in time to retry before the lease would fence this node; node 0
        # renews one too where the store outlives it (etcd), and the followers watch it there
        lease = LeaseKeeper(lambda: access.connect(config.node_timeout / 4), config.node_rank, config.node_timeout,
                            "etcd" if config.etcd else "node 0's store")
        lease.start()
    if config.multinode and not leader and config.etcd is not None:
        leader_lease = watch_leader_lease(store, 0, config.node_timeout, time.monotonic(), config.node_start_timeout)
    return NodeLinks(mail, Outbox(store, keys.node_box(config.node_rank)), node_leases, lease, leader_lease)


def say_ended(config: LaunchConfig, access: StoreAccess) -> None:
    """A follower's agent ends: say so in the store, on a connection of its own that gives up in a quarter of
    --node-timeout (a store gone or out of reach has nobody waiting for the word)."""
    try:
        access.connect(config.node_timeout / 4).say_ended(config.node_rank)
    except RuntimeError:
        pass


def await_followers(config: LaunchConfig, store: JobStore, nodes: list[int]) -> None:
    """The leader told ``nodes`` how the job ended; where its process serves the store (the embedded one ends
    with it), wait up to --node-timeout for each to say it is ending, so that none loses the store before it
    has read that word (it would fence, and end with exit code 1 whatever the job's outcome)."""
    if config.etcd is None and nodes:
        store.await_ended(nodes, config.node_timeout)
