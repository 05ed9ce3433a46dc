"""Form a Gloo group through env:// and all_reduce (rank + 1) twice; print the sums.

--crash-first-attempt: rank 1 raises between the two all_reduces on attempt 0.
"""

import os
import sys

import torch
import torch.distributed as dist

attempt = os.environ["TORCHELASTIC_RESTART_COUNT"]
dist.init_process_group("gloo")
rank = dist.get_rank()
for step in range(2):
    t = torch.tensor([rank + 1.0])
    dist.all_reduce(t)
    print(f"attempt {attempt} step {step} sum {t.item():g} world {dist.get_world_size()}", flush=True)
    if step == 0 and rank == 1 and attempt == "0" and "--crash-first-attempt" in sys.argv:
        raise RuntimeError("rank 1 crashes on attempt 0")
dist.destroy_process_group()
