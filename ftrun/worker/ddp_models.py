"""The DDP models a session made (``Session.ddp``): wrapped with ftrun's comm hook, and kept bound to the
current generation's default group."""

from __future__ import annotations

import inspect
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from ftrun.worker.steps import StepCollectives


class DdpModels:
    """Every stock DDP a session wrapped, with the options it was made with, their gradients summed through
    ``collectives``' comm hook."""

    def __init__(self, collectives: StepCollectives) -> None:
        self.collectives = collectives
        self._models: list[tuple[DistributedDataParallel, dict[str, Any]]] = []

    def wrap(self, module: torch.nn.Module, **kwargs: Any) -> DistributedDataParallel:
        """``module`` in stock DDP on the default group, its buckets all-reduced through ftrun's hook."""
        model = DistributedDataParallel(module, **kwargs)
        model.register_comm_hook(dist.group.WORLD, self.collectives.hook)
        self._models.append((model, kwargs))
        return model

    def sync(self) -> bool:
        """Whether the next backward pass all-reduces gradients through the hook (False under ``no_sync()``)."""
        return any(model.require_backward_grad_sync for model, _ in self._models)

    def rebuild_buckets(self) -> None:
        """Run DDP's one-time bucket rebuild (a broadcast) now, not in the next forward pass.

        A fresh DDP (at the start, and after each recovery) rebuilds its buckets once, at the start of
        its second forward pass: a collective outside the comm hook, which would raise in the user's
        ``model(x)`` if a peer died then. Here, a failure is left for the next step to meet, as any other.
        """
        if not torch.is_grad_enabled():
            return
        for model, _ in self._models:
            try:
                if model.reducer._rebuild_buckets():
                    model._has_rebuilt_buckets = True
            except RuntimeError:
                return  # the group broke: the next step's collectives fail too and recovery follows

    def rebind(self) -> None:
        """Rebuild each DDP on the new default group; the user's model object stays the same.

        DDP's reducer holds its process group; re-running its constructor binds the new group and builds
        fresh buckets, so no collective of the abandoned group can write into them. The ranks already hold
        the same state, so the constructor's parameter broadcast is skipped where DDP allows it.
        """
        skip_sync = {"init_sync": False} if "init_sync" in inspect.signature(DistributedDataParallel).parameters else {}
        for model, kwargs in self._models:
            DistributedDataParallel.__init__(model, model.module, **{**kwargs, **skip_sync})
            model.register_comm_hook(dist.group.WORLD, self.collectives.hook)

    def release(self) -> None:
        """Drop what keeps the default group alive in each DDP: its reducer, its logger, its ``process_group``
        and its comm hooks' state (ftrun's hook is registered with the group as its state); no model trains
        after this."""
        for model, _ in self._models:
            for holder in ("reducer", "logger", "process_group", "_comm_hooks"):
                model.__dict__.pop(holder, None)
