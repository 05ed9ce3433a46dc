"""The NCCL that the launch's torch brings, reported once at start-up on a machine with GPUs.

Each CUDA build of torch depends on its own NCCL wheel: nvidia-nccl-cu12 for CUDA 12 builds, nvidia-nccl-cu13
for CUDA 13 builds (container builds use the system's NCCL instead). Every one of these wheels installs the
same file, nvidia/nccl/lib/libnccl.so.2, so with two installed the one written last wins, whatever CUDA it was
built for. ftrun says which NCCL torch has loaded, and warns about NCCL wheels for another CUDA.

Nothing here imports torch: it reads the torch that the agent has loaded (to serve the store itself), or what
the fork server, which imports torch for the workers, said of its torch.
"""

from __future__ import annotations

import importlib.metadata
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from ftrun.flag_values import visible_gpu_count

NCCL_PACKAGES = ("nvidia-nccl-cu11", "nvidia-nccl-cu12", "nvidia-nccl-cu13")
"""The NCCL wheels of torch's CUDA builds, by CUDA major version."""


@dataclass(frozen=True)
class NcclFacts:
    """What the loaded torch says about its CUDA and NCCL, and which NCCL wheels are installed."""

    torch_version: str
    cuda: str  # torch.version.cuda, e.g. "13.0"
    nccl: str | None  # e.g. "2.30.7"; None when torch was built without NCCL
    packages: dict[str, str] = field(default_factory=dict)  # installed NCCL wheel -> its version


def read_facts(reported: dict[str, Any] | None = None) -> NcclFacts | None:
    """The facts of the torch loaded in this process, else of the one the fork server ``reported`` (its version,
    ``cuda`` and ``nccl``); None without either, or for a torch that is not a CUDA build."""
    torch = sys.modules.get("torch")
    if torch is None:
        return facts_of(reported["version"], reported["cuda"], reported["nccl"]) if reported else None
    try:
        version = torch.cuda.nccl.version()  # (major, minor, patch[, suffix]); reads the library, no CUDA call
    except (AttributeError, RuntimeError):  # a build without NCCL
        version = None
    return facts_of(torch.__version__, getattr(getattr(torch, "version", None), "cuda", None), version)


def facts_of(torch_version: str, cuda: str | None, nccl_version: Sequence[int] | None) -> NcclFacts | None:
    """The facts of a torch of that version, CUDA (None: a CPU build) and NCCL version, with the NCCL wheels
    installed here."""
    if cuda is None:
        return None
    nccl = None if nccl_version is None else ".".join(str(part) for part in nccl_version[:3])
    packages = {}
    for name in NCCL_PACKAGES:
        try:
            packages[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            pass
    return NcclFacts(torch_version, cuda, nccl, packages)


def nccl_notices(facts: NcclFacts | None, gpus: int) -> list[tuple[str, str]]:
    """The start-up lines, as (text, rich style): NCCL's version where there are GPUs, and a warning for each
    NCCL wheel built for another CUDA than torch's."""
    if facts is None or gpus == 0:
        return []
    wanted = f"nvidia-nccl-cu{facts.cuda.split('.')[0]}"
    source = f", from {wanted} {facts.packages[wanted]}" if wanted in facts.packages else ""
    notices = [(f"ftrun: NCCL {facts.nccl or 'missing: this torch was built without it'} "
                f"(torch {facts.torch_version}, CUDA {facts.cuda}{source})", "dim")]
    for other in sorted(set(facts.packages) - {wanted}):
        notices.append((f"ftrun: {other} is installed too: it writes the same libnccl.so.2 as the NCCL of torch's "
                        f"CUDA {facts.cuda} build and may replace it; pip uninstall {other}", "bold yellow"))
    return notices


def startup_notices(reported: dict[str, Any] | None = None) -> list[tuple[str, str]]:
    """The lines to print once torch is loaded here or in the fork server (which ``reported`` on it): none
    without a CUDA build of torch, or without a GPU."""
    facts = read_facts(reported)
    return nccl_notices(facts, visible_gpu_count()) if facts is not None else []
