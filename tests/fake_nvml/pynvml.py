"""A stand-in for the ``pynvml`` module (nvidia-ml-py) that the GPU health tests load.

It mirrors the names, constants and exception classes of the real module that
``ftrun.health`` uses, and simulates a node of GPUs in memory.  Tests drive it
with the module-level control functions at the bottom (``reset``, ``inject_xid``,
``set_ecc``, ``lose_gpu``...).  ``nvmlEventSetWait`` blocks on a condition
variable until an event is injected or its timeout passes, as the real call does.

Another process (a test driving a launcher that imports this module) injects
through a script file: where the environment variable ``FAKE_NVML_SCRIPT`` names
one, ``nvmlEventSetWait`` applies each complete line appended to it, such as
``xid 2 48`` or ``dbe 1`` (see ``SCRIPT_COMMANDS``), looking at it every 50 ms.
"""

from __future__ import annotations

import os
import threading
import time
from collections import Counter, deque
from types import SimpleNamespace
from typing import Any

# -- constants, values as in the real pynvml -------------------------------------------

NVML_SUCCESS = 0
NVML_ERROR_UNINITIALIZED = 1
NVML_ERROR_INVALID_ARGUMENT = 2
NVML_ERROR_NOT_SUPPORTED = 3
NVML_ERROR_TIMEOUT = 10
NVML_ERROR_LIBRARY_NOT_FOUND = 12
NVML_ERROR_FUNCTION_NOT_FOUND = 13
NVML_ERROR_GPU_IS_LOST = 15
NVML_ERROR_UNKNOWN = 999

NVML_TEMPERATURE_GPU = 0
NVML_VOLATILE_ECC = 0
NVML_AGGREGATE_ECC = 1
NVML_MEMORY_ERROR_TYPE_CORRECTED = 0
NVML_MEMORY_ERROR_TYPE_UNCORRECTED = 1
NVML_VALUE_TYPE_UNSIGNED_INT = 1
NVML_FI_DEV_GET_GPU_RECOVERY_ACTION = 230

NVML_GPU_RECOVERY_ACTION_NONE = 0
NVML_GPU_RECOVERY_ACTION_GPU_RESET = 1
NVML_GPU_RECOVERY_ACTION_NODE_REBOOT = 2
NVML_GPU_RECOVERY_ACTION_DRAIN_P2P = 3
NVML_GPU_RECOVERY_ACTION_DRAIN_AND_RESET = 4

nvmlEventTypeNone = 0x0000000000000000
nvmlEventTypeSingleBitEccError = 0x0000000000000001
nvmlEventTypeDoubleBitEccError = 0x0000000000000002
nvmlEventTypeXidCriticalError = 0x0000000000000008


# -- exceptions: NVMLError(code) builds the subclass for the code, as in the real module --

class NVMLError(Exception):
    """An NVML error; ``value`` is the NVML return code."""

    _valClassMapping: dict[int, type] = {}

    def __new__(cls, value: int = NVML_ERROR_UNKNOWN) -> "NVMLError":
        if cls is NVMLError:
            cls = NVMLError._valClassMapping.get(value, cls)
        obj = Exception.__new__(cls)
        obj.value = value
        return obj

    def __init__(self, value: int = NVML_ERROR_UNKNOWN) -> None:
        super().__init__(self.value)

    def __str__(self) -> str:
        return _MESSAGES.get(self.value, f"NVML Error with code {self.value}")


def _error_class(name: str, code: int) -> type:
    cls = type(name, (NVMLError,), {"__new__": lambda c, *a: NVMLError.__new__(c, code)})
    NVMLError._valClassMapping[code] = cls
    return cls


