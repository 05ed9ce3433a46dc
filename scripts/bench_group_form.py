"""What a newer plan's power to end a group's rendezvous costs: forming a fresh Gloo group of 4 processes
through torch's store waits vs through ftrun's InterruptibleStore (which waits in slices through a connection of
its own, so a newer plan can cut it).

    python scripts/bench_group_form.py [--generations 60] [--world 4]

Every process forms ``--generations`` fresh groups, one per generation prefix, alternating the two stores
(even generations plain ``PrefixStore``, odd ones ``InterruptibleStore`` over it), each after a store barrier
and closed only after another (so no one closes a group a peer is still connecting to). Rank 0 prints the
median time of ``init_process_group`` for each, and their ratio, measured in the same run.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from datetime import timedelta

import torch.distributed as dist

from ftrun.store.wire import StoreClient
from ftrun.worker.interruptible import InterruptibleStore


def form(store: dist.TCPStore, rank: int, world: int, generations: int) -> dict[str, list[float]]:
    times: dict[str, list[float]] = {"torch store": [], "InterruptibleStore": []}
    client = StoreClient(store.host, store.port, store.timeout.total_seconds())
    for gen in range(generations):
        kind = "torch store" if gen % 2 == 0 else "InterruptibleStore"
        barrier(store, f"arrived/{gen}", rank, world)
        prefix = dist.PrefixStore(f"g{gen}", store)
        group_store = prefix if gen % 2 == 0 else InterruptibleStore(client, lambda: False, f"g{gen}")
        started = time.perf_counter()
        dist.init_process_group("gloo", store=group_store, rank=rank, world_size=world, timeout=timedelta(seconds=60))
        times[kind].append(time.perf_counter() - started)
        barrier(store, f"formed/{gen}", rank, world)
        dist.destroy_process_group()
    return times


def barrier(store: dist.Store, name: str, rank: int, world: int) -> None:
    store.set(f"{name}/{rank}", "1")
    store.wait([f"{name}/{r}" for r in range(world)])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--generations", type=int, default=60)
    parser.add_argument("--world", type=int, default=4)
    parser.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    timeout = timedelta(seconds=120)
    if args.rank > 0:
        store = dist.TCPStore("127.0.0.1", args.port, args.world, False, timeout=timeout)
        form(store, args.rank, args.world, args.generations)
        return
    store = dist.TCPStore("127.0.0.1", 0, args.world, True, timeout=timeout, wait_for_workers=False)
    peers = [subprocess.Popen([sys.executable, __file__, "--rank", str(rank), "--port", str(store.port), "--world",
                               str(args.world), "--generations", str(args.generations)])
             for rank in range(1, args.world)]
    times = form(store, 0, args.world, args.generations)
    for peer in peers:
        peer.wait()
    medians = {kind: statistics.median(values) * 1000 for kind, values in times.items()}
    for kind, median in medians.items():
        print(f"{kind}: median {median:.2f} ms over {len(times[kind])} groups of {args.world}")
    print(f"ratio InterruptibleStore / torch store: {medians['InterruptibleStore'] / medians['torch store']:.2f}")


if __name__ == "__main__":
    main()
