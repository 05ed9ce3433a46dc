"""Rank 2 of 4 dies while the others have all-reduces in flight; the survivors `_reconfigure` and all-reduce.

Prints `new all_reduce done` or `new all_reduce stalled` on each survivor: the evidence behind ftrun's
choice of a fresh group per generation over torch's in-place reconfigure (see ftrun/worker/planes.py).
"""

import os
import sys
from datetime import timedelta

import torch
import torch.distributed as dist

rank, port = int(sys.argv[1]), int(sys.argv[2])
store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=300))
dist.init_process_group("gloo", store=dist.PrefixStore("pg", store), rank=rank, world_size=8,
                        enable_reconfigure=True)


def reconfigure(gen: int, members: list[int]) -> None:
    store.set(f"handle/{gen}/{rank}", dist._get_reconfigure_handle())
    store.wait([f"handle/{gen}/{m}" for m in members])
    handles = [store.get(f"handle/{gen}/{m}").decode() for m in members]
    dist._reconfigure(uuid=gen, handles=handles, timeout=timedelta(seconds=10)).wait()


reconfigure(1, [0, 1, 2, 3])
dist.all_reduce(torch.ones(1))
if rank == 2:
    os._exit(0)
in_flight = [dist.all_reduce(torch.ones(1 << 18), async_op=True) for _ in range(4)]
store.set(f"issued/{rank}", "1")
store.wait(["all_issued"])
reconfigure(2, [0, 1, 3])
try:
    dist.all_reduce(torch.ones(4), async_op=True).wait(timeout=timedelta(seconds=3))
    print("new all_reduce done", flush=True)
except RuntimeError:
    print("new all_reduce stalled", flush=True)
os._exit(0)
