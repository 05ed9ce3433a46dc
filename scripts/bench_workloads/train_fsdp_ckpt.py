"""examples/train_fsdp.py, plus a torch.distributed.checkpoint every K steps when it runs without ftrun.

Under ftrun (FTRUN_UID set) the worker API recovers in place from the buddies' memory and no checkpoint is
written. Under torchrun every rank saves its shard of model and optimizer with ``dcp.save`` into
``--ckpt-dir/step_<n>`` every ``--ckpt-every`` committed steps (rank 0 then names it in ``latest``), and every
rank resumes from the latest one when the group restarts.

Rank 0 prints ``step=<n> loss=<float> t=<time.time()> world=<size> attempt=<a>`` per committed step, as
train_ckpt.py does.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))

import torch  # noqa: E402
import torch.distributed.checkpoint as dcp  # noqa: E402
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict  # noqa: E402

import attempt_store  # noqa: E402, F401  (keys per restart attempt: torchrun 2.14.1 reuses its store)
import train_ckpt  # noqa: E402
import train_fsdp  # noqa: E402


def save(directory: Path, training: train_fsdp.Training, step: int) -> None:
    """Every rank writes its shards (a collective); rank 0 then points ``latest`` at the finished checkpoint."""
    model_state, optimizer_state = get_state_dict(training.model, training.optimizer)
    dcp.save({"model": model_state, "optimizer": optimizer_state}, checkpoint_id=str(directory / f"step_{step}"))
    if torch.distributed.get_rank() == 0:
        (directory / "latest.partial").write_text(str(step))
        os.replace(directory / "latest.partial", directory / "latest")


def load(directory: Path, training: train_fsdp.Training) -> int:
    """Every rank reads its shards of the latest checkpoint; the step it holds, or -1 without one."""
    latest = directory / "latest"
    if not latest.exists():
        return -1
    step = int(latest.read_text())
    model_state, optimizer_state = get_state_dict(training.model, training.optimizer)
    state = {"model": model_state, "optimizer": optimizer_state}
    dcp.load(state, checkpoint_id=str(directory / f"step_{step}"))
    set_state_dict(training.model, training.optimizer, model_state_dict=state["model"],
                   optim_state_dict=state["optimizer"])
    return step


def main() -> None:
    train_ckpt.run(train_fsdp, save, load)


if __name__ == "__main__":
    main()
