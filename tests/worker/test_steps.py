"""The step's collectives: what the comm hook sums and hands DDP, the loss it carries, failures, and the GPU's
stream order that the hook's future and the step's waits keep, as far as the CPU can check it.

On a GPU, NCCL marks its work's future done when the kernel is queued; whoever reads the result must have
its stream wait for the collective's, which a future does only if it was made with the tensor's device (the
hook's), or through ``wait()`` (the step's own waits). The CPU has no streams, so here the hook is given a
bucket that says it lives on a GPU (a stand-in at the lowest layer: its device), and the future it returns is
checked to be made with that device; ``scripts/gpu_check.py`` checks the order itself on a GPU.
"""

from __future__ import annotations

import threading
import weakref
from datetime import timedelta
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from ftrun.worker import backends, steps
from ftrun.worker.steps import CollectiveFailed, StepCollectives, future_devices


@pytest.mark.fast
def test_a_future_handing_on_a_gpu_tensor_is_made_with_its_device():
    assert future_devices(torch.device("cpu")) == []
    assert future_devices(torch.device("cuda", 1)) == [torch.device("cuda", 1)]


def step_begun() -> StepCollectives:
    """The collectives of a step just begun, with no notice of the first one entered."""
    collectives = StepCollectives(threading.Condition(), None)
    collectives.begin()
    return collectives


class _OnGpu:
    """A bucket's buffer that says it is on GPU 0 (all the hook asks of it before issuing its all-reduce)."""

    device = torch.device("cuda", 0)


class _Bucket:
    """DDP's GradBucket, as the hook uses it: its buffer (by default a CPU tensor)."""

    def __init__(self, buffer: object = None) -> None:
        self._buffer = torch.zeros(4) if buffer is None else buffer

    def buffer(self) -> object:
        return self._buffer


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
    """A data group: each all-reduce completes (failed with ``error``), or is refused as NCCL refuses one on a
    communicator its watchdog aborted (``refuse``: a DistBackendError, or another error)."""

    def __init__(self, error: str | None = None, refuse: Exception | None = None) -> None:
        self.error = error
        self.refuse = refuse
        self.issued = 0

    def allreduce(self, tensors: list) -> _Done:
        if self.refuse is not None:
            raise self.refuse
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
    collectives = step_begun()
    bucket = _Bucket(_OnGpu())
    result = collectives.hook(_Group(), bucket)
    assert made[0] == [torch.device("cuda", 0)]  # the hook's own (the collective's stand-in makes the next)
    assert result.done() and result.value() is bucket.buffer()
    assert not collectives.failed


@pytest.mark.fast
def test_a_failed_collective_fails_the_step_and_its_wait():
    collectives = step_begun()
    group = _Group("connection closed by peer")
    collectives.hook(group, _Bucket())
    assert collectives.failed and collectives.error == "connection closed by peer"
    with pytest.raises(CollectiveFailed, match="connection closed by peer"):
        collectives.wait(group.allreduce([]))


ABORTED = "NCCL communicator was aborted on rank 1. Original reason for failure was: NCCL error: remote process exited"


@pytest.mark.fast
def test_a_collective_the_backend_refuses_fails_the_step_instead_of_leaving_backward():
    collectives = step_begun()
    group = _Group(refuse=dist.DistBackendError(ABORTED + "\n(C++ frames)"))
    bucket = _Bucket()
    result = collectives.hook(group, bucket)
    assert result.done() and result.value() is bucket.buffer()
    assert collectives.failed and collectives.error == ABORTED
    collectives.start_loss(torch.ones(()), lambda _: group)  # the loss sum: the step fails, nothing raises
    assert collectives.finish(None, lambda _: group) == (False, None)
    with pytest.raises(CollectiveFailed, match="was aborted"):
        collectives.issue(lambda: group.allreduce([]))


