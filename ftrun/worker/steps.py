"""The collectives of one step: DDP's gradient all-reduce through ftrun's comm hook, and the loss sum.

Every bucket is all-reduced as DDP hands it over, overlapping the rest of ``backward()``. The step's loss
rides on the first bucket: that bucket's all-reduce carries one more element, the loss, so a step issues no
collective of its own for it (on 4 CPU workers a step of the example took 2-3% less time and CPU than with a
one-element all-reduce beside the buckets). It is the first bucket, not the last, because the loss is known
before ``backward()`` starts: holding the last bucket back to carry it measured 7% slower a step, since that
bucket then no longer overlaps the end of ``backward()``. Where no bucket can carry it (no DDP gradients in
this backward pass, or buckets of a 16-bit type, which would round the loss) it is summed in float64 on its
own. A failed or abandoned collective never raises inside ``backward()``: it marks the step failed, and
``commit`` then drops the step.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ftrun.worker.interruptible import Superseded


class CollectiveFailed(Exception):
    """A collective of the current generation failed (a peer died or the group was re-formed)."""


CARRIES_LOSS = (torch.float32, torch.float64)  # bucket types that hold the loss without rounding it much


@dataclass
class LossSum:
    """A step's loss on its way to being summed over the ranks."""

    epoch: int  # the step (StepCollectives.epoch) it belongs to
    loss: torch.Tensor  # the caller's loss, known again at commit by identity
    slot: torch.Tensor  # its value as one float64 element, which holds the sum once ``done`` has completed
    group: dist.ProcessGroup  # where it is summed when it travels on its own
    done: torch.futures.Future | None = None  # None: not issued yet (the step's first bucket is to carry it)

    def alone(self) -> dist.Work:
        """Start summing the loss in a collective of its own."""
        return self.group.allreduce([self.slot])


