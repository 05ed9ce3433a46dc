"""Plain data passed between the NVML monitor and the health policy."""

from __future__ import annotations

import enum
from dataclasses import dataclass


class Action(enum.Enum):
    """What the agent should do about a GPU health signal, mildest first."""

    IGNORE = "ignore"
    """Record it and carry on."""
    RESTART_RANK = "restart_rank"
    """Restart the rank on the same GPU; the GPU itself is fine."""
    EVICT_GPU = "evict_gpu"
    """Stop using this GPU until it has been reset or serviced."""
    EVICT_NODE = "evict_node"
    """Stop using this node: the GPU is gone or the node needs a reboot."""


SIGNAL_KINDS = (
    "xid",
    "ecc_uncorrected",
    "row_remap_pending",
    "row_remap_failure",
    "recovery_action",
    "gpu_lost",
)
"""The kinds of signal the monitor reports; the policy treats any other kind as unknown."""


@dataclass(frozen=True)
class HealthSignal:
    """One observed change in a GPU's health.

    ``gpu_index`` is the physical NVML index (the order of ``nvidia-smi``), not the
    CUDA ordinal a worker sees; ``local_rank`` is the rank on this node that uses
    the GPU, or None when no rank does.  ``value`` depends on ``kind``: the Xid code,
    the volatile uncorrected ECC count, a 0/1 flag for row remapping, the NVML
    recovery action, or 1 for a lost GPU.
    """

    kind: str
    gpu_index: int
    value: int
    detail: str = ""
    time: float = 0.0
    local_rank: int | None = None


@dataclass(frozen=True)
class Decision:
    """The policy's answer to one signal: what to do and a one-line reason for the log."""

    action: Action
    reason: str
