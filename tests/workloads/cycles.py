"""The example's training driven by a test that plays the agent (tests/worker/test_planes.py): each cycle, a new
generation arrives while ranks 0 and 1 wait in the gradient all-reduce for rank 2.

Rank 2 (uid 2) waits before each step in HOLD (comma list) for the store key ``go/<step>``, which the test
sets once it has sent the next plan. Every rank prints ``commit uid=<uid> step=<n> gen=<g> fds=<open file
descriptors> threads=<OS threads>`` per committed step.
"""

from __future__ import annotations

import os
import sys
from datetime import timedelta
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))

import torch.distributed as dist  # noqa: E402

import ftrun  # noqa: E402
import train_ddp  # noqa: E402

UID = int(os.environ["FTRUN_UID"])
HOLD = {int(s) for s in os.environ.get("HOLD", "").split(",") if s}


def main() -> None:
    args = train_ddp.parse_args()
    ft = ftrun.init()
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                          timeout=timedelta(seconds=60))
    training = train_ddp.build(args, ft, bucket_cap_mb=0.05)
    for step in ft.steps(args.steps):
        if UID == 2 and step in HOLD:
            store.wait([f"go/{step}"])
        if train_ddp.train_step(ft, training, step) is not None:
            print(f"commit uid={UID} step={step} gen={ft.gen} fds={len(os.listdir('/proc/self/fd'))} "
                  f"threads={len(os.listdir('/proc/self/task'))}", flush=True)


if __name__ == "__main__":
    main()
