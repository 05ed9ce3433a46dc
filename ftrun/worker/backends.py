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
* Abort: ``ProcessGroup.abort`` (ncclCommAbort) of every group, each on a thread of its own started from
  the channel thread the moment a new plan arrives, so a kernel waiting for a dead peer is freed at once.
  The next generation does not wait for the communicators' teardown (about a second): the aborted groups
  leave torch's registry as ``_abort_process_group`` would remove them, and are freed once aborted. A group
  made for reconfigure (``--data-reconfigure native``) is aborted the same way and kept: torch 2.15's NCCL
  backend then revokes its communicator (``ncclCommRevoke``) instead of tearing it down, and never ends the
  process for a failure it sees itself (torch/csrc/distributed/c10d/nccl2/ProcessGroupNCCL.cpp: ``abort``,
  ``handleWatchdogFailure``, ``abortProcess``).
"""

from __future__ import annotations

import contextlib
import inspect
import os
import threading
from typing import Any

import torch
import torch.distributed as dist

NCCL_ENV = {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "2"}


def served(backend: str) -> set[str]:
    """The device types a group of ``backend`` takes tensors of: ``"cuda:nccl"`` -> cuda; ``"gloo"`` -> cpu, cuda."""
    if ":" in backend:
        return {pair.split(":")[0].strip() for pair in backend.split(",")}
    return set(dist.Backend.backend_capability.get(backend.lower(), ["cpu"]))


def moves_point_to_point(backend: str) -> set[str]:
    """The device types a group of ``backend`` sends and receives point to point from the tensors' own
    memory: Gloo's ``send``/``recv`` hand the tensor's pointer to a TCP buffer as host memory
    (ProcessGroupGloo::send), so on Gloo only CPU tensors; NCCL moves CUDA tensors."""
    if ":" in backend:
        pairs = [tuple(part.strip() for part in pair.split(":")) for pair in backend.split(",")]
    else:
        pairs = [(kind, backend) for kind in served(backend)]
    return {kind for kind, name in pairs if name.lower() != "gloo" or kind == "cpu"}


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


def data_device_type(backend: str) -> str:
    """The device type the data plane's collectives run on here: cuda where the backend takes CUDA tensors and
    a GPU is visible, else cpu."""
    return "cuda" if "cuda" in served(backend) and torch.cuda.is_available() else "cpu"


def on_own_device(backend: str) -> contextlib.AbstractContextManager[Any]:
    """This rank's GPU as the current CUDA device for the block, where the backend runs on CUDA: a group made
    for reconfigure is bound to no device (``device_id`` would build its communicator at init, for a world it
    is not), and torch 2.15's NCCL backend binds it at its first reconfigure to the current device
    (torch/csrc/distributed/c10d/nccl2/ReconfigureNCCL.cpp), which, before the script picks its GPU, is GPU 0
    for every rank of a node. Elsewhere nothing."""
    if data_device_type(backend) == "cuda":
        return torch.cuda.device(device_of("cuda"))
    return contextlib.nullcontext()


def init_options(backend: str) -> dict[str, Any]:
    """Extra ``init_process_group`` arguments: eager communicator init on this rank's GPU where supported."""
    if "nccl" in backend and torch.cuda.is_available() \
            and "device_id" in inspect.signature(dist.init_process_group).parameters:
        return {"device_id": device_of("cuda")}
    return {}


def async_error(group: dist.ProcessGroup, backend: str) -> str | None:
    """The failure the watchdog of ``group``'s backend recorded, in a line, or None (none, or a torch that
    does not tell: ``Backend.get_error`` is feature-detected).

    NCCL marks a collective's future done when its kernel is queued, so a failure that comes later (an
    asynchronous NCCL error: a link gone with every process alive, or a timeout) reaches no future. The
    watchdog records it (``ProcessGroupNCCL::getError``: COMM_ERROR, TIMEOUT, or REMOTE_ERROR from a peer's
    watchdog) before it aborts the communicator, after which the kernel under it ends, its sum not a sum: once
    a step's kernels have ended, a failure among them is known here. Gloo's errors reach its futures; it
    answers SUCCESS."""
    kind = data_device_type(backend)
    get_backend = getattr(group, "_get_backend", None)
    try:
        get_error = getattr(get_backend(torch.device(kind)), "get_error", None) if get_backend else None
        error = get_error() if get_error is not None else None
    except RuntimeError:  # no backend for the device (a group being replaced): nothing to tell
        return None
    name = getattr(error, "name", "SUCCESS")
    return None if name == "SUCCESS" else f"the data plane's {backend} backend reported {name}"


