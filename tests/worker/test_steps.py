"""The comm hook's future and the step's waits keep a GPU's stream order: what the CPU can check of it.

On a GPU, NCCL marks its work's future done when the kernel is queued; whoever reads the result must have
its stream wait for the collective's, which a future does only if it was made with the tensor's device (the
hook's), or through ``wait()`` (the step's own waits). The CPU has no streams, so here the hook is given a
bucket that says it lives on a GPU (a stand-in at the lowest layer: its device), and the future it returns is
checked to be made with that device; ``scripts/gpu_check.py`` checks the order itself on a GPU.
"""

from __future__ import annotations

import threading

import pytest
import torch

from ftrun.worker import steps
from ftrun.worker.steps import CollectiveFailed, StepCollectives, future_devices


@pytest.mark.fast
def test_a_future_handing_on_a_gpu_tensor_is_made_with_its_device():
    assert future_devices(torch.device("cpu")) == []
    assert future_devices(torch.device("cuda", 1)) == [torch.device("cuda", 1)]


class _Bucket:
    """DDP's GradBucket, as the hook uses it: a buffer, here one that says it is on GPU 0."""

    class Buffer:
        device = torch.device("cuda", 0)

    def buffer(self) -> Buffer:
        return self._buffer

    def __init__(self) -> None:
        self._buffer = self.Buffer()


class _Done:
    """A collective whose future is complete (with ``error``, if given), as NCCL's is once it is queued."""

    def __init__(self, error: str | None = None) -> None:
        self.future: torch.futures.Future = torch.futures.Future()
        if error:
            self.future.set_exception(RuntimeError(error))
        else:
            self.future.set_result([torch.zeros(1)])

    def get_future(self) -> torch.futures.Future:
        return self.future


class _Group:
    def __init__(self, error: str | None = None) -> None:
        self.error = error
        self.issued = 0

    def allreduce(self, tensors: list) -> _Done:
        self.issued += 1
        return _Done(self.error)


@pytest.mark.fast
def test_the_hooks_future_for_a_gpu_bucket_carries_the_gpu(monkeypatch):
    made: list[list[torch.device]] = []

    class Recording(torch.futures.Future):
        def __init__(self, *, devices=None):
            made.append(list(devices or []))
            super().__init__()  # a CUDA device cannot be named to a future where torch has no CUDA

    monkeypatch.setattr(steps.torch.futures, "Future", Recording)
    collectives = StepCollectives(threading.Condition(), None)
    collectives.begin()
    bucket = _Bucket()
    result = collectives.hook(_Group(), bucket)
    assert made[0] == [torch.device("cuda", 0)]  # the hook's own (the collective's stand-in makes the next)
    assert result.done() and result.value() is bucket.buffer()
    assert not collectives.failed


@pytest.mark.fast
def test_a_failed_collective_fails_the_step_and_its_wait():
    collectives = StepCollectives(threading.Condition(), None)
    collectives.begin()
    group = _Group("connection closed by peer")
    collectives.hook(group, _Bucket())
    assert collectives.failed and collectives.error == "connection closed by peer"
    with pytest.raises(CollectiveFailed, match="connection closed by peer"):
        collectives.wait(group.allreduce([]))
