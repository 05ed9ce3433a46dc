"""How a node's agent reaches the job's store: serving it (node 0, embedded), connecting to it, and finding,
with etcd, where node 0 serves the process groups' TCPStore.

ftrun's own keys (records, mailboxes, leases, plans) live in the job's store: the TCPStore node 0 serves, or
an etcd cluster. The process groups always rendezvous through node 0's TCPStore; with etcd node 0 publishes
its address there and the other nodes read it before they start workers.
"""

from __future__ import annotations

import os

from ftrun.agent.forkserver import ForkRefused, ForkServer
from ftrun.config import Endpoint, LaunchConfig
from ftrun.console import Console
from ftrun.errors import UsageError
from ftrun.store import keys
from ftrun.store.auth import Seal
from ftrun.store.client import open_client_retrying
from ftrun.store.etcd import EtcdKeyValue
from ftrun.store.host import StoreHost
from ftrun.store.job import JobStore
from ftrun.store.kv import KeyValue
from ftrun.store.leases import fence_margin
from ftrun.store.wire import StoreClient

STORE_TIMEOUT = 300.0
"""Seconds an agent's store calls may wait (a follower waits this long for node 0 to serve the store)."""


class StoreAccess:
    """This node's way to the job's store: the connections its agent, mailbox reader and lease use."""

    def __init__(self, config: LaunchConfig, store_host: StoreHost | None, seal: Seal, console: Console) -> None:
        self.config = config
        self.store_host = store_host  # None: another process serves the store (node 0, or the hostfile launcher)
        self.seal = seal
        self.console = console
        self.lifeline: int | None = None  # the store's process (forked by the fork server) lives while this is open

    def connect(self, timeout: float = STORE_TIMEOUT) -> JobStore:
        """A new client connection to ftrun's keys in the job's store: the etcd cluster with that backend, else
        the TCPStore (torch-free, so a mailbox reader's waits on its bell can be interrupted at stop and time
        out without a log line)."""
        if self.config.etcd is not None:
            return JobStore(EtcdKeyValue(self.config.etcd, timeout), self.seal)
        host = self.store_host.client_host if self.store_host is not None else self.config.store.host
        return JobStore(StoreClient(host, self.config.store.port, timeout), self.seal)

    def reach_etcd(self) -> None:
        """With etcd, ask the cluster once before anything else starts (GPU health, the fork server), so that
        one that does not answer, or refuses these credentials, is the launch's one line (``EtcdUnavailable``
        for :func:`~ftrun.store.etcd_config.answering`), not its third."""
        if self.config.etcd is None:
            return
        kv = EtcdKeyValue(self.config.etcd, STORE_TIMEOUT)
        try:
            kv.check([keys.JOB])
        finally:
            kv.close()

    def find_group_store(self) -> Endpoint:
        """With etcd, where node 0 serves the process groups' store, as it published it there (a node other
        than 0 learns it before it starts workers: they rendezvous through it)."""
        store = self.connect()
        where = store.read_group_store(0.0)
        if where is None:
            self.console.progress(f"waiting for node 0 to say where it serves the process groups' store: up to "
                                  f"{STORE_TIMEOUT:.0f} s")
            where = store.read_group_store(STORE_TIMEOUT)
            self.console.progress(None)
        if where is None:
            raise UsageError(f"node 0 did not publish its store in etcd ({self.config.etcd.describe()}, run id "
                             f"{self.config.run_id}) within {STORE_TIMEOUT:.0f} s: is it running, with the same "
                             "--rdzv-id?")
        return Endpoint(*where)

    def open(self, leader: bool, fork_server: ForkServer | None) -> tuple[JobStore, JobStore | None]:
        """Serve the store (or connect to it): this agent's connection to ftrun's keys, and to the process
        groups' store where this agent serves it or leads (None elsewhere)."""
        config = self.config
        if self.store_host is not None:
            group_store = JobStore(self.serve_hosted(fork_server), self.seal)
            if config.etcd is None:
                return group_store, group_store
            # with several nodes, node 0 fences too when etcd does not answer: calls short enough to do it in time
            store = self.connect(fence_margin(config.node_timeout) / 2 if config.multinode else STORE_TIMEOUT)
            store.publish_group_store(config.store.host, config.store.port)
            return store, group_store
        if leader:
            store = self.connect()
            return store, store
        if config.etcd is not None:  # calls short enough to fence in time, as below
            return self.connect(fence_margin(config.node_timeout) / 2), None
        # calls short enough that its loop, cut off, still fences itself before the leader evicts it
        where = f"{config.store.host}:{config.store.port}"
        server = "the --hostfile launcher" if config.under_launcher else "node 0"
        store = JobStore(open_client_retrying(
            config.store.host, config.store.port, fence_margin(config.node_timeout) / 2, STORE_TIMEOUT,
            lambda: self.console.progress(f"waiting for the store at {where} ({server} serves it): up to "
                                          f"{STORE_TIMEOUT:.0f} s")), self.seal)
        self.console.progress(None)
        return store, None

    def close(self) -> None:
        """Let the store's process end, if the fork server serves it."""
        if self.lifeline is not None:
            os.close(self.lifeline)
            self.lifeline = None

    def serve_hosted(self, server: ForkServer | None) -> KeyValue:
        """Serve the store this agent hosts from a process the fork server forks (torch is imported there, so
        this process never imports it), else from this process; this agent's connection to it (a newly elected
        leader serves one too)."""
        host = self.store_host
        if server is not None and server.ready():
            try:
                _, self.lifeline = server.fork_store(host.client_host, host.port, host.sock.fileno())
            except ForkRefused as refused:
                self.console.notice(f"ftrun: {refused}; ftrun serves the store itself", style="yellow")
            else:
                host.close()  # the store's process has the socket now
                return StoreClient(host.client_host, host.port, STORE_TIMEOUT)
        return host.start()
