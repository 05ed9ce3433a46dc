"""A minimal plain-DDP training loop without ftrun: the baseline the benchmarks compare against.

Same model, data and global batch as examples/train_ddp.py (MLP of width 512, 4 layers, 128 samples per
step split over the ranks), but stock DDP with averaged gradients and no ftrun API. Rank 0
prints ``step=<n> attempt=<a> loss=<float> t=<time.time()>`` after every optimizer step, where ``a`` is
TORCHELASTIC_RESTART_COUNT; the loss is rank 0's local loss (no extra collective).

With ``--fail-at S`` the worker of RANK 1 prints ``fail attempt=0 t=<time.time()>`` and exits with
code 1 just before step S on attempt 0 only, so the launcher restarts the group once.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
import train_ddp  # noqa: E402  (the example's data and model; it imports no ftrun runtime at module level)

import attempt_store  # noqa: F401  (keys per restart attempt: torchrun 2.14.1 reuses its store)


def parse_args() -> argparse.Namespace:
    """The example's flags, and ``--fail-at``."""
    parser = argparse.ArgumentParser(description="Plain DDP on synthetic data (no ftrun API).")
    parser.add_argument("--fail-at", type=int, default=-1, help="RANK 1 exits with code 1 before this step "
                        "on attempt 0 (-1: never).")
    known, _ = parser.parse_known_args()
    return argparse.Namespace(**vars(train_ddp.parse_args()), **vars(known))


def build(args: argparse.Namespace) -> tuple[DistributedDataParallel, torch.optim.Optimizer, torch.Tensor,
                                              torch.Tensor]:
    """Data and a seeded model, exactly as the ftrun example builds them; the model wrapped in stock DDP."""
    inputs, targets = train_ddp.make_data(args)
    model = DistributedDataParallel(train_ddp.make_model(args))
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    return model, optimizer, inputs, targets


def share(args: argparse.Namespace, step: int) -> torch.Tensor:
    """This rank's contiguous share of step ``step``'s global batch, drawn from a per-epoch permutation."""
    epoch, offset = divmod(step * args.global_batch, args.samples)
    order = torch.randperm(args.samples, generator=torch.Generator().manual_seed(args.seed * 1_000_003 + epoch))
    return torch.tensor_split(order[offset:offset + args.global_batch], dist.get_world_size())[dist.get_rank()]


def fail_if_planted(args: argparse.Namespace, step: int, attempt: int) -> None:
    """Exit with an error on RANK 1 before step ``--fail-at`` of attempt 0."""
    if step == args.fail_at and attempt == 0 and dist.get_rank() == 1:
        sys.stdout.write(f"fail attempt={attempt} t={time.time():.6f}\n")  # one write: no interleaving
        sys.stdout.flush()
        sys.exit(1)


def main() -> None:
    args = parse_args()
    if args.samples % args.global_batch:
        raise SystemExit("--samples must be a multiple of --global-batch")
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    dist.init_process_group("gloo")
    model, optimizer, inputs, targets = build(args)
    for step in range(args.steps):
        fail_if_planted(args, step, attempt)
        index = share(args, step)
        loss = F.mse_loss(model(inputs[index]), targets[index])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if dist.get_rank() == 0:
            sys.stdout.write(f"step={step} attempt={attempt} loss={loss.item():.12g} t={time.time():.6f}\n")
            sys.stdout.flush()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
