"""The example's training, held to one step per 0.2 s while the file HOLD (environment) exists.

A drill test holds the job while it injects faults one after another, so the job cannot run out of steps
in the middle of them, then removes the file and the job runs to its end at full speed. With GATE=STEP
(environment) as well, every worker waits before step STEP until HOLD is gone (120 s at most), so a test
that waits for something slow (a node starting) cannot run out of steps however loaded the machine is;
the job's agents keep working meanwhile, and a new plan is taken at the step after. Without HOLD it is
plain training (the fault-free baseline). Every rank prints
`commit uid=<uid> rank=<r> world=<w> step=<n> loss=<float>` for each committed step.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from faulty_train import UID, ftrun, train_ddp, wait_until  # noqa: E402

HOLD = os.environ.get("HOLD", "")
GATE = int(os.environ.get("GATE", "-1"))
PACE = 0.2


def main() -> None:
    args = train_ddp.parse_args()
    ft = ftrun.init()
    training = train_ddp.build(args, ft, bucket_cap_mb=1)
    for step in ft.steps(args.steps):
        if HOLD and os.path.exists(HOLD):
            if step == GATE:
                wait_until(lambda: not os.path.exists(HOLD))
            else:
                time.sleep(PACE)  # held: the test is still drilling
        loss = train_ddp.train_step(ft, training, step)
        if loss is not None:
            print(f"commit uid={UID} rank={ft.rank} world={ft.world_size} step={step} loss={loss:.12g}", flush=True)


if __name__ == "__main__":
    main()