NVMLError_Uninitialized = _error_class("NVMLError_Uninitialized", NVML_ERROR_UNINITIALIZED)
NVMLError_InvalidArgument = _error_class("NVMLError_InvalidArgument", NVML_ERROR_INVALID_ARGUMENT)
NVMLError_NotSupported = _error_class("NVMLError_NotSupported", NVML_ERROR_NOT_SUPPORTED)
NVMLError_Timeout = _error_class("NVMLError_Timeout", NVML_ERROR_TIMEOUT)
NVMLError_LibraryNotFound = _error_class("NVMLError_LibraryNotFound", NVML_ERROR_LIBRARY_NOT_FOUND)
NVMLError_FunctionNotFound = _error_class("NVMLError_FunctionNotFound", NVML_ERROR_FUNCTION_NOT_FOUND)
NVMLError_GpuIsLost = _error_class("NVMLError_GpuIsLost", NVML_ERROR_GPU_IS_LOST)
NVMLError_Unknown = _error_class("NVMLError_Unknown", NVML_ERROR_UNKNOWN)

_MESSAGES = {
    NVML_ERROR_UNINITIALIZED: "Uninitialized",
    NVML_ERROR_INVALID_ARGUMENT: "Invalid Argument",
    NVML_ERROR_NOT_SUPPORTED: "Not Supported",
    NVML_ERROR_TIMEOUT: "Timeout",
    NVML_ERROR_LIBRARY_NOT_FOUND: "NVML Shared Library Not Found",
    NVML_ERROR_FUNCTION_NOT_FOUND: "Function Not Found",
    NVML_ERROR_GPU_IS_LOST: "GPU is lost",
    NVML_ERROR_UNKNOWN: "Unknown Error",
}


# -- the simulated node ---------------------------------------------------------------

class _Device:
    """One simulated GPU; its instance is the device handle."""

    def __init__(self, index: int) -> None:
        self.index = index
        self.uuid = f"GPU-{index:08x}-fake-4000-8000-{index:012x}"
        self.ecc_volatile = 0
        self.ecc_aggregate = 0
        self.remap_pending = 0
        self.remap_failure = 0
        self.recovery_action = NVML_GPU_RECOVERY_ACTION_NONE
        self.lost = False
        self.unsupported: set[str] = set()
        self.event_types = nvmlEventTypeXidCriticalError | nvmlEventTypeDoubleBitEccError

    def __repr__(self) -> str:
        return f"<fake nvmlDevice {self.index}>"


class _EventSet:
    def __init__(self) -> None:
        self.masks: dict[_Device, int] = {}
        self.queue: deque[SimpleNamespace] = deque()


_cond = threading.Condition()
_devices: list[_Device] = []
_event_sets: list[_EventSet] = []
_init_count = 0
_init_error: int | None = None
calls: Counter[str] = Counter()
"""How many times each NVML function was called (since the last ``reset``)."""


def _enter(name: str, device: _Device | None = None, feature: str | None = None) -> None:
    """Count a call and raise what the real library would for the device's state."""
    with _cond:
        calls[name] += 1
        _cond.notify_all()
    if _init_count <= 0:
        raise NVMLError(NVML_ERROR_UNINITIALIZED)
    if device is not None:
        if device.lost:
            raise NVMLError(NVML_ERROR_GPU_IS_LOST)
        if feature is not None and feature in device.unsupported:
            raise NVMLError(NVML_ERROR_NOT_SUPPORTED)


# -- the NVML functions the monitor uses ------------------------------------------------

def nvmlInit() -> None:
    global _init_count
    with _cond:
        calls["nvmlInit"] += 1
    if _init_error is not None:
        raise NVMLError(_init_error)
    _init_count += 1


def nvmlShutdown() -> None:
    global _init_count
    _enter("nvmlShutdown")
    _init_count -= 1


def nvmlDeviceGetCount() -> int:
    _enter("nvmlDeviceGetCount")
    return len(_devices)


def nvmlDeviceGetHandleByIndex(index: int) -> _Device:
    _enter("nvmlDeviceGetHandleByIndex")
    if not 0 <= index < len(_devices):
        raise NVMLError(NVML_ERROR_INVALID_ARGUMENT)
    return _devices[index]


def nvmlDeviceGetUUID(handle: _Device) -> str:
    _enter("nvmlDeviceGetUUID", handle)
    return handle.uuid


