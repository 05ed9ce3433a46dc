"""Train the same MLP sharded with FSDP2 (fully_shard) and AdamW; under ftrun it survives lost workers in place.

    ftrun --nproc-per-node 4 examples/train_fsdp.py --steps 50
    torchrun --nproc-per-node 4 examples/train_fsdp.py --steps 50    # same numbers, no recovery

Each rank holds one shard of the parameters and of AdamW's moments. Under ftrun every shard is also
copied into another rank's host memory after each committed step (``--refresh-every K``: every K steps),
so a lost shard comes back from there: with a spare the world keeps its size, without one the state is
re-sharded over the survivors. Stopped (SIGTERM, Ctrl-C), every rank saves its shard's last copies, and
``ftrun --resume-from <run dir> ...`` resumes from them on any number of ranks. The output is train_ddp.py's:
rank 0 prints ``step=<n> loss=<float>`` for every committed step and ``final step=<n> loss=<float>`` at the
end (the global batch's mean loss).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from torch.distributed.fsdp import fully_shard

sys.path.insert(0, str(Path(__file__).resolve().parent))

import ftrun  # noqa: E402
import train_ddp  # noqa: E402
from train_ddp import Training  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The example's flags: train_ddp.py's, AdamW's learning rate, and how often state is copied."""
    parser = train_ddp.make_parser("Train a small MLP sharded with FSDP2 on synthetic data.", lr=1e-3)
    parser.add_argument("--refresh-every", type=int, default=1,
                        help="copy each rank's shard into its buddy's memory every K committed steps (0: never)")
    return parser.parse_known_args(argv)[0]


def shard(model: torch.nn.Module) -> torch.nn.Module:
    """fully_shard each linear layer, then the whole model, over all ranks."""
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer)
    fully_shard(model)
    return model


def build(args: argparse.Namespace, ft: ftrun.Session) -> Training:
    """Data, the sharded model and its optimizer; protected with the function that rebuilds them over a
    new world (after a recovery the training holds the rebuilt ones)."""
    device = train_ddp.local_device()
    inputs, targets = (tensor.to(device) for tensor in train_ddp.make_data(args))
    batches = ftrun.GlobalBatches(args.samples, args.global_batch, seed=args.seed)
    training: Training | None = None

    def rebuild() -> dict:
        model = shard(train_ddp.make_model(args).to(device))
        optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
        if training is not None:
            training.model, training.optimizer = model, optimizer
        return {"model": model, "optimizer": optimizer}

    objects = rebuild()
    training = Training(objects["model"], objects["optimizer"], inputs, targets, batches)
    ft.protect(rebuild=rebuild, refresh_every=args.refresh_every, **objects)
    return training


def train_step(ft: ftrun.Session, t: Training, step: int) -> float | None:
    """One step; FSDP's collectives run inside forward and backward, where ft.guard() catches a peer's loss."""
    loss = None
    with ft.guard():
        # FSDP averages gradients over the ranks; the loss is already divided by the global batch. (A
        # divide factor of 1 would need ReduceOp.PREMUL_SUM, which Gloo lacks.)
        loss = train_ddp.local_loss(ft, t, step, scale=ft.world_size)
    return ft.commit(t.optimizer, loss)


def main() -> None:
    args = parse_args()
    ft = ftrun.init(args.backend)
    training = build(args, ft)
    train_ddp.train(ft, args.steps, lambda step: train_step(ft, training, step))


if __name__ == "__main__":
    main()
