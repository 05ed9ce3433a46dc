"""Form a Gloo group through env:// and all_reduce (rank + 1) twice; print the sums.

--crash-first-attempt: rank 1 raises between the two all_reduces on attempt 0, after rank 0 left a key of its
own in the store the workers rendezvous in; on the next attempt rank 0 says which keys its store holds: the
one left, and the job's record (``ftrun/job``, where the job's store is the workers').
"""

import os
import sys

import torch
import torch.distributed as dist

attempt = os.environ["TORCHELASTIC_RESTART_COUNT"]
crash = "--crash-first-attempt" in sys.argv
dist.init_process_group("gloo")
rank = dist.get_rank()
if crash and rank == 0:
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False)
    if attempt == "0":
        store.set("left_by_attempt_0", "1")
    else:
        print(f"attempt {attempt} store holds: left_by_attempt_0 {store.check(['left_by_attempt_0'])}, "
              f"ftrun/job {store.check(['ftrun/job'])}", flush=True)
for step in range(2):
    t = torch.tensor([rank + 1.0])
    dist.all_reduce(t)
    print(f"attempt {attempt} step {step} sum {t.item():g} world {dist.get_world_size()}", flush=True)
    if step == 0 and rank == 1 and attempt == "0" and crash:
        raise RuntimeError("rank 1 crashes on attempt 0")
dist.destroy_process_group()