ABORTING = ("nccl",)
"""The backends whose ``abort()`` fails the collectives in flight (Gloo's does nothing)."""

RECONFIGURE_API = ("_reconfigure", "_get_reconfigure_handle", "_supports_reconfigure")
"""torch.distributed's in-place reconfigure (experimental in torch): all three, or ftrun forms fresh groups."""


def reconfigures_in_place(setting: str) -> bool:
    """Whether the data plane is to be re-formed by torch's in-place reconfigure: asked for (``--data-reconfigure
    native``) and offered by this torch (its API, feature-detected). Whether the backend itself offers it is
    known once its group exists (:class:`~ftrun.worker.planes.Planes` falls back to fresh groups if not)."""
    return setting == "native" and all(hasattr(dist, name) for name in RECONFIGURE_API) \
        and "enable_reconfigure" in inspect.signature(dist.init_process_group).parameters


def abort(group: dist.ProcessGroup) -> list[threading.Thread]:
    """Start failing every collective in flight on the data plane where its backend aborts (NCCL): each group
    torch.distributed holds is aborted on a thread of its own (``ncclCommAbort``). Returns those threads.
    NCCL's abort frees a kernel waiting for a dead peer at once but takes about a second to tear the
    communicator down (0.95-0.98 s on an H200, NCCL 2.28.9, with nothing in flight): the next generation
    forms meanwhile (:func:`forget_groups`), not after it."""
    if not dist.is_initialized() or group is not dist.group.WORLD:
        return []  # already replaced: nothing of it is in flight any more
    if not any(name in str(dist.get_backend(group)) for name in ABORTING):
        return []  # Gloo: the caller shuts its connections down, and the group is destroyed as before
    groups = list(getattr(dist.distributed_c10d._world, "pg_names", {})) or [group]
    threads = [threading.Thread(target=_abort_group, args=(g,), name="ftrun-abort", daemon=True) for g in groups]
    for thread in threads:  # one thread each: every communicator's abort flag is raised at once, so one
        thread.start()      # communicator's teardown never waits behind another's blocked kernel
    return threads


def _abort_group(group: dist.ProcessGroup) -> None:
    """Abort one group's backends (``ProcessGroup.abort``, else its CUDA backend's)."""
    aborting = getattr(group, "abort", None)
    if aborting is None:
        try:
            aborting = group._get_backend(torch.device("cuda")).abort
        except (RuntimeError, AttributeError):
            return  # no backend that can abort: a CPU group, shut down by its connections
    aborting()


REGISTRY = ("pg_map", "pg_names", "pg_group_ranks", "pg_backend_config", "pg_to_tag", "tags_to_pg",
            "pg_coalesce_state")


def forget_groups(aborting: list[threading.Thread]) -> None:
    """Take every group out of torch.distributed's registry without tearing any down, so that the next
    default group can be formed while the aborts in ``aborting`` still run; each group is freed when its
    last reference goes. This is the registry clean-up of torch's own ``_abort_process_group``
    (distributed_c10d.py) without the abort before it. Where torch's registry is not as expected, the
    aborts are waited for and the groups destroyed instead."""
    c10d = dist.distributed_c10d
    if not (hasattr(c10d, "_update_default_pg") and all(hasattr(c10d._world, name) for name in REGISTRY)):
        for thread in aborting:
            thread.join()
        dist.destroy_process_group()
        return
    c10d._update_default_pg(None)
    for name in REGISTRY:
        getattr(c10d._world, name).clear()
    comms = getattr(c10d._world, "comms", None)  # torchcomms communicators, which destroy_process_group
    if comms is not None:                         # would finalize: aborted, they are only let go
        comms.clear()
    unregister = getattr(c10d, "_unregister_all_process_groups", None)
    if unregister is not None:
        unregister()
    c10d._world.group_count = 0


def shut_down(group: Any) -> None:
    """Stop a standalone (control) group's threads where torch offers it; its destructor does the rest."""
    shutdown = getattr(group, "shutdown", None)
    if shutdown is not None:
        shutdown()
