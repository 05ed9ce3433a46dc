"""examples/train_fsdp.py with the time each rank spends on keeping its shard redundant, printed at exit.

``Redundancy.refresh`` (at a commit: wait for the previous copy if it is still in flight, snapshot the shard,
start the copy, which then overlaps the next step) and ``Redundancy.wait`` (where the session waits for a copy
outside a refresh) are the only redundancy work on the step path; both are timed with time.perf_counter(), a
wait inside a refresh once, and each rank prints ``redundancy rank=<r> steps=<n> ms_per_step=<float>`` when it
exits, which the benchmark reads next to the wall-clock step time (on a loaded machine the latter varies more
than the copy costs).
"""

from __future__ import annotations

import atexit
import os
import runpy
import sys
import time
from pathlib import Path

from ftrun.worker import redundancy

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "train_fsdp.py"
spent = {"seconds": 0.0, "steps": 0, "depth": 0}


def timed(name: str) -> None:
    """Wrap a Redundancy method so that the time spent in it is added up (a timed call inside another once)."""
    original = getattr(redundancy.Redundancy, name)

    def run(self, *args, **kwargs):  # noqa: ANN001, ANN202 -- a transparent wrapper
        started = time.perf_counter()
        spent["depth"] += 1
        try:
            return original(self, *args, **kwargs)
        finally:
            spent["depth"] -= 1
            if not spent["depth"]:
                spent["seconds"] += time.perf_counter() - started

    setattr(redundancy.Redundancy, name, run)


def count_step(self, *args, **kwargs):  # noqa: ANN001, ANN202 -- counts the calls of due(), one per commit
    spent["steps"] += 1
    return due(self, *args, **kwargs)


due = redundancy.Redundancy.due
redundancy.Redundancy.due = count_step
timed("refresh")
timed("wait")
atexit.register(lambda: print(f"redundancy rank={os.environ.get('RANK')} steps={spent['steps']} "
                              f"ms_per_step={spent['seconds'] * 1000 / max(1, spent['steps']):.3f}", flush=True))
sys.argv = [str(EXAMPLE), *sys.argv[1:]]
runpy.run_path(str(EXAMPLE), run_name="__main__")
