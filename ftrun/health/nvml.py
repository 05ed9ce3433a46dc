"""NvmlMonitor: watches the GPUs of this node's ranks through NVML (the ``pynvml`` module)."""

from __future__ import annotations

import importlib
import logging
import os
import threading
import time
from collections.abc import Callable
from typing import Any

from ftrun.health.devices import describe_device, field_int, handle_key, text, visible_gpus
from ftrun.health.signals import HealthSignal

log = logging.getLogger("ftrun.health")

_UNSET: Any = object()
_FAILED: Any = object()


class NvmlMonitor:
    """Reports GPU health changes of this node's visible GPUs to ``on_signal``.

    One per agent: ``start`` calls ``nvmlInit`` once and starts one background thread
    that waits for Xid and double-bit ECC events (``event_timeout`` seconds at a
    time, so that ``stop`` is prompt) and, every ``poll_interval`` seconds, reads the
    volatile uncorrected ECC count, the row remapping flags and the driver's GPU
    recovery action.  Each Xid event is reported; polled values are reported when
    they change (ECC counts when they rise above the count seen at start, also read
    at once on a double-bit ECC event; flags and the recovery action when they
    differ from their healthy 0, including at start).  A
    GPU that NVML reports lost is reported once as ``gpu_lost`` and then left alone;
    a feature a GPU does not support is skipped for that GPU.  ``on_signal`` runs on
    the monitor thread.  ``cuda_visible_devices`` defaults to this process's
    ``CUDA_VISIBLE_DEVICES``; it picks the GPUs watched and their local ranks.
    """

    def __init__(
        self,
        on_signal: Callable[[HealthSignal], None],
        *,
        poll_interval: float = 5.0,
        event_timeout: float = 0.5,
        cuda_visible_devices: str | None = _UNSET,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._on_signal = on_signal
        self.poll_interval = poll_interval
        self.event_timeout = event_timeout
        if cuda_visible_devices is _UNSET:
            cuda_visible_devices = os.environ.get("CUDA_VISIBLE_DEVICES")
        self._cvd: str | None = cuda_visible_devices
        self._clock = clock
        self._nvml: Any = None
        self._handles: dict[int, Any] = {}
        self._ranks: dict[int, int] = {}
        self._by_key: dict[Any, int] = {}
        self._event_set: Any = None
        self._event_gpus: list[int] = []
        self._state: dict[tuple[int, str], int] = {}
        self._unsupported: set[tuple[int, str]] = set()
        self._lost: set[int] = set()
        self._logged: set[tuple[Any, ...]] = set()
        self._lock = threading.RLock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def gpus(self) -> dict[int, int]:
        """Watched GPUs: physical NVML index -> local rank."""
        return dict(self._ranks)

    def start(self) -> bool:
        """Initialise NVML and start watching; False (after one log line) when NVML is unusable."""
        if self._thread is not None:
            return True
        try:
            nvml = importlib.import_module("pynvml")
        except ImportError as exc:
            return self._unavailable(f"cannot import pynvml: {exc}")
        try:
            nvml.nvmlInit()
        except Exception as exc:  # NVMLError, or OSError from a broken library
            return self._unavailable(f"nvmlInit failed: {exc}")
        self._nvml = nvml
        try:
            self._open_devices()
        except Exception as exc:
            self._shutdown()
            return self._unavailable(f"cannot list GPUs: {exc}")
        if not self._ranks:
            self._shutdown()
            return self._unavailable(f"no GPU is visible (CUDA_VISIBLE_DEVICES={self._cvd!r})")
        self._register_events()
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="ftrun-nvml-monitor", daemon=True)
        self._thread.start()
        return True

    def stop(self, timeout: float = 5.0) -> None:
        """Stop the thread; it frees the event set and shuts NVML down as it exits."""
        thread, self._thread = self._thread, None
        self._stop.set()
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)

    def poll(self) -> None:
        """Read every watched GPU's polled values once and report what changed."""
        with self._lock:
            for gpu in sorted(self._ranks):
                if self._nvml is None or self._stop.is_set():
                    return
                if self._handles.get(gpu) is None:
                    self._lose(gpu, "no NVML handle at start")
                    continue
                self._check_ecc(gpu)
                self._check_remap(gpu)
                self._check_recovery(gpu)
                if all((gpu, f) in self._unsupported for f in ("ecc", "remap", "recovery")):
                    self._call(gpu, "probe", "nvmlDeviceGetTemperature", self._nvml.NVML_TEMPERATURE_GPU)

    @property
    def event_gpus(self) -> list[int]:
        """The watched GPUs registered for Xid and double-bit ECC events (the others are only polled)."""
        return list(self._event_gpus)

    def readings(self) -> dict[int, dict[str, Any]]:
        """Per watched GPU, what the polls last read: volatile uncorrected ECC count, row remapping flags,
        recovery action; None until read, "unsupported" where the GPU lacks the feature, "lost" once lost.
        """
        fields = (("ecc_uncorrected_volatile", "ecc", "ecc"), ("row_remap_pending", "remap", "row_remap_pending"),
                  ("row_remap_failure", "remap", "row_remap_failure"), ("recovery_action", "recovery", "recovery_action"))
        with self._lock:
            return {
                gpu: {name: "lost" if gpu in self._lost else "unsupported" if (gpu, feature) in self._unsupported
                      else self._state.get((gpu, key)) for name, feature, key in fields}
                for gpu in sorted(self._ranks)
            }

    def describe_devices(self) -> list[dict[str, Any]]:
        """One dict per watched GPU for a status display; values NVML cannot give are None."""
        with self._lock:
            return [
                describe_device(self._nvml, self._handles.get(gpu), index=gpu,
                                local_rank=self._ranks[gpu], lost=gpu in self._lost)
                for gpu in sorted(self._ranks)
            ]

    # -- setup and the thread -------------------------------------------------------

    def _unavailable(self, reason: str) -> bool:
        log.warning("GPU health monitoring is off: %s", " ".join(reason.split()))
        return False

    def _open_devices(self) -> None:
        nvml = self._nvml
        handles: dict[int, Any] = {}
        uuids: list[str] = []
        for gpu in range(nvml.nvmlDeviceGetCount()):
            try:
                handles[gpu] = nvml.nvmlDeviceGetHandleByIndex(gpu)
                uuids.append(text(nvml.nvmlDeviceGetUUID(handles[gpu])) or "")
            except nvml.NVMLError as exc:
                handles.setdefault(gpu, None)
                uuids.append("")
                if not isinstance(exc, nvml.NVMLError_GpuIsLost):
                    raise
        self._ranks = visible_gpus(self._cvd, uuids)
        self._handles = {gpu: handles[gpu] for gpu in self._ranks}
        self._by_key = {handle_key(h): gpu for gpu, h in self._handles.items() if h is not None}

    def _register_events(self) -> None:
        nvml = self._nvml
        wanted = nvml.nvmlEventTypeXidCriticalError | getattr(nvml, "nvmlEventTypeDoubleBitEccError", 0)
        try:
            event_set = nvml.nvmlEventSetCreate()
        except nvml.NVMLError as exc:
            log.info("GPU health: no NVML events (%s); polling only", exc)
            return
        self._event_gpus = []
        for gpu in self._handles:
            supported = self._call(gpu, "event_types", "nvmlDeviceGetSupportedEventTypes")
            mask = wanted & supported if supported is not _FAILED else 0
            if mask and self._call(gpu, "events", "nvmlDeviceRegisterEvents", mask, event_set) is not _FAILED:
                self._event_gpus.append(gpu)
        if self._event_gpus:
            self._event_set = event_set
        else:
            _quietly(nvml.nvmlEventSetFree, event_set)

    def _run(self) -> None:
        try:
            next_poll = time.monotonic()
            while not self._stop.is_set():
                if time.monotonic() >= next_poll:
                    self.poll()
                    next_poll = time.monotonic() + self.poll_interval
                wait = max(0.001, min(self.event_timeout, next_poll - time.monotonic()))
                if self._event_set is None:
                    self._stop.wait(wait)
                else:
                    self._wait_event(wait)
        finally:
            with self._lock:
                self._shutdown()

    def _shutdown(self) -> None:
        nvml, self._nvml = self._nvml, None
        if nvml is not None:
            if self._event_set is not None:
                _quietly(nvml.nvmlEventSetFree, self._event_set)
            _quietly(nvml.nvmlShutdown)
        self._event_set = None

    def _wait_event(self, timeout: float) -> None:
        nvml = self._nvml
        try:
            data = nvml.nvmlEventSetWait(self._event_set, max(1, int(timeout * 1000)))
        except nvml.NVMLError_Timeout:
            return
        except nvml.NVMLError_GpuIsLost:
            self.poll()  # find out which GPU
            return
        except nvml.NVMLError as exc:
            self._log_once(("wait", str(exc)), f"GPU health: waiting for NVML events failed: {exc}")
            self._stop.wait(timeout)
            return
        with self._lock:
            gpu = self._by_key.get(handle_key(data.device))
            if gpu is None:
                return
            if data.eventType & nvml.nvmlEventTypeXidCriticalError:
                self._emit("xid", gpu, int(data.eventData), f"Xid {int(data.eventData)} reported by the driver")
            elif (gpu, "ecc") in self._unsupported:
                self._emit("ecc_uncorrected", gpu, 1, "double-bit ECC error event")
            else:
                self._check_ecc(gpu)

    # -- polled values --------------------------------------------------------------

    def _check_ecc(self, gpu: int) -> None:
        nvml = self._nvml
        count = self._call(gpu, "ecc", "nvmlDeviceGetTotalEccErrors",
                           nvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, nvml.NVML_VOLATILE_ECC)
        if count is _FAILED:
            return
        old, self._state[(gpu, "ecc")] = self._state.get((gpu, "ecc")), int(count)
        if old is not None and count > old:
            self._emit("ecc_uncorrected", gpu, int(count), f"volatile uncorrected ECC errors {old} -> {count}")

    def _check_remap(self, gpu: int) -> None:
        rows = self._call(gpu, "remap", "nvmlDeviceGetRemappedRows")
        if rows is not _FAILED:
            _corrected, _uncorrected, pending, failure = rows
            self._flag(gpu, "row_remap_pending", int(bool(pending)), "row remapping pending (GPU reset needed)")
            self._flag(gpu, "row_remap_failure", int(bool(failure)), "row remapping failure")

    def _check_recovery(self, gpu: int) -> None:
        nvml = self._nvml
        field = getattr(nvml, "NVML_FI_DEV_GET_GPU_RECOVERY_ACTION", None)
        if field is None:
            self._unsupported.add((gpu, "recovery"))
        values = self._call(gpu, "recovery", "nvmlDeviceGetFieldValues", [field])
        if values is _FAILED:
            return
        value = values[0]
        if value.nvmlReturn == nvml.NVML_ERROR_GPU_IS_LOST:
            self._lose(gpu, "recovery action field")
        elif value.nvmlReturn == nvml.NVML_ERROR_NOT_SUPPORTED:
            self._unsupported.add((gpu, "recovery"))
        elif value.nvmlReturn == nvml.NVML_SUCCESS:
            action = field_int(nvml, value)
            self._flag(gpu, "recovery_action", action, f"driver GPU recovery action {action}")

    def _flag(self, gpu: int, kind: str, value: int, detail: str) -> None:
        old, self._state[(gpu, kind)] = self._state.get((gpu, kind), 0), value
        if old != value:
            self._emit(kind, gpu, value, detail if value else f"{kind} cleared")

    def _call(self, gpu: int, feature: str, name: str, *args: Any) -> Any:
        """``pynvml.<name>(handle, *args)`` for one GPU; _FAILED on any NVML error."""
        nvml = self._nvml
        handle = self._handles.get(gpu)
        if nvml is None or handle is None or gpu in self._lost or (gpu, feature) in self._unsupported:
            return _FAILED
        try:
            return getattr(nvml, name)(handle, *args)
        except nvml.NVMLError_GpuIsLost:
            self._lose(gpu, f"{name} failed")
        except (nvml.NVMLError_NotSupported, nvml.NVMLError_FunctionNotFound, AttributeError):
            self._unsupported.add((gpu, feature))
        except nvml.NVMLError as exc:
            self._log_once((gpu, name, str(exc)), f"GPU {gpu}: {name} failed: {exc}")
        return _FAILED

    def _lose(self, gpu: int, detail: str) -> None:
        if gpu not in self._lost:
            self._lost.add(gpu)
            self._emit("gpu_lost", gpu, 1, f"NVML reports the GPU is lost ({detail})")

    def _emit(self, kind: str, gpu: int, value: int, detail: str) -> None:
        rank = self._ranks.get(gpu)
        signal = HealthSignal(kind, gpu, value, detail, self._clock(), rank)
        log.info("GPU %d (local rank %s): %s %d: %s", gpu, rank, kind, value, detail)
        try:
            self._on_signal(signal)
        except Exception:
            log.exception("GPU health: the signal handler failed on %s", signal)

    def _log_once(self, key: tuple[Any, ...], message: str) -> None:
        if key not in self._logged:
            self._logged.add(key)
            log.warning("%s", message)


def _quietly(fn: Callable[..., Any], *args: Any) -> None:
    try:
        fn(*args)
    except Exception:
        pass