def nvmlDeviceGetName(handle: _Device) -> str:
    _enter("nvmlDeviceGetName", handle)
    return "Fake GPU 80GB"


def nvmlDeviceGetMemoryInfo(handle: _Device, version: int | None = None) -> SimpleNamespace:
    _enter("nvmlDeviceGetMemoryInfo", handle)
    return SimpleNamespace(total=80 << 30, free=70 << 30, used=10 << 30)


def nvmlDeviceGetTemperature(handle: _Device, sensor: int) -> int:
    _enter("nvmlDeviceGetTemperature", handle)
    return 40 + handle.index


def nvmlDeviceGetUtilizationRates(handle: _Device) -> SimpleNamespace:
    _enter("nvmlDeviceGetUtilizationRates", handle)
    return SimpleNamespace(gpu=50, memory=20)


def nvmlDeviceGetTotalEccErrors(handle: _Device, errorType: int, counterType: int) -> int:
    _enter("nvmlDeviceGetTotalEccErrors", handle, "ecc")
    if errorType != NVML_MEMORY_ERROR_TYPE_UNCORRECTED:
        return 0
    return handle.ecc_volatile if counterType == NVML_VOLATILE_ECC else handle.ecc_aggregate


def nvmlDeviceGetRemappedRows(device: _Device) -> tuple[int, int, int, int]:
    _enter("nvmlDeviceGetRemappedRows", device, "remap")
    return (0, 0, device.remap_pending, device.remap_failure)


def nvmlDeviceGetFieldValues(handle: _Device, fieldIds: list[Any]) -> list[SimpleNamespace]:
    _enter("nvmlDeviceGetFieldValues", handle)
    values = []
    for field in fieldIds:
        field_id = field[0] if isinstance(field, tuple) else field
        known = field_id == NVML_FI_DEV_GET_GPU_RECOVERY_ACTION and "recovery" not in handle.unsupported
        values.append(SimpleNamespace(
            fieldId=field_id, scopeId=0, timestamp=0, latencyUsec=0,
            valueType=NVML_VALUE_TYPE_UNSIGNED_INT,
            nvmlReturn=NVML_SUCCESS if known else NVML_ERROR_NOT_SUPPORTED,
            value=SimpleNamespace(uiVal=handle.recovery_action if known else 0),
        ))
    return values


def nvmlDeviceGetSupportedEventTypes(handle: _Device) -> int:
    _enter("nvmlDeviceGetSupportedEventTypes", handle, "events")
    return handle.event_types


def nvmlEventSetCreate() -> _EventSet:
    _enter("nvmlEventSetCreate")
    event_set = _EventSet()
    with _cond:
        _event_sets.append(event_set)
    return event_set


def nvmlDeviceRegisterEvents(handle: _Device, eventTypes: int, eventSet: _EventSet) -> None:
    _enter("nvmlDeviceRegisterEvents", handle, "events")
    if eventTypes & ~handle.event_types:
        raise NVMLError(NVML_ERROR_NOT_SUPPORTED)
    with _cond:
        eventSet.masks[handle] = eventSet.masks.get(handle, 0) | eventTypes


def nvmlEventSetWait(eventSet: _EventSet, timeoutms: int) -> SimpleNamespace:
    """The next event of the set; NVMLError_Timeout after ``timeoutms`` without one."""
    _enter("nvmlEventSetWait")
    deadline = time.monotonic() + timeoutms / 1000.0
    script = os.environ.get("FAKE_NVML_SCRIPT")
    while True:
        if script:
            _run_script(script)
        remaining = deadline - time.monotonic()
        with _cond:
            if _cond.wait_for(lambda: eventSet.queue, timeout=min(remaining, 0.05) if script else remaining):
                return eventSet.queue.popleft()
        if time.monotonic() >= deadline:
            raise NVMLError(NVML_ERROR_TIMEOUT)


def nvmlEventSetFree(eventSet: _EventSet) -> None:
    _enter("nvmlEventSetFree")
    with _cond:
        if eventSet in _event_sets:
            _event_sets.remove(eventSet)


# -- control surface for tests ----------------------------------------------------------

