"""The collectives of one step: DDP's gradient all-reduce through ftrun's comm hook, and the loss sum.

Every bucket but the last is all-reduced as DDP hands it over, overlapping the rest of ``backward()``.
The last bucket (the first layers' gradients, ready only when ``backward()`` ends, so nothing is lost by
waiting) is held back and all-reduced in ``commit`` together with the step's loss: the loss sum costs
no collective of its own. A failed or abandoned collective never raises inside ``backward()``: it marks
the step failed, and ``commit`` then drops the step.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ftrun.worker.planes import Superseded

FOLDABLE = (torch.float32, torch.float64)  # bucket dtypes that carry a loss without rounding it much


class CollectiveFailed(Exception):
    """A collective of the current generation failed (a peer died or the group was re-formed)."""


@dataclass
class HeldBucket:
    """A last bucket held back for ``commit``: its flat buffer, and the gradients DDP copied out of it."""

    group: dist.ProcessGroup
    buffer: torch.Tensor
    views: list[torch.Tensor]  # each parameter's slice of ``buffer``
    params: list[torch.Tensor]


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
        self.epoch = 0  # steps and recoveries started: a late failure only fails its own epoch
        self._on_entered = on_entered
        self._entered_epoch = -1
        self._pending: dict[torch.futures.Future, torch.Tensor] = {}  # hook futures and their buckets
        self._held: list[HeldBucket] = []
        self._callbacks = 0  # completion callbacks registered and not yet run

    # ------------------------------------------------------------------ steps
    def begin(self) -> None:
        """A new step (or recovery) starts: earlier collectives' late failures no longer count."""
        with self.cond:
            self.epoch += 1
            self.failed = False
            self._held.clear()

    def hook(self, group, bucket):  # noqa: ANN001, ANN201 -- DDP rejects string annotations here
        """DDP comm hook: sum the bucket over ``group``; the last one is held for :meth:`finish`."""
        buffer = bucket.buffer()
        result: torch.futures.Future = torch.futures.Future()
        with self.cond:  # issue and register in one step, so a new plan cannot slip between them
            now = self.poisoned  # complete the future at once: nothing is issued
            epoch = self.epoch
            first, self._entered_epoch = self._entered_epoch != epoch, epoch
            if now:
                self.failed = True
            elif bucket.is_last() and buffer.dtype in FOLDABLE:
                self._held.append(HeldBucket(group, buffer, bucket.gradients(), bucket.parameters()))
                now = True  # DDP gets the local sums now; finish() replaces them with the global ones
            else:
                work = group.allreduce([buffer])
                self._pending[result] = buffer
                self._callbacks += 1
        if first and self._on_entered is not None:
            self._on_entered()
        if now:
            result.set_result(buffer)
            return result

        def finished(fut: torch.futures.Future) -> None:  # on the backend's thread: one lock, no more
            try:
                fut.value()
                failed = False
            except Exception:  # noqa: BLE001 -- any failure of the collective discards the step
                failed = True
            with self.cond:
                if failed and epoch == self.epoch:
                    self.failed = True
                mine = self._pending.pop(result, None)
                self._callbacks -= 1
                self.cond.notify_all()
            if mine is not None:
                result.set_result(mine)

        work.get_future().add_done_callback(finished)
        return result

    def finish(self, loss: torch.Tensor | None, loss_group: Callable[[torch.Tensor], dist.ProcessGroup]) -> \
            tuple[bool, float | None]:
        """All-reduce the held buckets (the loss folded into the first) and the loss if nothing carried it.

        Returns whether every collective of the step completed, and the summed loss.
        """
        with self.cond:
            held, self._held = self._held, []
        loss_slot: torch.Tensor | None = None
        try:
            works = []
            for index, bucket in enumerate(held):
                tensors = [bucket.buffer]
                if index == 0 and loss is not None:
                    loss_slot = loss.detach().reshape(1).to(bucket.buffer.device, bucket.buffer.dtype)
                    tensors.append(loss_slot)
                works.append(self.issue(lambda b=bucket, t=tensors: b.group.allreduce_coalesced(t)
                                        if len(t) > 1 else b.group.allreduce(t)))
            if loss is not None and loss_slot is None:
                loss_slot = loss.detach().reshape(1).to(torch.float64)
                group = loss_group(loss_slot)
                works.append(self.issue(lambda: group.allreduce([loss_slot])))
            for work in works:
                self.wait(work)
        except (CollectiveFailed, Superseded):
            self.fail()
        with self.cond:
            ok = not (self.poisoned or self.failed)
        if not ok:
            return False, None
        for bucket in held:
            for view, param in zip(bucket.views, bucket.params):
                if param.grad is not None and param.grad.data_ptr() != view.data_ptr():
                    param.grad.copy_(view.view_as(param.grad))
        return True, None if loss_slot is None else float(loss_slot.item())

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
            self.epoch += 1  # late failures of the abandoned step's collectives no longer count
            self._held.clear()

    def complete(self, futures: set[torch.futures.Future]) -> None:
        """Complete hook futures (once each), so a blocked backward returns; called outside the lock."""
        with self.cond:
            mine = {fut: self._pending.pop(fut) for fut in futures if fut in self._pending}
            self.cond.notify_all()
        for fut, buffer in mine.items():
            fut.set_result(buffer)

    def fail(self, epoch: int | None = None) -> None:
        """Mark the current step failed; a late failure of an earlier step's collective (``epoch``) is ignored."""
        with self.cond:
            if epoch is None or epoch == self.epoch:
                self.failed = True
            self.cond.notify_all()

    def quiet(self, timeout: float) -> bool:
        """Wait until no completion callback is pending (they need this interpreter); False on timeout."""
        with self.cond:
            return self.cond.wait_for(lambda: self._callbacks == 0, timeout=timeout)

    # ---------------------------------------------------------------- issuing
    def issue(self, start: Callable[[], dist.Work]) -> dist.Work:
        """Start a collective unless a newer generation was announced (then raise Superseded)."""
        with self.cond:
            if self.poisoned:
                raise Superseded("a newer generation was announced")
            return start()

    def wait(self, work: dist.Work, deadline: float | None = None) -> None:
        """Wait for ``work`` but give up as soon as a newer generation is announced or the deadline passes."""
        future = work.get_future()
        with self.cond:
            self._callbacks += 1
        future.add_done_callback(self._callback_done)
        with self.cond:
            remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
            self.cond.wait_for(lambda: future.done() or self.poisoned, timeout=remaining)
            if not future.done():
                raise Superseded("a newer generation was announced") if self.poisoned else CollectiveFailed("timeout")
        try:
            future.value()
        except Exception as exc:
            raise CollectiveFailed(str(exc)) from exc

    def _callback_done(self, _future: torch.futures.Future) -> None:
        with self.cond:
            self._callbacks -= 1
            self.cond.notify_all()