class StepCollectives:
    """Issues the current generation's collectives and knows which of them a new plan abandoned.

    ``cond`` guards everything here and is shared with the session, whose channel thread calls
    :meth:`abandon` when a plan arrives: from then on nothing more is issued on the stale generation,
    and every hook future still pending is completed, so a ``backward()`` blocked in it returns.
    """

    def __init__(self, cond: threading.Condition, on_entered: Callable[[], None] | None) -> None:
        self.cond = cond
        self.poisoned = False  # a newer plan arrived: nothing more may be issued on this generation
        self.failed = False  # a collective of the current step failed or was abandoned
        self.error = ""  # why it failed, in a line (empty when a new plan abandoned it)
        self.epoch = 0  # steps and recoveries started: a late failure only fails its own epoch
        self._on_entered = on_entered
        self._entered_epoch = -1
        self._pending: dict[torch.futures.Future, torch.Tensor] = {}  # hook futures and their buckets
        self._callbacks = 0  # completion callbacks registered and not yet dropped by torch (_Counted)
        self._spent: list[Callable[[torch.futures.Future], None]] = []  # the ones it dropped, not yet freed
        self._loss: LossSum | None = None  # started by start_loss

    # ------------------------------------------------------------------ steps
    def begin(self) -> None:
        """A new step (or recovery) starts: earlier collectives' late failures no longer count."""
        with self.cond:
            self.epoch += 1
            self.failed, self.error = False, ""
        self._free_spent()

    def _free_spent(self) -> None:
        """Free the completion callbacks torch has dropped: here, not on a backend's thread (_Counted)."""
        with self.cond:
            spent, self._spent = self._spent, []
        del spent

    def hook(self, group, bucket):  # noqa: ANN001, ANN201 -- DDP rejects string annotations here
        """DDP comm hook: sum the bucket over ``group``."""
        self._free_spent()  # also where no steps() begins each step: a DDP trained in a loop of its own
        buffer = bucket.buffer()
        result: torch.futures.Future = torch.futures.Future(devices=future_devices(buffer.device))
        with self.cond:  # issue and register in one step, so a new plan cannot slip between them
            epoch = self.epoch
            first, self._entered_epoch = self._entered_epoch != epoch, epoch
            try:
                reduced, carried = self._with_loss(buffer, result)
                work = self._start(lambda: group.allreduce([reduced]))
            except (Superseded, CollectiveFailed) as exc:  # complete the future at once: nothing was issued
                work = None
                self._failed("" if isinstance(exc, Superseded) else str(exc))
            else:
                self._pending[result] = buffer
                self._callbacks += 1
        if first and self._on_entered is not None:
            self._on_entered()
        if work is None:
            result.set_result(buffer)
            return result

        def finished(fut: torch.futures.Future) -> None:  # on the backend's thread: one lock, no more
            try:
                fut.value()
                failed = ""
            except Exception as exc:  # noqa: BLE001 -- any failure of the collective discards the step
                failed = first_line(exc)
            with self.cond:
                if failed and epoch == self.epoch:
                    self._failed(failed)
                mine = self._pending.pop(result, None)
                self.cond.notify_all()
            if mine is None:
                return
            if carried is not None and not failed:  # after the collective on a GPU: torch orders the callback
                carried.copy_(reduced[-1:])
                mine = reduced[:-1]  # DDP reads the sums from the future's tensor, copied into the gradients as
                # it copies its bucket's (Reducer::populate_bucket_views_out): not copied back into the bucket first
            result.set_result(mine)

        work.get_future().add_done_callback(_Counted(finished, self._dropped))
        return result

    def _with_loss(self, buffer: torch.Tensor, result: torch.futures.Future) -> tuple[torch.Tensor,
                                                                                      torch.Tensor | None]:
        """Under the lock: what the hook all-reduces for ``buffer``, and the loss's slot if it rides along.

        The step's first bucket takes a loss that waits for one: the all-reduce then sums the bucket with the
        loss appended, and the loss's sum completes with the bucket's ``result``. A bucket that cannot carry it
        (of another device, or a 16-bit type) sends it on its own first, still beside the backward pass."""
        pending = self._loss
        if pending is None or pending.done is not None or pending.epoch != self.epoch:
            return buffer, None
        if buffer.dtype in CARRIES_LOSS and buffer.device == pending.slot.device:
            pending.done = result
            return torch.cat([buffer, pending.slot.to(buffer.dtype)]), pending.slot
        pending.done = self._start(pending.alone).get_future()
        return buffer, None

    def start_loss(self, loss: torch.Tensor, loss_group: Callable[[torch.Tensor], dist.ProcessGroup],
                   with_first_bucket: bool = False) -> None:
        """Start summing the step's ``loss`` over the ranks before its backward pass, which it then overlaps:
        on the first bucket that pass all-reduces (``with_first_bucket``: a DDP model syncs its gradients in it),
        else now on its own; :meth:`finish` of the same ``loss`` waits for it instead of starting it."""
        pending = self._loss_sum(loss, loss_group)
        if not with_first_bucket:
            try:
                pending.done = self.issue(pending.alone).get_future()
            except (Superseded, CollectiveFailed) as exc:
                self.fail(error="" if isinstance(exc, Superseded) else str(exc))
                return
        with self.cond:
            self._loss = pending

    def finish(self, loss: torch.Tensor | None, loss_group: Callable[[torch.Tensor], dist.ProcessGroup],
               backend_error: Callable[[], str | None] = lambda: None) -> tuple[bool, float | None]:
        """Sum the step's loss over the ranks (on ``loss_group(loss)``) once ``backward()`` has all-reduced the
        buckets, unless :meth:`start_loss` started it. Returns whether every collective of the step
        completed, and the summed loss.

        Reading the summed loss waits (on a GPU) until the step's collectives have ended on the device; then
        ``backend_error()`` says whether the data plane's backend recorded a failure meanwhile (NCCL's watchdog
        records one before it aborts the communicator under a collective, whose future was done since it was
        queued): the step fails then. Without a loss, only what was recorded by then is seen."""
        with self.cond:
            started, self._loss = self._loss, None
        total: float | None = None
        if loss is not None:
            try:
                if started is None or started.epoch != self.epoch or started.loss is not loss:
                    started = self._loss_sum(loss, loss_group)
                if started.done is None:  # not started, or no bucket carried it
                    started.done = self.issue(started.alone).get_future()
                self.wait_future(started.done)
                total = float(started.slot.item())
            except (CollectiveFailed, Superseded) as exc:
                self.fail(error="" if isinstance(exc, Superseded) else first_line(exc))
        error = backend_error()
        if error:
            self.fail(error=error)
        with self.cond:
            ok = not (self.poisoned or self.failed)
        return (True, total) if ok else (False, None)

    def _loss_sum(self, loss: torch.Tensor, loss_group: Callable[[torch.Tensor], dist.ProcessGroup]) -> LossSum:
        """The current step's ``loss``, ready to be summed (on ``loss_group`` of its slot when on its own)."""
        slot = loss.detach().reshape(1).to(torch.float64)
        with self.cond:
            epoch = self.epoch
        return LossSum(epoch, loss, slot, loss_group(slot))

    # ------------------------------------------------------------- abandoning
    def abandon(self) -> set[torch.futures.Future]:
        """A newer plan arrived (channel thread): poison the generation; the hook futures to complete."""
        with self.cond:
            self.poisoned = True
            self.cond.notify_all()
            return set(self._pending)

    def reopen(self) -> None:
        """The next generation is formed: collectives may be issued again."""
        with self.cond:
            self.poisoned = self.failed = False
            self.error = ""
            self.epoch += 1  # late failures of the abandoned step's collectives no longer count

    def complete(self, futures: set[torch.futures.Future]) -> None:
        """Complete hook futures (once each), so a blocked backward returns; called outside the lock."""
        with self.cond:
            mine = {fut: self._pending.pop(fut) for fut in futures if fut in self._pending}
            self.cond.notify_all()
        for fut, buffer in mine.items():
            fut.set_result(buffer)

    def fail(self, epoch: int | None = None, error: str = "") -> None:
        """Mark the current step failed; a late failure of an earlier step's collective (``epoch``) is ignored."""
        with self.cond:
            if epoch is None or epoch == self.epoch:
                self._failed(error)
            self.cond.notify_all()

    def _failed(self, error: str) -> None:
        """Under the lock: the step failed; the first failure's message is kept."""
        self.failed = True
        self.error = self.error or error

    def quiet(self, timeout: float) -> bool:
        """Wait until no completion callback is pending (they need this interpreter): each has run and torch
        has dropped it; False on timeout."""
        with self.cond:
            return self.cond.wait_for(lambda: self._callbacks == 0, timeout=timeout)

    # ---------------------------------------------------------------- issuing
    def issue(self, start: Callable[[], dist.Work]) -> dist.Work:
        """Start a collective unless a newer generation was announced (then raise Superseded); CollectiveFailed
        if the backend refuses to start it."""
        with self.cond:
            return self._start(start)

    def _start(self, start: Callable[[], dist.Work]) -> dist.Work:
        """Under the lock: :meth:`issue`. NCCL refuses a collective on a communicator its watchdog aborted (after
        an asynchronous NCCL error, a link that failed with every process alive): the step fails as with any
        failed collective, where the error would have left ``backward()`` (from the comm hook) or ``commit``
        and ended the worker. Only the backends' own errors (DistError): any other is a mistake in the call
        (a tensor of a device the group does not take), which no recovery mends, and propagates."""
        if self.poisoned:
            raise Superseded("a newer generation was announced")
        try:
            return start()
        except dist.DistError as exc:
            raise CollectiveFailed(first_line(exc)) from exc

    def wait(self, work: dist.Work, deadline: float | None = None) -> None:
        """Wait for ``work`` but give up as soon as a newer generation is announced or the deadline passes."""
        self.wait_future(work.get_future(), deadline)

    def wait_future(self, future: torch.futures.Future, deadline: float | None = None) -> None:
        """:meth:`wait` for a collective's (or a hook's) future."""
        with self.cond:
            self._callbacks += 1
        future.add_done_callback(_Counted(self._wake, self._dropped))
        with self.cond:
            remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
            self.cond.wait_for(lambda: future.done() or self.poisoned, timeout=remaining)
            if not future.done():
                raise Superseded("a newer generation was announced") if self.poisoned else CollectiveFailed("timeout")
        try:
            future.wait()  # done already; on a GPU it also puts this thread's stream after the collective's,
            # which value() does not: the loss summed on NCCL's stream would be read before the sum was made
        except Exception as exc:
            raise CollectiveFailed(str(exc)) from exc

    def _wake(self, _future: torch.futures.Future) -> None:
        with self.cond:
            self.cond.notify_all()

    def _dropped(self, run: Callable[[torch.futures.Future], None]) -> None:
        with self.cond:
            self._spent.append(run)
            self._callbacks -= 1
            self.cond.notify_all()


