"""State transfer from a rank at the last committed step to a rank behind it, against raw broadcasts.

4 CPU worker processes form one generation's planes through ftrun's own ``Planes`` (Gloo data group and
Gloo control group) on a store this script hosts. Each worker protects a model whose state is ``--size``
MB of float32: half in 32 MiB tensors (sent alone, straight from and into their own memory), half in
1 MiB tensors (grouped into buckets). Rank 3 holds different values (a rank behind); rank 0 sends it
its state with ``ftrun.worker.transfer`` (ranks 1 and 2 take no part), then rank 3 checks it received
exactly rank 0's state. In the same run, on the same data group: ``dist.broadcast`` of one flat tensor of
the same bytes from rank 0 to all, and ``dist.send``/``recv`` of it from rank 0 to rank 3.

Per run, the time from a control-plane barrier to the receiver holding the loaded state (throughput =
bytes / time; for the raw baselines, to the end of the collective, their flat tensor allocated and filled
before the clock starts), and the peak resident memory above what each process held before, sampled every
millisecond (psutil) on the source and on the receiver. A raw broadcast needs a whole flat copy of the
state on every rank; the transfer should need one bucket (``ftrun.worker.transfer.BUCKET_BYTES``).

    python scripts/bench_transfer.py --size 256 --size 1024 --repeats 3
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path

import psutil
import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench_runs import command_line, machine  # noqa: E402

from ftrun.protocol import Plan  # noqa: E402
from ftrun.worker import transfer  # noqa: E402
from ftrun.worker.planes import Planes  # noqa: E402
from ftrun.worker.state import load_into, snapshot  # noqa: E402

WORLD = 4
SOURCE, BEHIND = 0, 3
BIG, SMALL = 32 << 20, 1 << 20


def parse_args() -> argparse.Namespace:
    """The benchmark's flags."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", type=int, action="append", help="State size in MB (repeatable; 256 and 1024).")
    parser.add_argument("--repeats", type=int, default=3, help="Transfers of each kind per size (3).")
    parser.add_argument("--worker", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    return parser.parse_args()


class Peak:
    """The highest resident memory of this process above a baseline, sampled every millisecond."""

    def __init__(self) -> None:
        self.process = psutil.Process()
        self.base = self.process.memory_info().rss
        self.peak = self.base
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()

    def _sample(self) -> None:
        while not self._stop.wait(0.001):
            self.peak = max(self.peak, self.process.memory_info().rss)

    def extra_mb(self) -> float:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self.process.memory_info().rss)
        return (self.peak - self.base) / 2**20


def make_state(megabytes: int, seed: int) -> torch.nn.Module:
    """A module holding ``megabytes`` MB of float32 parameters, half in 32 MiB tensors, half in 1 MiB ones."""
    generator = torch.Generator().manual_seed(seed)
    half = megabytes << 19
    sizes = [BIG // 4] * (half // BIG) + [SMALL // 4] * (half // SMALL)
    return torch.nn.ParameterList([torch.nn.Parameter(torch.rand(n, generator=generator)) for n in sizes])


def worker(rank: int, port: int, sizes: list[int], repeats: int) -> None:
    """One of the 4 processes: for each size, the transfer and the two raw baselines, ``repeats`` times each."""
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=300))
    planes = Planes(store, 0, rank, "gloo", timedelta(minutes=10))
    planes.form(Plan(0, list(range(WORLD))), lambda: False)
    control = transfer.p2p_on_backend(planes.control)
    route = transfer.Route({"cpu": transfer.p2p_on_group(dist.group.WORLD)}, {"cpu": torch.device("cpu")}, control)

    def barrier() -> None:
        planes.control.allreduce([torch.zeros(1)]).wait()

    for megabytes in sizes:
        objects = {"model": make_state(megabytes, seed=0 if rank != BEHIND else 1)}
        results: dict[str, list] = {"transfer": [], "broadcast": [], "send": []}
        for _ in range(repeats):
            if rank == BEHIND:
                objects["model"] = make_state(megabytes, seed=1 + len(results["transfer"]))
            barrier()
            peak, start = Peak(), time.perf_counter()
            if rank == SOURCE:
                transfer.send(snapshot(objects, 7), [BEHIND], route)
            elif rank == BEHIND:
                load_into(transfer.receive(SOURCE, snapshot(objects, -2), route), objects)
            elapsed, extra = time.perf_counter() - start, peak.extra_mb()
            barrier()
            results["transfer"].append((elapsed, extra))
        if rank == BEHIND:
            expected = make_state(megabytes, seed=0)
            assert all(torch.equal(a, b) for a, b in zip(objects["model"], expected)), "state differs"
            del expected
        for kind in ("broadcast", "send"):
            for _ in range(repeats):
                barrier()
                peak = Peak()
                flat = torch.full((megabytes << 18,), float(rank))  # allocated and touched before the clock
                barrier()
                start = time.perf_counter()
                if kind == "broadcast":
                    dist.broadcast(flat, SOURCE)
                elif rank == SOURCE:
                    dist.send(flat, BEHIND)
                elif rank == BEHIND:
                    dist.recv(flat, SOURCE)
                elapsed, extra = time.perf_counter() - start, peak.extra_mb()
                del flat
                barrier()
                results[kind].append((elapsed, extra))
        print(json.dumps({"rank": rank, "size": megabytes, **results}), flush=True)
        del objects
    planes.destroy()


def main() -> None:
    args = parse_args()
    sizes = args.size or [256, 1024]
    if args.worker is not None:
        worker(args.worker, args.port, sizes, args.repeats)
        return
    print(f"{WORLD} CPU workers, Gloo, source rank {SOURCE} -> rank {BEHIND} ({machine()}; "
          f"{psutil.virtual_memory().available / 2**30:.1f} GiB available)", flush=True)
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    size_flags = [flag for megabytes in sizes for flag in ("--size", str(megabytes))]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen([sys.executable, __file__, "--worker", str(rank), "--port", str(store.port),
                               "--repeats", str(args.repeats), *size_flags], env=env, stdout=subprocess.PIPE,
                              text=True) for rank in range(WORLD)]
    reports = [json.loads(line) for proc in procs for line in proc.communicate()[0].splitlines() if line.startswith("{")]
    if any(proc.returncode for proc in procs):
        raise SystemExit(f"a worker failed: exit codes {[proc.returncode for proc in procs]}")
    print(f"\n{'size':>7s} {'what':28s} {'median s':>9s} {'GB/s':>6s} {'vs broadcast':>13s} "
          f"{'extra MB source':>16s} {'extra MB receiver':>18s}")
    for megabytes in sizes:
        by_rank = {r["rank"]: r for r in reports if r["size"] == megabytes}
        times = {kind: statistics.median(t for t, _ in by_rank[BEHIND][kind]) for kind in ("transfer", "broadcast", "send")}
        for kind, label in (("transfer", "ftrun transfer (p2p, buckets)"), ("broadcast", "raw dist.broadcast to all"),
                            ("send", "raw dist.send to rank 3")):
            source = max(extra for _, extra in by_rank[SOURCE][kind])
            receiver = max(extra for _, extra in by_rank[BEHIND][kind])
            print(f"{megabytes:5d}MB {label:28s} {times[kind]:9.3f} {megabytes / 1024 / times[kind]:6.2f} "
                  f"{times['broadcast'] / times[kind]:13.2f} {source:16.0f} {receiver:18.0f}")
    print(f"\nbucket: {transfer.BUCKET_BYTES >> 20} MiB; target: transfer throughput >= 0.8x raw broadcast, extra "
          f"memory about one bucket\n{command_line()}")


if __name__ == "__main__":
    main()
