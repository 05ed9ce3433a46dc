"""The ftrun example's training, plus a disk checkpoint every K steps when it runs without ftrun.

Under ftrun (FTRUN_UID set) the worker API recovers in place and no checkpoint is written. Under
torchrun rank 0 saves model, optimizer and step to ``--ckpt-dir`` every ``--ckpt-every`` committed
steps, and every rank resumes from that checkpoint when the group restarts. Either way the model,
data and step logic are examples/train_ddp.py's.

Rank 0 prints ``step=<n> loss=<float> t=<time.time()> world=<size> attempt=<a>`` per committed step,
where ``a`` is TORCHELASTIC_RESTART_COUNT: a line after a fault is recognisable by a smaller world
(ftrun) or a higher attempt (torchrun).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))

import torch  # noqa: E402

import attempt_store  # noqa: E402, F401  (keys per restart attempt: torchrun 2.14.1 reuses its store)
import ftrun  # noqa: E402
import train_ddp  # noqa: E402


def parse_args() -> argparse.Namespace:
    """This script's own flags; the example's flags (--steps, --width...) are parsed by train_ddp."""
    parser = argparse.ArgumentParser(description="examples/train_ddp.py with a checkpoint outside ftrun.")
    parser.add_argument("--ckpt-every", type=int, default=20, help="Checkpoint every K steps (0: never).")
    parser.add_argument("--ckpt-dir", default=".", help="Directory of the checkpoint file ckpt.pt.")
    return parser.parse_known_args()[0]


def save(directory: Path, training: train_ddp.Training, step: int) -> None:
    """Rank 0 writes the checkpoint atomically: a crash mid-write leaves the previous one intact."""
    if torch.distributed.get_rank() != 0:
        return
    path = directory / "ckpt.pt"
    partial = path.with_suffix(".partial")
    torch.save({"step": step, "model": training.model.state_dict(),
                "optimizer": training.optimizer.state_dict()}, partial)
    os.replace(partial, path)


def load(directory: Path, training: train_ddp.Training) -> int:
    """Restore model and optimizer from the checkpoint; the last step it holds, or -1 without one."""
    path = directory / "ckpt.pt"
    if not path.exists():
        return -1
    state = torch.load(path, map_location="cpu")
    training.model.load_state_dict(state["model"])
    training.optimizer.load_state_dict(state["optimizer"])
    return int(state["step"])


def run(example: Any, save: Callable[[Path, Any, int], None], load: Callable[[Path, Any], int]) -> None:
    """Train ``example`` (a module with parse_args, build, train_step); outside ftrun ``save`` to
    --ckpt-dir every --ckpt-every steps (on every rank) and ``load`` from it at the start."""
    own = parse_args()
    args = example.parse_args()
    ft = ftrun.init()
    training = example.build(args, ft)
    checkpoints = own.ckpt_every > 0 and "FTRUN_UID" not in os.environ
    directory = Path(own.ckpt_dir)
    resumed = load(directory, training) if checkpoints else -1
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    for step in ft.steps(args.steps):
        if step <= resumed:
            continue
        loss = example.train_step(ft, training, step)
        if loss is None:
            continue
        if ft.rank == 0:
            print(f"step={step} loss={loss:.12g} t={time.time():.6f} world={ft.world_size} attempt={attempt}",
                  flush=True)
        if checkpoints and (step + 1) % own.ckpt_every == 0:
            save(directory, training, step)


def main() -> None:
    run(train_ddp, save, load)


if __name__ == "__main__":
    main()
