"""Form a group through env:// (Gloo, or ``--backend nccl`` on this worker's GPU) and all_reduce (rank + 1)
twice; print the sums.

--crash-first-attempt: the last rank raises between the two all_reduces on attempt 0, after rank 0 left a key
of its own in the store the workers rendezvous in; on the next attempt rank 0 says which keys its store holds:
the one left, and the job's record (``ftrun/job``, where the job's store is the workers').
"""

import argparse
import os

import torch
import torch.distributed as dist

parser = argparse.ArgumentParser()
parser.add_argument("--crash-first-attempt", action="store_true")
parser.add_argument("--backend", default="gloo")
args = parser.parse_args()
attempt = os.environ["TORCHELASTIC_RESTART_COUNT"]
device = torch.device("cpu")
if args.backend == "nccl":
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
    torch.cuda.set_device(device)
dist.init_process_group(args.backend)
rank, world = dist.get_rank(), dist.get_world_size()
if args.crash_first_attempt and rank == 0:
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False)
    if attempt == "0":
        store.set("left_by_attempt_0", "1")
    else:
        print(f"attempt {attempt} store holds: left_by_attempt_0 {store.check(['left_by_attempt_0'])}, "
              f"ftrun/job {store.check(['ftrun/job'])}", flush=True)
for step in range(2):
    t = torch.tensor([rank + 1.0], device=device)
    dist.all_reduce(t)
    print(f"attempt {attempt} step {step} sum {t.item():g} world {world}", flush=True)
    if step == 0 and rank == world - 1 and attempt == "0" and args.crash_first_attempt:
        raise RuntimeError(f"rank {rank} crashes on attempt 0")
dist.destroy_process_group()
