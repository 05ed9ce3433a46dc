"""Rank 1 fails once rank 0 is up; rank 0 waits forever. Both write MARKER_DIR/started_<rank> with their pid.

usage: fail_rank1.py MARKER_DIR [raise|record|sigkill]
  raise:   rank 1 raises RuntimeError("boom from rank 1")
  record:  the same, inside torch's @record decorator (which writes the error file)
  sigkill: rank 1 kills itself with SIGKILL
"""

import os
import signal
import sys
import time

marker_dir, mode = sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else "raise"
rank = int(os.environ["RANK"])


def mark_started() -> None:
    path = os.path.join(marker_dir, f"started_{rank}")
    with open(path + ".tmp", "w") as f:
        f.write(str(os.getpid()))
    os.replace(path + ".tmp", path)


def explode() -> None:
    raise RuntimeError("boom from rank 1")


def main() -> None:
    mark_started()
    if rank != 1:
        while True:
            signal.pause()
    while not os.path.exists(os.path.join(marker_dir, "started_0")):
        time.sleep(0.01)
    if mode == "sigkill":
        os.kill(os.getpid(), signal.SIGKILL)
    explode()


if mode == "record" and rank == 1:  # rank 0 need not pay for importing torch
    from torch.distributed.elastic.multiprocessing.errors import record

    main = record(main)

if __name__ == "__main__":
    main()
