"""The example's training with faults planted at exact points, for the recovery tests.

FAULTS (environment) is a comma list of KIND:STEP:UID, where UID is the worker's FTRUN_UID (its initial
rank): kill (SIGKILL itself before the step), exception (raise in the step), allreduce (SIGKILL itself
inside the gradient all-reduce: after the first bucket's all-reduce has started on every rank),
recovery (SIGKILL itself while re-forming the group after the first fault). Faults are planted in the
first attempt only, so a group restart runs clean.
Every rank prints `commit uid=<uid> step=<n> loss=<float>` for each committed step.
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))

import ftrun  # noqa: E402
import train_ddp  # noqa: E402
from ftrun.worker import planes  # noqa: E402

UID = int(os.environ.get("FTRUN_UID", os.environ.get("RANK", "0")))
FIRST_ATTEMPT = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
FAULTS = [f.split(":") for f in os.environ.get("FAULTS", "").split(",") if f] if FIRST_ATTEMPT else []


def die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def plant(kind: str, step: int, uid: int, training: train_ddp.Training, current: int) -> None:
    if uid != UID or step != current:
        return
    if kind == "kill":
        die()
    if kind == "exception":
        raise RuntimeError(f"planted exception at step {step}")
    if kind == "allreduce":
        first = next(iter(training.model.module.parameters()))
        first.register_hook(lambda grad: die())
    if kind == "recovery":
        original = planes.Planes.form
        planes.Planes.form = lambda self, plan, superseded: die() if plan.gen >= 1 else original(
            self, plan, superseded)


def main() -> None:
    args = train_ddp.parse_args()
    ft = ftrun.init()
    training = train_ddp.build(args, ft, bucket_cap_mb=1)
    for step in ft.steps(args.steps):
        for kind, at, uid in FAULTS:
            plant(kind, int(at), int(uid), training, step)
        loss = train_ddp.train_step(ft, training, step)
        if loss is not None:
            print(f"commit uid={UID} rank={ft.rank} world={ft.world_size} step={step} loss={loss:.12g}", flush=True)


if __name__ == "__main__":
    main()
