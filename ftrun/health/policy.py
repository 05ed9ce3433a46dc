"""Health policy: which action each GPU health signal calls for.

Everything here is pure: ``decide`` maps a signal to a ``Decision`` without
touching NVML, the clock or the log, and ``load_table`` only reads the file it
is given.  The caller logs every decision's reason.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ftrun.errors import UsageError
from ftrun.paths import Unreadable, read_small_file
from ftrun.health.signals import Action, Decision, HealthSignal

if sys.version_info >= (3, 11):
    import tomllib
else:  # Python 3.10: the same parser, as the tomli package (a dependency there)
    import tomli as tomllib

XidTable = Mapping[int, tuple[Action, str]]

# Xid code -> (action, short description).
#
# Follows the "Resolution Bucket (Immediate Action)" column of NVIDIA's Xid
# catalog for Ampere and newer GPUs ("Analyzing Xid Errors with the Xid
# Catalog", https://docs.nvidia.com/deploy/xid-errors/analyzing-xid-catalog.html),
# translated as: RESTART_APP -> RESTART_RANK; RESET_GPU, WORKFLOW_XID_48 and
# WORKFLOW_NVLINK_ERR -> EVICT_GPU; RESTART_BM / RESTART_VM -> EVICT_NODE;
# IGNORE -> IGNORE.  Codes the catalog marks "Unused" are left out (unknown
# codes are ignored and logged).  The NVLink5 codes 144-150 depend on a
# subcode NVML does not deliver; the driver publishes the resulting recovery
# action (Xid 154), which the monitor reads as the recovery action field.
DEFAULT_TABLE: dict[int, tuple[Action, str]] = {
    8: (Action.RESTART_RANK, "GPU stopped processing (idle timeout)"),
    13: (Action.RESTART_RANK, "graphics engine exception"),
    14: (Action.IGNORE, "fake or injected error"),
    25: (Action.RESTART_RANK, "invalid or illegal push buffer stream"),
    31: (Action.RESTART_RANK, "GPU memory page fault"),
    32: (Action.RESTART_RANK, "invalid or corrupted push buffer stream"),
    37: (Action.IGNORE, "driver firmware error"),
    38: (Action.IGNORE, "driver firmware error (watchdog timeout)"),
    39: (Action.RESTART_RANK, "copy engine exception"),
    40: (Action.RESTART_RANK, "copy engine exception"),
    41: (Action.RESTART_RANK, "copy engine exception"),
    43: (Action.IGNORE, "GPU stopped processing: application fault, GPU healthy"),
    44: (Action.IGNORE, "graphics engine fault during context switch"),
    45: (Action.IGNORE, "preemptive cleanup after another error (follow that Xid)"),
    46: (Action.EVICT_GPU, "GPU stopped processing (timeout)"),
    48: (Action.EVICT_GPU, "double-bit ECC error"),
    60: (Action.RESTART_RANK, "video processor exception"),
    62: (Action.EVICT_GPU, "internal micro-controller halt"),
    63: (Action.IGNORE, "row remapping recorded: reset the GPU when convenient"),
    64: (Action.EVICT_GPU, "row remapping failure"),
    66: (Action.IGNORE, "illegal access by driver"),
    67: (Action.IGNORE, "illegal access by driver"),
    68: (Action.RESTART_RANK, "NVDEC0 exception"),
    69: (Action.RESTART_RANK, "graphics engine class error"),
    70: (Action.RESTART_RANK, "copy engine exception"),
    71: (Action.RESTART_RANK, "copy engine exception"),
    72: (Action.RESTART_RANK, "copy engine exception"),
    74: (Action.EVICT_GPU, "NVLink error"),
    75: (Action.RESTART_RANK, "copy engine exception"),
    76: (Action.RESTART_RANK, "copy engine exception"),
    77: (Action.RESTART_RANK, "copy engine exception"),
    79: (Action.EVICT_NODE, "GPU has fallen off the bus"),
    80: (Action.RESTART_RANK, "corrupted data sent to GPU"),
    85: (Action.RESTART_RANK, "copy engine exception"),
    92: (Action.IGNORE, "high single-bit ECC error rate"),
    93: (Action.IGNORE, "InfoROM wear limit exceeded"),
    94: (Action.RESTART_RANK, "contained ECC error: only the faulting application is affected"),
    95: (Action.EVICT_GPU, "uncontained ECC error"),
    109: (Action.EVICT_GPU, "context switch timeout"),
    110: (Action.EVICT_GPU, "security fault"),
    119: (Action.EVICT_GPU, "GSP RPC timeout"),
    120: (Action.EVICT_GPU, "GSP error"),
    121: (Action.IGNORE, "corrected C2C link error"),
    136: (Action.EVICT_GPU, "NVLink training failed"),
    137: (Action.IGNORE, "NVLink privilege error (application access)"),
    140: (Action.EVICT_GPU, "unrecovered ECC error"),
    141: (Action.IGNORE, "CUDA fast path error"),
    143: (Action.EVICT_GPU, "GPU initialization error"),
    144: (Action.IGNORE, "NVLink SAW error (action follows the recovery action field)"),
    145: (Action.IGNORE, "NVLink RLW error (action follows the recovery action field)"),
    146: (Action.IGNORE, "NVLink TLW error (action follows the recovery action field)"),
    147: (Action.IGNORE, "NVLink TREX error (action follows the recovery action field)"),
    148: (Action.IGNORE, "NVLink NVLPW_CTRL error (action follows the recovery action field)"),
    149: (Action.IGNORE, "NVLink NETIR error (action follows the recovery action field)"),
    150: (Action.IGNORE, "NVLink MSE error (action follows the recovery action field)"),
    151: (Action.EVICT_NODE, "key rotation error: restart the VM"),
    154: (Action.IGNORE, "GPU recovery action changed (read from the recovery action field)"),
    155: (Action.EVICT_GPU, "NVLink software-defined error"),
    156: (Action.EVICT_GPU, "resource retirement event: GPU reset needed"),
    157: (Action.IGNORE, "resource retirement failure"),
    158: (Action.EVICT_GPU, "GPU fatal timeout"),
}

# nvmlDeviceGpuRecoveryAction_t values (NVML_GPU_RECOVERY_ACTION_*), kept here so
# that the policy does not import pynvml.
RECOVERY_ACTIONS: dict[int, tuple[Action, str]] = {
    0: (Action.IGNORE, "none"),
    1: (Action.EVICT_GPU, "GPU reset required"),
    2: (Action.EVICT_NODE, "node reboot required"),
    3: (Action.EVICT_GPU, "drain peer-to-peer traffic"),
    4: (Action.EVICT_GPU, "drain peer-to-peer traffic and reset the GPU"),
    5: (Action.EVICT_NODE, "recover the IMEX domain"),
    6: (Action.EVICT_GPU, "reset the GPU's PCIe bus"),
    7: (Action.EVICT_NODE, "system reboot required"),
}

POLICY_FILE_LIMIT = 1 << 20
"""Bytes an Xid policy file may hold (a table of a few hundred codes is a few kilobytes)."""


def decide(signal: HealthSignal, table: XidTable = DEFAULT_TABLE) -> Decision:
    """The action ``signal`` calls for, with a one-line reason; ``table`` maps Xid codes."""
    gpu = f"GPU {signal.gpu_index}"
    kind, value = signal.kind, signal.value
    if kind == "xid":
        if value in table:
            action, text = table[value]
            return Decision(action, f"{gpu}: Xid {value} ({text})")
        return Decision(Action.IGNORE, f"{gpu}: Xid {value} is not in the Xid table; ignored")
    if kind == "ecc_uncorrected":
        if value > 0:
            return Decision(Action.EVICT_GPU, f"{gpu}: volatile uncorrected ECC errors rose to {value}")
        return Decision(Action.IGNORE, f"{gpu}: no volatile uncorrected ECC errors")
    if kind == "row_remap_failure":
        if value:
            return Decision(Action.EVICT_GPU, f"{gpu}: row remapping failed")
        return Decision(Action.IGNORE, f"{gpu}: no row remapping failure")
    if kind == "row_remap_pending":
        if value:
            return Decision(Action.IGNORE, f"{gpu}: row remapping pending; reset the GPU when convenient")
        return Decision(Action.IGNORE, f"{gpu}: no row remapping pending")
    if kind == "recovery_action":
        if value in RECOVERY_ACTIONS:
            action, text = RECOVERY_ACTIONS[value]
            return Decision(action, f"{gpu}: driver recovery action {value} ({text})")
        return Decision(Action.EVICT_GPU, f"{gpu}: unknown driver recovery action {value}")
    if kind == "gpu_lost":
        return Decision(Action.EVICT_NODE, f"{gpu}: GPU is lost (NVML_ERROR_GPU_IS_LOST)")
    return Decision(Action.IGNORE, f"{gpu}: unknown health signal {kind!r} = {value}; ignored")


def parse_action(name: object) -> Action:
    """The ``Action`` named ``name`` (``"evict_gpu"``, ``"EVICT-GPU"``...); ValueError if none."""
    if isinstance(name, str):
        key = name.strip().lower().replace("-", "_")
        for action in Action:
            if action.value == key:
                return action
    choices = ", ".join(a.value for a in Action)
    raise ValueError(f"unknown action {repr(name)[:40]} (choose from {choices})")


def load_table(path: str | Path, base: XidTable = DEFAULT_TABLE) -> dict[int, tuple[Action, str]]:
    """``base`` with the Xid overrides of a TOML or JSON file applied.

    The file holds one table, ``xid``, mapping Xid codes to action names:
    ``{"xid": {"13": "evict_gpu"}}`` or, in TOML, ``[xid]`` then ``13 = "evict_gpu"``.
    A ``.toml`` file is read as TOML, anything else as JSON.  Bad input raises a
    one-line ``UsageError`` that names the file and the fix.
    """
    path = Path(path)
    try:
        text = read_small_file(path, POLICY_FILE_LIMIT)[0].decode("utf-8")
    except Unreadable as exc:
        raise UsageError(f"cannot read health policy file {path}: {exc}") from None
    except UnicodeDecodeError:
        raise UsageError(f"health policy file {path} is not UTF-8 text: save it as UTF-8") from None
    data = _parse(path, text)
    if not isinstance(data, dict) or set(data) - {"xid"}:
        extra = sorted(set(data) - {"xid"}) if isinstance(data, dict) else None
        what = f"unknown keys {str(extra)[:100]}" if extra else "not a table"
        raise UsageError(f"health policy file {path}: {what}; expected only an 'xid' table of code = action")
    overrides = data.get("xid", {})
    if not isinstance(overrides, dict):
        raise UsageError(f"health policy file {path}: 'xid' must be a table of code = action")
    table = dict(base)
    for key, name in overrides.items():
        code = _parse_code(path, key)
        try:
            action = parse_action(name)
        except ValueError as exc:
            raise UsageError(f"health policy file {path}: Xid {code}: {exc}") from None
        old = table.get(code)
        text = old[1] if old else "set by health policy file"
        table[code] = (action, text)
    return table


def _parse(path: Path, text: str) -> Any:
    """The file's content as TOML (by suffix) or JSON; UsageError on a syntax error."""
    is_toml = path.suffix.lower() == ".toml"
    kind = "TOML" if is_toml else "JSON"
    try:
        return tomllib.loads(text) if is_toml else json.loads(text)
    except (tomllib.TOMLDecodeError, json.JSONDecodeError) as exc:
        message = " ".join(str(exc).split())
        raise UsageError(f"health policy file {path} is not valid {kind}: {message}") from None
    except (RecursionError, ValueError):  # nested too deeply, or a number too long for int()
        raise UsageError(f"health policy file {path} is not a policy: {kind} nested too deeply or with a "
                         "number too long; expected one 'xid' table of code = action") from None


MAX_XID = 2**32 - 1
"""The largest Xid code: NVML reports them as 32-bit values."""


def _parse_code(path: Path, key: object) -> int:
    """An Xid code from a table key ("13" or 13); UsageError unless a whole number from 1 to MAX_XID, in
    ASCII digits."""
    text = str(key).strip() if isinstance(key, (str, int)) and not isinstance(key, bool) else ""
    if not (text.isascii() and text.isdigit() and len(text) <= 10 and 0 < int(text) <= MAX_XID):
        raise UsageError(f"health policy file {path}: {str(key)[:40]!r} is not an Xid code (a whole number from "
                         f"1 to {MAX_XID})")
    return int(text)
