"""Why ftrun forms a fresh group per generation instead of torch's in-place `_reconfigure` (Gloo).

If this test starts failing, torch has fixed in-flight collectives under reconfigure: revisit
ftrun/worker/planes.py, which could then re-form the group in place.
"""

from __future__ import annotations

import subprocess
import sys
from datetime import timedelta

import pytest
import torch.distributed as dist


@pytest.mark.compat
@pytest.mark.skipif(not hasattr(dist, "_reconfigure"), reason="this torch has no in-place reconfigure")
def test_gloo_reconfigure_leaves_collectives_of_a_dead_peer_blocking_the_group(workload, free_port):
    port = free_port()
    store = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False,
                          timeout=timedelta(seconds=300))
    procs = [subprocess.Popen([sys.executable, workload("reconfigure_stall.py"), str(rank), str(port)],
                              stdout=subprocess.PIPE, text=True) for rank in range(4)]
    procs[2].wait(timeout=300)  # a hang guard: four torch imports on a busy machine take long
    store.wait([f"issued/{rank}" for rank in (0, 1, 3)], timedelta(seconds=300))
    store.set("all_issued", "1")
    outputs = [procs[r].communicate(timeout=300)[0] for r in (0, 1, 3)]
    assert any("stalled" in out for out in outputs), outputs

