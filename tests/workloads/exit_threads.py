"""The example's training (3 steps); then the session's exit shut-down, and this process's OS threads after it.

Prints `threads after shut-down: <n>`: the backends' threads are joined there only if nothing still holds the
default group (a DDP's comm-hook state did), so that none can run into the interpreter's teardown.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))

import ftrun  # noqa: E402
import train_ddp  # noqa: E402


def main() -> None:
    args = train_ddp.parse_args()
    ft = ftrun.init()
    training = train_ddp.build(args, ft)
    train_ddp.train(ft, args.steps, lambda step: train_ddp.train_step(ft, training, step))
    ft._shut_down()  # what atexit runs
    print(f"threads after shut-down: {len(os.listdir('/proc/self/task'))}", flush=True)


if __name__ == "__main__":
    main()