@pytest.mark.fast
def test_a_collective_called_wrongly_is_not_taken_for_a_failed_step():
    collectives = step_begun()
    wrong = _Group(refuse=RuntimeError("No backend type associated with device type cpu"))
    with pytest.raises(RuntimeError, match="No backend type"):
        collectives.hook(wrong, _Bucket())
    with pytest.raises(RuntimeError, match="No backend type"):
        collectives.issue(lambda: wrong.allreduce([]))


@pytest.mark.fast
def test_a_failure_the_backend_recorded_fails_the_step_at_its_commit():
    collectives = step_begun()
    collectives.hook(_Group(), _Bucket())
    assert collectives.finish(None, lambda _: _Group(), lambda: "the data plane's nccl backend reported TIMEOUT") \
        == (False, None)
    assert collectives.failed and collectives.error == "the data plane's nccl backend reported TIMEOUT"
    collectives.begin()
    collectives.hook(_Group(), _Bucket())
    assert collectives.finish(None, lambda _: _Group(), lambda: None) == (True, None)


class _Running:
    """A collective still running: its future completes when the test completes it."""

    def __init__(self) -> None:
        self.future: torch.futures.Future = torch.futures.Future()

    def get_future(self) -> torch.futures.Future:
        return self.future


@pytest.mark.fast
def test_a_hooks_callback_runs_until_the_bucket_is_handed_on_and_an_exit_waits_for_it():
    # set_result runs the waiters' callbacks (DDP's) on the backend's thread that completed the collective: an
    # exiting worker frees its groups only once quiet(), and freeing one joins that thread (holding the GIL,
    # where torch's groups have no shutdown()), so quiet() must not count the callback done before that
    collectives = step_begun()
    running = _Running()
    bucket = _Bucket()
    result = collectives.hook(SimpleNamespace(allreduce=lambda tensors: running), bucket)
    handed_on, release = threading.Event(), threading.Event()
    result.add_done_callback(lambda _: (handed_on.set(), release.wait(30)))
    backend = threading.Thread(target=running.future.set_result, args=([bucket.buffer()],))
    backend.start()
    try:
        assert handed_on.wait(30)
        assert not collectives.quiet(0)
    finally:
        release.set()
        backend.join(30)
    assert collectives.quiet(0)
    assert result.value() is bucket.buffer() and not collectives.failed


@pytest.mark.fast
def test_a_hooks_spent_callback_is_freed_by_the_next_hook_where_no_step_begins():
    # the callbacks torch dropped are kept for the training thread to free (not the backend's): a DDP trained in a
    # loop of its own, with no steps() to begin each step, must not keep every step's buckets
    collectives = step_begun()
    buffer = torch.zeros(4)
    kept = weakref.ref(buffer)
    collectives.hook(_Group(), _Bucket(buffer))
    del buffer
    assert kept() is not None  # held by the spent callback's closure
    collectives.hook(_Group(), _Bucket())
    assert kept() is None


class _Recording:
    """A real group that records what each all-reduce sums: its number of elements and its type."""

    def __init__(self, group: dist.ProcessGroup) -> None:
        self.group = group
        self.reduced: list[tuple[int, torch.dtype]] = []

    def allreduce(self, tensors: list[torch.Tensor]) -> dist.Work:
        self.reduced.append((tensors[0].numel(), tensors[0].dtype))
        return self.group.allreduce(tensors)


def gloo_backend(store: dist.Store, rank: int, size: int) -> dist.ProcessGroupGloo:
    """A bare Gloo backend of ``size`` ranks on ``store``."""
    return dist.ProcessGroupGloo(store, rank, size, timedelta(seconds=60))


