"""One GPU, NCCL: form a group through ftrun's Communicator, abort it, re-form it (world size 1), time each.

Run by scripts/gpu_check.sh on a machine with a GPU; prints one line per phase and the torch/NCCL versions.
"""

from __future__ import annotations

import time
from datetime import timedelta

import torch
import torch.distributed as dist

from ftrun.protocol import Plan
from ftrun.worker.group import Communicator


def timed(label: str, action) -> None:
    start = time.perf_counter()
    action()
    torch.cuda.synchronize()
    print(f"{label:<28} {1000 * (time.perf_counter() - start):8.1f} ms", flush=True)


def all_reduce_once() -> None:
    tensor = torch.ones(1 << 20, device="cuda")
    dist.all_reduce(tensor)
    assert float(tensor[0]) == 1.0, "a world of one must leave the tensor unchanged"


def main() -> None:
    assert torch.cuda.is_available(), "no GPU visible"
    torch.cuda.set_device(0)
    print(f"torch {torch.__version__}, NCCL {'.'.join(map(str, torch.cuda.nccl.version()))}, "
          f"{torch.cuda.get_device_name(0)}", flush=True)
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    comm = Communicator(store, attempt=0, uid=0, backend="nccl", timeout=timedelta(seconds=60))
    timed("form generation 0", lambda: comm.form(Plan(0, [0]), lambda: False))
    timed("all_reduce (4 MiB)", all_reduce_once)
    timed("abort (NCCL)", comm.abort)
    timed("re-form generation 1", lambda: comm.form(Plan(1, [0]), lambda: False))
    timed("all_reduce after re-form", all_reduce_once)
    print("gpu check: ok", flush=True)


if __name__ == "__main__":
    main()
