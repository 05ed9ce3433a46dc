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
from ftrun.launcher.hosts import address_toward
from ftrun.store import keys
from ftrun.store.auth import Seal
from ftrun.store.client import open_client_retrying
from ftrun.store.etcd import EtcdKeyValue
from ftrun.store.host import StoreHost
from ftrun.store.job import JobStore
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
        self.attempt_store: tuple[StoreHost, int | None] | None = None  # a restarted attempt's, and its lifeline

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

    def open(self, leader: bool, fork_server: ForkServer | None) -> JobStore:
        """Serve the store (or connect to it): this agent's connection to ftrun's keys."""
        config = self.config
        if self.store_host is not None:
            self.serve_hosted(fork_server)
            if config.etcd is None:  # this agent's connection to it (served here: torch's own handle)
                host = self.store_host
                if host.store is not None:
                    return JobStore(host.store, self.seal)
                return JobStore(StoreClient(host.client_host, host.port, STORE_TIMEOUT), self.seal)
            # with several nodes, node 0 fences too when etcd does not answer: calls short enough to do it in time
            store = self.connect(fence_margin(config.node_timeout) / 2 if config.multinode else STORE_TIMEOUT)
            store.publish_group_store(config.store.host, config.store.port)
            return store
        if leader:
            return self.connect()
        if config.etcd is not None:  # calls short enough to fence in time, as below
            return self.connect(fence_margin(config.node_timeout) / 2)
        # calls short enough that its loop, cut off, still fences itself before the leader evicts it
        where = f"{config.store.host}:{config.store.port}"
        server = "the --hostfile launcher" if config.under_launcher else "node 0"
        store = JobStore(open_client_retrying(
            config.store.host, config.store.port, fence_margin(config.node_timeout) / 2, STORE_TIMEOUT,
            lambda: self.console.progress(f"waiting for the store at {where} ({server} serves it): up to "
                                          f"{STORE_TIMEOUT:.0f} s")), self.seal)
        self.console.progress(None)
        return store

    def close(self) -> None:
        """Let the stores' processes end, where the fork server serves them."""
        if self.lifeline is not None:
            os.close(self.lifeline)
            self.lifeline = None
        self._end_attempt_store()

    def serve_hosted(self, server: ForkServer | None) -> None:
        """Serve the store this agent hosts (a newly elected leader serves one too)."""
        self.lifeline = self._serve(self.store_host, server)

    def serve_attempt_store(self, server: ForkServer | None) -> Endpoint:
        """Serve a new, empty store for the workers of the attempt the leader restarts the group as, where they
        reach it; the last attempt's, if it was one of these, ends (its workers have).

        torchrun does the same since 2.4: torch's env:// rendezvous stopped prefixing its keys per attempt then,
        so the new group's ``init_process_group`` would read the dead group's addresses in the old store
        (pytorch#135712). Deleting them takes a server that lists its keys, which torch 2.6's does not. It is
        served next to the job's store (on its address, where this node serves that), else on this node's
        address toward it (the network the nodes share); the workers queue on its socket until it serves.
        """
        config, hosted = self.config, self.store_host
        listen = hosted.listen if hosted is not None else address_toward(config.store.host, config.store.port)
        host = StoreHost(Endpoint(listen, 0), listen)
        try:
            lifeline = self._serve(host, server)
        except BaseException:
            host.close()  # its socket, where torch's server did not take it
            raise
        self._end_attempt_store()
        self.attempt_store = host, lifeline
        return Endpoint(config.master_addr if hosted is not None else listen, host.port)

    def _end_attempt_store(self) -> None:
        """Stop serving the last restarted attempt's store, if there is one."""
        if self.attempt_store is not None:
            host, lifeline = self.attempt_store
            if lifeline is not None:
                os.close(lifeline)
            host.store = None  # served here: torch's server stops with its last handle
            self.attempt_store = None

    def _serve(self, host: StoreHost, server: ForkServer | None) -> int | None:
        """Serve ``host``'s store from a process the fork server forks (torch is imported there, so this process
        never imports it): the write end of its lifeline; else from this process (``host.store``): None."""
        if server is not None and server.ready():
            try:
                _, lifeline = server.fork_store(host.client_host, host.port, host.sock.fileno())
            except ForkRefused as refused:
                self.console.notice(refused.notice("ftrun serves the store itself"), style="yellow")
            else:
                host.close()  # the store's process has the socket now
                return lifeline
        host.start()
        return None
