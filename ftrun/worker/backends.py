"""What the data plane's backend needs from ftrun: its device, its init options, its abort; feature-detected.

Every NCCL choice here rests on torch's own source (torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp/.cpp,
torch/distributed/distributed_c10d.py); see the README section "How recovery works on NCCL and on Gloo":

* ``TORCH_NCCL_ASYNC_ERROR_HANDLING=2`` (``CleanUpOnly``: "just clean up collectives and abort
  communicators without tearing down process"). torch's default, 3 (``SkipCleanUp``), has the watchdog
  kill the process on a failed collective: every survivor of a dead peer would die with it. The
  variable is read when a ProcessGroupNCCL is built, so it is set before the first one; a value the
  user set is kept.
* Eager communicator init (``device_id=``): the communicator is built inside ``init_process_group``,
  while the generation forms, not on the first step after it; batched point-to-point operations then
  run on that communicator (ProcessGroupNCCL::pointToPoint takes the device key under
  ``ncclGroupStart``) instead of building a two-rank one per pair.
* Abort: ``_abort_process_group`` (ncclCommAbort on every communicator) from the channel thread, the
  moment a new plan arrives, so a kernel waiting for a dead peer is freed at once.
"""

from __future__ import annotations

import inspect
import os
from typing import Any

import torch
import torch.distributed as dist

NCCL_ENV = {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "2"}


def served(backend: str) -> set[str]:
    """The device types a group of ``backend`` takes tensors of: ``"cuda:nccl"`` -> cuda; ``"gloo"`` -> cpu, cuda."""
    if ":" in backend:
        return {pair.split(":")[0].strip() for pair in backend.split(",")}
    return set(dist.Backend.backend_capability.get(backend.lower(), ["cpu"]))


def device_of(device_type: str) -> torch.device:
    """This rank's device of a type: its GPU (LOCAL_RANK) for cuda."""
    if device_type == "cuda" and torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
    return torch.device(device_type)


def prepare(backend: str) -> None:
    """Set the environment the backend must be built with (before its first group exists)."""
    if "nccl" in backend:
        for name, value in NCCL_ENV.items():
            os.environ.setdefault(name, value)


def init_options(backend: str) -> dict[str, Any]:
    """Extra ``init_process_group`` arguments: eager communicator init on this rank's GPU where supported."""
    if "nccl" in backend and torch.cuda.is_available() \
            and "device_id" in inspect.signature(dist.init_process_group).parameters:
        return {"device_id": device_of("cuda")}
    return {}


def abort(group: dist.ProcessGroup) -> None:
    """Fail every collective in flight on the data plane where the backend can (NCCL); Gloo's is done
    by the caller, by shutting down the group's connections."""
    if not dist.is_initialized() or group is not dist.group.WORLD:
        return  # already replaced: nothing of it is in flight any more
    if "nccl" in str(dist.get_backend(group)):
        aborting = getattr(dist.distributed_c10d, "_abort_process_group", None)
        if aborting is not None:
            aborting()


def shut_down(group: Any) -> None:
    """Stop a standalone (control) group's threads where torch offers it; its destructor does the rest."""
    shutdown = getattr(group, "shutdown", None)
    if shutdown is not None:
        shutdown()
