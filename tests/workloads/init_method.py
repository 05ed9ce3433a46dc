"""A plain torchrun script (as torch's own test_script_init_method.py): init_process_group with an explicit
``--init-method`` (tcp://HOST:PORT or env://), one all-reduce, and an exit without destroy_process_group."""

import argparse
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F

parser = argparse.ArgumentParser()
parser.add_argument("--init-method", required=True)
args = parser.parse_args()
dist.init_process_group(backend="gloo", init_method=args.init_method, world_size=int(os.environ["WORLD_SIZE"]),
                        rank=int(os.environ["RANK"]))
rank, world = dist.get_rank(), dist.get_world_size()
one_hot = F.one_hot(torch.tensor(rank), num_classes=world)
dist.all_reduce(one_hot)
assert torch.sum(one_hot).item() == world
print("Done")