class _Counted:
    """A completion callback that counts as pending until torch has dropped it; ``dropped`` then gets the
    callback itself, to be freed later by the thread that runs the steps.

    The backend's thread that completed the collective runs the callback holding the GIL, then takes the GIL
    once more to drop it (torch holds a Python callable through a guard that takes the GIL to release it): only
    after that is the thread done with the interpreter. An exiting worker frees its groups once nothing is
    pending, and where torch's groups have no ``shutdown()`` freeing one joins its threads holding the GIL: a
    thread still on its way to the GIL would never end, nor would the worker. Nor is the callback freed on that
    thread: the tensors its closure holds would be freed there while the collective's work still holds them, and
    torch would then take the GIL once more when the work lets go of them (a tensor's Python object outlives
    its last Python reference while C++ holds the tensor)."""

    __slots__ = ("_run", "_dropped")

    def __init__(self, run: Callable[[torch.futures.Future], None],
                 dropped: Callable[[Callable[[torch.futures.Future], None]], None]) -> None:
        self._run = run
        self._dropped = dropped

    def __call__(self, future: torch.futures.Future) -> None:
        self._run(future)

    def __del__(self) -> None:
        self._dropped(self._run)


def future_devices(device: torch.device) -> list[torch.device]:
    """The devices a future that hands on a tensor of ``device`` must be made with: that one, unless it is the
    CPU. A future made without them (``torch.futures.Future()``) holds a CUDA tensor with no CUDA event: whoever
    waits on it (DDP's reducer, at the end of ``backward()``) reads the tensor on its own stream at once, before
    the all-reduce writing it on NCCL's stream has run (NCCL marks its work's future done when the kernel is
    queued). Made with the device, the future records an event where it is set, inside the collective's
    callback, whose streams torch has made wait for the collective, and a waiter's stream waits for that event
    (``ivalue::Future::markCompleted``, whose FIXME names this silent mistake; ``invokeCallback``)."""
    return [] if device.type == "cpu" else [device]


def first_line(error: BaseException) -> str:
    """An exception's message, first line only (torch's carry C++ frames below it)."""
    return (str(error).strip().splitlines() or [type(error).__name__])[0]
