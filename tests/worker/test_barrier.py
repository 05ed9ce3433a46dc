"""The generation barrier and the planes' rendezvous after it, on a real TCPStore and Gloo in this process:
bounded by the group timeout with one clear error, and ended at once by a newer plan."""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch.distributed as dist

from ftrun.protocol import Plan
from ftrun.store import keys
from ftrun.worker.interruptible import Superseded
from ftrun.worker.planes import Planes

pytestmark = pytest.mark.fast


@pytest.fixture
def store() -> dist.TCPStore:
    return dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60))


def test_a_worker_that_never_reaches_the_barrier_is_named_once_the_group_timeout_is_over(store):
    comm = Planes(store, attempt=0, uid=0, backend="gloo", timeout=timedelta(seconds=0.5))
    with pytest.raises(RuntimeError, match=r"^ftrun: worker \[1\] did not reach generation 1's barrier within 0\.5 s"):
        comm.form(Plan(1, [0, 1]), lambda: False)
    assert not dist.is_initialized()


def test_a_newer_plan_ends_the_wait_at_the_barrier(store):
    comm = Planes(store, attempt=0, uid=0, backend="gloo", timeout=timedelta(minutes=30))
    with pytest.raises(Superseded):
        comm.form(Plan(1, [0, 1]), lambda: True)


def test_a_newer_plan_ends_the_groups_rendezvous_when_a_member_died_after_the_barrier(store):
    # worker 1 reached the barrier, then died before it formed its group: Gloo's rendezvous waits for its
    # address (for the group timeout, 30 minutes), until the plan that replaces this one ends the wait
    store.set(keys.arrived(0, 1, 1), "1")
    comm = Planes(store, attempt=0, uid=0, backend="gloo", timeout=timedelta(minutes=30))
    asked = []

    def superseded() -> bool:  # the barrier passes without asking (everyone arrived): Gloo's wait asks
        asked.append(True)
        return True

    with pytest.raises(Superseded):
        comm.form(Plan(1, [0, 1]), superseded)
    assert asked and not dist.is_initialized()
