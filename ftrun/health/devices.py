"""Plain Python values from NVML: which GPUs the ranks use, a GPU's description, field values."""

from __future__ import annotations

import ctypes
from typing import Any

_VALUE_ATTRS = (
    ("NVML_VALUE_TYPE_UNSIGNED_INT", "uiVal"),
    ("NVML_VALUE_TYPE_UNSIGNED_LONG", "ulVal"),
    ("NVML_VALUE_TYPE_UNSIGNED_LONG_LONG", "ullVal"),
    ("NVML_VALUE_TYPE_SIGNED_LONG_LONG", "sllVal"),
    ("NVML_VALUE_TYPE_SIGNED_INT", "siVal"),
)


def visible_gpus(cuda_visible_devices: str | None, uuids: list[str]) -> dict[int, int]:
    """Physical NVML index -> local rank for the GPUs that ``CUDA_VISIBLE_DEVICES`` exposes.

    ``uuids`` lists every GPU's UUID in NVML order; None means the variable is unset
    (every GPU, in order).  Entries are indices or ``GPU-`` UUIDs (a unique prefix
    will do); as in CUDA, the list ends at the first entry that names no GPU.
    Indices are taken in NVML's (PCI bus) order, as with CUDA_DEVICE_ORDER=PCI_BUS_ID.
    """
    if cuda_visible_devices is None:
        return {gpu: gpu for gpu in range(len(uuids))}
    bare = [u.lower().removeprefix("gpu-") for u in uuids]
    mapping: dict[int, int] = {}
    for entry in cuda_visible_devices.split(","):
        entry = entry.strip().lower()
        if entry.isdigit():
            found = [int(entry)] if int(entry) < len(uuids) else []
        else:
            prefix = entry.removeprefix("gpu-")
            found = [i for i, u in enumerate(bare) if prefix and u.startswith(prefix)]
        if len(found) != 1 or found[0] in mapping:
            break
        mapping[found[0]] = len(mapping)
    return mapping


def listed_gpus(cuda_visible_devices: str) -> int:
    """How many GPUs ``CUDA_VISIBLE_DEVICES`` lists, read as :func:`visible_gpus` reads it but without NVML to
    look them up: the entries (indices, ``GPU-``/``MIG-`` UUIDs) before the first that is neither (``-1``,
    ``none``, ``void``...) or repeats one before it."""
    seen: list[str] = []
    for entry in cuda_visible_devices.split(","):
        entry = entry.strip().lower()
        if entry.isascii() and entry.isdigit():
            entry = entry.lstrip("0") or "0"
        elif not (entry.startswith(("gpu-", "mig-")) and len(entry) > 4):
            break
        if entry in seen:
            break
        seen.append(entry)
    return len(seen)


def describe_device(nvml: Any, handle: Any, *, index: int, local_rank: int, lost: bool) -> dict[str, Any]:
    """One GPU as a dict for a status display; values NVML cannot give (or a lost GPU) are None.

    ``nvml`` is the initialised ``pynvml`` module (or None); nothing here raises.
    """
    ok = nvml is not None and handle is not None and not lost

    def query(name: str, *args: Any) -> Any:
        try:
            return getattr(nvml, name)(handle, *args) if ok else None
        except Exception:  # NVMLError, a function this pynvml lacks, or a library that fails otherwise
            return None

    def const(name: str) -> Any:
        return getattr(nvml, name, None)

    memory = query("nvmlDeviceGetMemoryInfo")
    utilization = query("nvmlDeviceGetUtilizationRates")
    uncorrected = const("NVML_MEMORY_ERROR_TYPE_UNCORRECTED")
    return {
        "index": index,
        "local_rank": local_rank,
        "lost": lost,
        "name": text(query("nvmlDeviceGetName")),
        "uuid": text(query("nvmlDeviceGetUUID")),
        "memory_total": getattr(memory, "total", None),
        "memory_used": getattr(memory, "used", None),
        "temperature": query("nvmlDeviceGetTemperature", const("NVML_TEMPERATURE_GPU")),
        "utilization": getattr(utilization, "gpu", None),
        "ecc_uncorrected_volatile": query("nvmlDeviceGetTotalEccErrors", uncorrected, const("NVML_VOLATILE_ECC")),
        "ecc_uncorrected_aggregate": query("nvmlDeviceGetTotalEccErrors", uncorrected, const("NVML_AGGREGATE_ECC")),
    }


def text(value: Any) -> Any:
    """A str from an NVML string, which older pynvml releases return as bytes."""
    return value.decode(errors="replace") if isinstance(value, bytes) else value


def field_int(nvml: Any, value: Any) -> int:
    """The integer in one ``nvmlFieldValue_t`` returned by ``nvmlDeviceGetFieldValues``."""
    attr = next((a for c, a in _VALUE_ATTRS if getattr(nvml, c, None) == value.valueType), "uiVal")
    return int(getattr(value.value, attr))


def handle_key(handle: Any) -> Any:
    """A hashable key for an NVML device handle: the address behind a ctypes handle."""
    try:
        return ctypes.cast(handle, ctypes.c_void_p).value
    except (ctypes.ArgumentError, TypeError):
        return handle
