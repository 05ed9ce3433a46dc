"""Train a small MLP with DDP on synthetic data; under ftrun it survives the loss of workers in place.

    ftrun --nproc-per-node 4 examples/train_ddp.py --steps 50
    torchrun --nproc-per-node 4 examples/train_ddp.py --steps 50    # same numbers, no recovery

Rank 0 of the current generation prints ``step=<n> loss=<float>`` for every committed step and
``final step=<n> loss=<float>`` at the end; the loss is the mean over the whole global batch, so it is
the same number whatever the world size.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

import ftrun


def make_parser(description: str, lr: float) -> argparse.ArgumentParser:
    """The flags both examples share (the model, the data, the run)."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--lr", type=float, default=lr)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--global-batch", type=int, default=128)
    parser.add_argument("--samples", type=int, default=4096)
    parser.add_argument("--backend", default=None,
                        help="The data plane's backend (default: nccl with a GPU, else gloo); e.g. cuda:gloo to "
                             "let several workers share one GPU, which NCCL refuses.")
    return parser


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The example's flags."""
    return make_parser("Train a small MLP with DDP on synthetic data.", lr=1.0).parse_known_args(argv)[0]


@dataclass
class Training:
    """Everything one worker trains with."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    inputs: torch.Tensor
    targets: torch.Tensor
    batches: ftrun.GlobalBatches


def make_data(args: argparse.Namespace) -> tuple[torch.Tensor, torch.Tensor]:
    """Synthetic inputs and targets (a random teacher), the same on every rank: seeded."""
    generator = torch.Generator().manual_seed(args.seed)
    inputs = torch.randn(args.samples, args.width, generator=generator)
    teacher = torch.randn(args.width, args.width, generator=generator)
    return inputs, torch.tanh(inputs @ teacher / args.width**0.5)


def make_model(args: argparse.Namespace) -> torch.nn.Module:
    """The MLP, initialised the same on every rank: seeded."""
    torch.manual_seed(args.seed)
    layers: list[torch.nn.Module] = []
    for _ in range(args.layers - 1):
        layers += [torch.nn.Linear(args.width, args.width), torch.nn.Tanh()]
    return torch.nn.Sequential(*layers, torch.nn.Linear(args.width, args.width))


def local_device() -> torch.device:
    """This worker's GPU (LOCAL_RANK's, made the current one) where there is a GPU, else the CPU."""
    if not torch.cuda.is_available():
        return torch.device("cpu")
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
    torch.cuda.set_device(device)
    return device


def build(args: argparse.Namespace, ft: ftrun.Session, **ddp_options: Any) -> Training:
    """Data, model, optimizer; protected so a peer can restore them."""
    device = local_device()
    inputs, targets = make_data(args)
    model = ft.ddp(make_model(args).to(device), **ddp_options)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    ft.protect(model=model, optimizer=optimizer)
    batches = ftrun.GlobalBatches(args.samples, args.global_batch, seed=args.seed)
    return Training(model, optimizer, inputs.to(device), targets.to(device), batches)


def local_loss(ft: ftrun.Session, t: Training, step: int, scale: float = 1.0) -> torch.Tensor:
    """This rank's share of the step's loss (the shares sum to the global batch's mean), backpropagated
    multiplied by ``scale``."""
    index = t.batches.share(step, ft.rank, ft.world_size).to(t.inputs.device)
    per_sample = F.mse_loss(t.model(t.inputs[index]), t.targets[index], reduction="none").mean(dim=1)
    loss = per_sample.sum() / t.batches.global_batch  # summed over ranks: the mean over the global batch
    ft.backward(loss, scale)  # loss.backward(), with the loss's sum over the ranks running beside it
    return loss


def train_step(ft: ftrun.Session, t: Training, step: int) -> float | None:
    """One step on this rank's share of the global batch; the global mean loss, or None if abandoned."""
    return ft.commit(t.optimizer, local_loss(ft, t, step))


def train(ft: ftrun.Session, steps: int, step_fn: Callable[[int], float | None]) -> None:
    """The loop both examples share: rank 0 prints each committed step's loss, and the last one."""
    last = None
    for step in ft.steps(steps):
        loss = step_fn(step)
        if loss is not None:
            last = (step, loss)
            if ft.rank == 0:
                print(f"step={step} loss={loss:.12g}", flush=True)
    if ft.rank == 0 and last is not None:
        print(f"final step={last[0]} loss={last[1]:.12g}", flush=True)


def main() -> None:
    args = parse_args()
    ft = ftrun.init(args.backend)
    training = build(args, ft)
    train(ft, args.steps, lambda step: train_step(ft, training, step))


if __name__ == "__main__":
    main()