def reset(gpus: int = 4, init_error: int | None = None) -> None:
    """Start over with ``gpus`` healthy GPUs; ``init_error`` makes nvmlInit raise that code."""
    global _init_count, _init_error
    with _cond:
        _devices[:] = [_Device(i) for i in range(gpus)]
        _event_sets.clear()
        calls.clear()
        _init_count = 0
        _init_error = init_error


def device(gpu: int) -> _Device:
    """The simulated GPU at NVML index ``gpu``, to change its state directly."""
    return _devices[gpu]


def _post(gpu: int, event_type: int, data: int) -> None:
    with _cond:
        dev = _devices[gpu]
        for event_set in _event_sets:
            if event_set.masks.get(dev, 0) & event_type:
                event_set.queue.append(SimpleNamespace(
                    device=dev, eventType=event_type, eventData=data, gpuInstanceId=0, computeInstanceId=0))
        _cond.notify_all()


def inject_xid(gpu: int, code: int) -> None:
    """Deliver an Xid critical error event; Xid 79 also makes the GPU lost, as on real hardware."""
    if code == 79:
        lose_gpu(gpu)
    _post(gpu, nvmlEventTypeXidCriticalError, code)


def inject_dbe(gpu: int) -> None:
    """Add one volatile uncorrected ECC error and deliver a double-bit ECC event."""
    set_ecc(gpu, _devices[gpu].ecc_volatile + 1)
    _post(gpu, nvmlEventTypeDoubleBitEccError, 0)


def set_ecc(gpu: int, count: int) -> None:
    """Set the volatile (and raise the aggregate) uncorrected ECC count."""
    with _cond:
        dev = _devices[gpu]
        dev.ecc_aggregate += max(0, count - dev.ecc_volatile)
        dev.ecc_volatile = count


def set_row_remap(gpu: int, pending: bool = False, failure: bool = False) -> None:
    """Set the row remapping flags reported by nvmlDeviceGetRemappedRows."""
    with _cond:
        _devices[gpu].remap_pending, _devices[gpu].remap_failure = int(pending), int(failure)


def set_recovery_action(gpu: int, action: int) -> None:
    """Set the value of the NVML_FI_DEV_GET_GPU_RECOVERY_ACTION field."""
    with _cond:
        _devices[gpu].recovery_action = action


def set_unsupported(gpu: int, *features: str) -> None:
    """Make features ("ecc", "remap", "recovery", "events") raise NOT_SUPPORTED on a GPU."""
    with _cond:
        _devices[gpu].unsupported.update(features)


def lose_gpu(gpu: int) -> None:
    """From now on every call on the GPU raises NVMLError_GpuIsLost."""
    with _cond:
        _devices[gpu].lost = True


def wait_calls(name: str, count: int, timeout: float = 5.0) -> bool:
    """Block until ``name`` has been called ``count`` times in all; False on timeout."""
    with _cond:
        return _cond.wait_for(lambda: calls[name] >= count, timeout=timeout)


def initialized() -> bool:
    """Whether nvmlInit has been called more often than nvmlShutdown."""
    return _init_count > 0


SCRIPT_COMMANDS = {
    "xid": inject_xid,  # xid GPU CODE
    "dbe": inject_dbe,  # dbe GPU
    "ecc": set_ecc,  # ecc GPU COUNT
    "recovery": set_recovery_action,  # recovery GPU ACTION
    "lose": lose_gpu,  # lose GPU
}
"""The commands of a ``FAKE_NVML_SCRIPT`` file: one per line, the name then integer arguments."""
_script_read = 0


def _run_script(path: str) -> None:
    """Apply the complete lines appended to the script file since the last look."""
    global _script_read
    try:
        with open(path, "rb") as f:
            f.seek(_script_read)
            data = f.read()
    except FileNotFoundError:
        return
    complete = data[: data.rfind(b"\n") + 1]
    _script_read += len(complete)
    for line in complete.decode().splitlines():
        if line.strip():
            name, *args = line.split()
            SCRIPT_COMMANDS[name](*map(int, args))


reset()