def two_ranks(step, group=gloo_backend) -> list:  # noqa: ANN001 -- step(rank, collectives, group) -> its result
    """Run ``step`` on the two ranks of a real Gloo group (made by ``group``), one thread each; their results."""
    store = dist.HashStore()
    results: list = [None, None]

    def rank(r: int) -> None:
        collectives, group_of_rank = step_begun(), _Recording(group(store, r, 2))
        results[r] = (step(r, collectives, group_of_rank), group_of_rank.reduced)
        # as a worker's session does before it frees its groups: torch 2.6 frees one joining its threads holding
        # the GIL, and one of them still on its way to run or drop a callback of the hook's would never end
        assert collectives.quiet(60)

    threads = [threading.Thread(target=rank, args=(r,)) for r in (0, 1)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert not any(thread.is_alive() for thread in threads)
    return results


LOSSES = (0.25, 1.5)


def a_step(dtype: torch.dtype, buckets: int = 2, with_first_bucket: bool = True):  # noqa: ANN201
    """One step of a rank: its loss started, ``buckets`` buckets of ``dtype`` through the hook, the commit."""
    def step(r: int, collectives: StepCollectives, group: _Recording) -> tuple:
        loss = torch.tensor(LOSSES[r], dtype=torch.float32)
        collectives.start_loss(loss, lambda _: group, with_first_bucket=with_first_bucket)
        grads = [torch.full((4,), float(r + 1 + b), dtype=dtype) for b in range(buckets)]
        summed = [collectives.hook(group, _Bucket(grad)).wait() for grad in grads]  # what DDP reads the sums from
        assert [s.shape for s in summed] == [g.shape for g in grads]
        return collectives.finish(loss, lambda _: group), [s.tolist() for s in summed]
    return step


@pytest.mark.fast
def test_the_loss_rides_on_the_steps_first_bucket_and_both_come_back_summed():
    for (finished, grads), reduced in two_ranks(a_step(torch.float32)):
        assert finished == (True, sum(LOSSES))
        assert grads == [[3.0] * 4, [5.0] * 4]  # 1+2, 2+3: the bucket summed, without the loss's element
        assert reduced == [(5, torch.float32), (4, torch.float32)]  # no collective of the loss's own


@pytest.mark.fast
def test_a_loss_no_bucket_can_carry_is_summed_on_its_own():
    for (finished, grads), reduced in two_ranks(a_step(torch.bfloat16)):  # a 16-bit bucket would round it
        assert finished == (True, sum(LOSSES))
        assert grads == [[3.0] * 4, [5.0] * 4]
        assert reduced == [(1, torch.float64), (4, torch.bfloat16), (4, torch.bfloat16)]  # first, beside the pass
    for (finished, _), reduced in two_ranks(a_step(torch.float32, buckets=0)):  # no DDP gradients this pass
        assert finished == (True, sum(LOSSES)) and reduced == [(1, torch.float64)]  # at the commit
    for (finished, _), reduced in two_ranks(a_step(torch.float32, with_first_bucket=False)):  # under no_sync()
        assert finished == (True, sum(LOSSES)) and reduced == [(1, torch.float64), (4, torch.float32),
                                                               (4, torch.float32)]


ERROR_TYPE = getattr(torch._C._distributed_c10d, "ErrorType", None)  # what get_error answers, where torch has it


class _Backend:
    """NCCL's backend as its watchdog leaves it: ``get_error`` says what it recorded (torch's own values)."""

    def __init__(self, name: str) -> None:
        self.error = getattr(ERROR_TYPE, name) if ERROR_TYPE is not None else SimpleNamespace(name=name)

    def get_error(self):  # noqa: ANN201
        return self.error


class _DataGroup:
    def __init__(self, backend: _Backend) -> None:
        self.backend = backend
        self.asked: list[torch.device] = []

    def _get_backend(self, device: torch.device) -> _Backend:
        self.asked.append(device)
        return self.backend


@pytest.mark.fast
@pytest.mark.compat  # torch's own group and its get_error, on each release
def test_the_failure_a_backends_watchdog_recorded_is_read_in_a_line():
    group = _DataGroup(_Backend("COMM_ERROR"))
    assert backends.async_error(group, "gloo") == "the data plane's gloo backend reported COMM_ERROR"
    assert group.asked == [torch.device("cpu")]  # no GPU here: the device the data plane takes
    assert backends.async_error(_DataGroup(_Backend("SUCCESS")), "gloo") is None
    real = process_group(dist.HashStore(), 0, 1)  # a world of one, as init_process_group builds the default group
    assert backends.async_error(real, "gloo") is None  # Gloo's errors reach its futures: it answers SUCCESS
    assert backends.async_error(object(), "nccl") is None  # a torch whose groups do not tell


def process_group(store: dist.Store, rank: int, size: int) -> dist.ProcessGroup:
    """A Gloo group as init_process_group builds one, which DDP takes (a bare ProcessGroupGloo it does not)."""
    group = dist.ProcessGroup(store, rank, size)
    group._register_backend(torch.device("cpu"), dist.ProcessGroup.BackendType.GLOO,
                            dist.ProcessGroupGloo(store, rank, size, timedelta(seconds=60)))
    group._set_default_backend(dist.ProcessGroup.BackendType.GLOO)
    return group


def small_model() -> torch.nn.Module:
    """A model DDP puts in two buckets once it rebuilt them (its first is of 1 MB)."""
    return torch.nn.Sequential(torch.nn.Linear(64, 512), torch.nn.Tanh(), torch.nn.Linear(512, 512), torch.nn.Tanh(),
                               torch.nn.Linear(512, 8))


def plain_backward(model: torch.nn.Module, inputs: torch.Tensor) -> tuple[list[torch.Tensor], float]:
    """The gradients and loss of a plain backward of ``inputs`` through a copy of ``model``."""
    copy = small_model()
    copy.load_state_dict(model.state_dict())
    loss = copy(inputs).square().sum()
    loss.backward()
    return [p.grad for p in copy.parameters()], loss.item()


def ddp_steps(gradient_as_bucket_view: bool):  # noqa: ANN201
    """Two steps of a rank through a real DDP whose buckets go through the hook (the second on the buckets DDP
    rebuilt after the first): per step what ``finish`` answered, the gradients DDP left, and both ranks' plain
    backward of their batches."""
    def run(r: int, collectives: StepCollectives, group: _Recording) -> list:
        torch.manual_seed(0)
        model = small_model()
        ddp = DistributedDataParallel(model, process_group=group.group,
                                      gradient_as_bucket_view=gradient_as_bucket_view)
        ddp.register_comm_hook(group, collectives.hook)
        done = []
        for number in range(2):
            inputs = [torch.randn(4, 64, generator=torch.Generator().manual_seed(10 * number + k)) for k in (0, 1)]
            expected = [plain_backward(model, batch) for batch in inputs]
            collectives.begin()
            loss = ddp(inputs[r]).square().sum()
            collectives.start_loss(loss, lambda _: group, with_first_bucket=True)
            loss.backward()
            done.append((collectives.finish(loss, lambda _: group), [p.grad.clone() for p in model.parameters()],
                         expected))
            with torch.no_grad():
                for p in model.parameters():
                    p -= 0.01 * p.grad
            ddp.zero_grad(set_to_none=not gradient_as_bucket_view)
        return done
    return run


@pytest.mark.compat  # DDP's reading of a hook's result, on each release
@pytest.mark.parametrize("gradient_as_bucket_view", [False, True])
def test_a_real_ddp_takes_the_summed_gradients_from_the_hook_and_the_loss_rides_along(gradient_as_bucket_view):
    for done, reduced in two_ranks(ddp_steps(gradient_as_bucket_view), group=process_group):
        assert len(reduced) >= 3  # one bucket in the first step, or more; two in the second (DDP rebuilt them)
        parameters = sum(p.numel() for p in small_model().parameters())
        assert sum(n for n, _ in reduced) == 2 * (parameters + 1)  # with the loss: no collective of its own
        for (finished, grads, ((mine, my_loss), (theirs, their_loss))) in done:
            assert finished[0] and finished[1] == pytest.approx(my_loss + their_loss, rel=1e-5)
            for grad, a, b in zip(grads, mine, theirs):
                assert torch.allclose(grad, a + b, rtol=1e-5, atol=1e-6)
