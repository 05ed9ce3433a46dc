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

START_TIMEOUT = 60.0
"""Seconds NVML has to initialise and list the GPUs (several per GPU without persistence mode): past them, a
driver that hangs (a GPU fallen off the bus) leaves monitoring off rather than the job not starting."""
REPEAT_WINDOW = 1.0
"""Seconds within which a signal the same as the last one reported (GPU, kind, value) is counted, not reported
again: a driver that floods one Xid would otherwise flood the agent, its console and its event log."""
MAX_REMEMBERED = 4096
"""Signals whose last report is remembered for :data:`REPEAT_WINDOW` (more are forgotten together)."""
MAX_EVENT_RATE = 1000
"""NVML events read per second at most; more wait in the driver's queue (which the driver bounds)."""

_UNSET: Any = object()
_FAILED: Any = object()
_EVENT, _NO_EVENT = "event", "no event"


def gpu_count(timeout: float = START_TIMEOUT) -> int:
    """How many GPUs NVML lists: 0 without NVML (no library, no driver, no GPU), or when it does not answer
    within ``timeout`` seconds (a driver that hangs)."""
    counted: list[int] = []

    def count() -> None:
        try:
            nvml = importlib.import_module("pynvml")
            nvml.nvmlInit()
            try:
                counted.append(max(0, int(nvml.nvmlDeviceGetCount())))
            finally:
                nvml.nvmlShutdown()
        except Exception:  # NVML missing, no driver, no GPU: all mean "no GPU here"
            pass

    thread = threading.Thread(target=count, name="ftrun-gpu-count", daemon=True)
    thread.start()
    thread.join(timeout)
    return counted[0] if counted else 0


class NvmlMonitor:
    """Reports GPU health changes of this node's visible GPUs to ``on_signal``.

    One per agent: ``start`` starts one background thread, the only one that calls
    NVML (a call that hangs holds no other thread), which calls ``nvmlInit`` once,
    waits for Xid and double-bit ECC events (``event_timeout`` seconds at a time,
    so that ``stop`` is prompt) and, every ``poll_interval`` seconds, reads the
    volatile uncorrected ECC count, the row remapping flags, the driver's GPU
    recovery action and what :meth:`describe_devices` shows.  Each Xid event is
    reported (a repeat of the last report within :data:`REPEAT_WINDOW` is counted
    into the next one instead); polled values are reported when
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
        self._devices: list[dict[str, Any]] = []  # what describe_devices() shows, as the last poll read it
        self._last: dict[tuple[int, str, int], tuple[float, int]] = {}  # a signal's last report, repeats since
        self._stop = threading.Event()
        self._started = threading.Event()
        self._start_error: str | None = None
        self._thread: threading.Thread | None = None

    @property
    def gpus(self) -> dict[int, int]:
        """Watched GPUs: physical NVML index -> local rank."""
        return dict(self._ranks)

    def start(self) -> bool:
        """Start watching once NVML is initialised and the GPUs listed (on the monitor's thread, within
        :data:`START_TIMEOUT`); False (after one log line) when NVML is unusable or does not answer."""
        if self._thread is not None:
            return True
        try:
            nvml = importlib.import_module("pynvml")
        except ImportError as exc:
            return self._unavailable(f"cannot import pynvml: {exc}")
        self._stop.clear()
        self._started.clear()
        thread = threading.Thread(target=self._run, args=(nvml,), name="ftrun-nvml-monitor", daemon=True)
        thread.start()
        if not self._started.wait(START_TIMEOUT):
            self._stop.set()  # should NVML ever answer, the thread shuts it down and ends
            return self._unavailable(f"NVML did not answer within {START_TIMEOUT:g} s")
        if self._start_error is not None:
            thread.join()
            return self._unavailable(self._start_error)
        self._thread = thread
        return True

    def stop(self, timeout: float = 5.0) -> None:
        """Stop the thread; it frees the event set and shuts NVML down as it exits."""
        thread, self._thread = self._thread, None
        self._stop.set()
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)

    def poll(self) -> None:
        """Read every watched GPU's polled values once and report what changed (the monitor's thread)."""
        for gpu in sorted(self._ranks):
            if self._nvml is None or self._stop.is_set():
                return
            if self._handles.get(gpu) is None:
                self._lose(gpu, "no NVML handle at start")
                continue
            for check in (self._check_ecc, self._check_remap, self._check_recovery):
                self._guarded(check, gpu)
            if all((gpu, f) in self._unsupported for f in ("ecc", "remap", "recovery")):
                self._call(gpu, "probe", "nvmlDeviceGetTemperature", self._nvml.NVML_TEMPERATURE_GPU)
        self._devices = self._describe()

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
        return {
            gpu: {name: "lost" if gpu in self._lost else "unsupported" if (gpu, feature) in self._unsupported
                  else self._state.get((gpu, key)) for name, feature, key in fields}
            for gpu in sorted(self._ranks)
        }

    def describe_devices(self) -> list[dict[str, Any]]:
        """One dict per watched GPU for a status display, as the last poll read it (it calls no NVML itself:
        a call that hangs would hold the caller); values NVML cannot give are None."""
        return self._devices

    def _describe(self) -> list[dict[str, Any]]:
        return [describe_device(self._nvml, self._handles.get(gpu), index=gpu, local_rank=self._ranks[gpu],
                                lost=gpu in self._lost) for gpu in sorted(self._ranks)]

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

    def _open(self, nvml: Any) -> str | None:
        """Initialise NVML, list the watched GPUs, register for their events and describe them: why NVML is
        unusable, or None."""
        try:
            nvml.nvmlInit()
        except Exception as exc:  # NVMLError, or OSError from a broken library
            return f"nvmlInit failed: {exc}"
        self._nvml = nvml
        try:
            self._open_devices()
        except Exception as exc:
            return f"cannot list GPUs: {exc}"
        if not self._ranks:
            return f"no GPU is visible (CUDA_VISIBLE_DEVICES={self._cvd!r})"
        self._register_events()
        self._devices = self._describe()
        return None

    def _register_events(self) -> None:
        nvml = self._nvml
        try:
            wanted = nvml.nvmlEventTypeXidCriticalError | getattr(nvml, "nvmlEventTypeDoubleBitEccError", 0)
            event_set = nvml.nvmlEventSetCreate()
        except Exception as exc:  # NVMLError, or a library of another shape
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

    def _run(self, nvml: Any) -> None:
        try:
            self._start_error = self._open(nvml)
            self._started.set()
            if self._start_error is None:
                self._watch()
        except Exception as exc:  # NVML's answers of another shape than its own: monitoring ends, in one line
            self._log_once(("monitor",), f"GPU health monitoring stopped: {type(exc).__name__}: {exc}")
        finally:
            self._shutdown()
            self._started.set()

    def _watch(self) -> None:
        """Poll every ``poll_interval`` s; between polls wait for events, each wait its whole time even where
        NVML answers at once (no event, or a GPU lost), and read at most MAX_EVENT_RATE events a second."""
        next_poll = time.monotonic()
        second, events = time.monotonic(), 0
        while not self._stop.is_set():
            if time.monotonic() >= next_poll:
                self.poll()
                next_poll = time.monotonic() + self.poll_interval
            wait = max(0.001, min(self.event_timeout, next_poll - time.monotonic()))
            began = time.monotonic()
            outcome = self._wait_event(wait) if self._event_set is not None else _NO_EVENT
            if outcome is _EVENT:
                events = events + 1 if began - second < 1.0 else 1
                second = second if began - second < 1.0 else began
                if events >= MAX_EVENT_RATE:
                    self._stop.wait(max(0.0, second + 1.0 - time.monotonic()))
                continue
            if outcome is not _NO_EVENT:  # a GPU is lost: find out which at the next poll, not at once
                next_poll = min(next_poll, time.monotonic())
            self._stop.wait(max(0.0, wait - (time.monotonic() - began)))

    def _shutdown(self) -> None:
        nvml, self._nvml = self._nvml, None
        if nvml is not None:
            if self._event_set is not None:
                _quietly(nvml.nvmlEventSetFree, self._event_set)
            _quietly(nvml.nvmlShutdown)
        self._event_set = None
        self._devices = self._describe()  # as the GPUs are no longer watched: unknown values

    def _wait_event(self, timeout: float) -> str:
        """Wait up to ``timeout`` s for one event and report it: _EVENT, _NO_EVENT, or "lost"."""
        nvml = self._nvml
        try:
            data = nvml.nvmlEventSetWait(self._event_set, max(1, int(timeout * 1000)))
            gpu = self._by_key.get(handle_key(data.device))
            kind, code = int(data.eventType), int(data.eventData)
        except nvml.NVMLError_Timeout:
            return _NO_EVENT
        except nvml.NVMLError_GpuIsLost:
            return "lost"
        except Exception as exc:  # NVMLError, or an answer of another shape
            self._log_once(("wait", str(exc)), f"GPU health: waiting for NVML events failed: {exc}")
            return _NO_EVENT
        if gpu is None:
            return _EVENT
        if kind & nvml.nvmlEventTypeXidCriticalError:
            self._emit("xid", gpu, code, f"Xid {code} reported by the driver")
        elif (gpu, "ecc") in self._unsupported:
            self._emit("ecc_uncorrected", gpu, 1, "double-bit ECC error event")
        else:
            self._guarded(self._check_ecc, gpu)
        return _EVENT

    def _guarded(self, check: Callable[[int], None], gpu: int) -> None:
        """``check(gpu)``; an answer of another shape than NVML's (None, a short tuple) counts as a failed call."""
        try:
            check(gpu)
        except Exception as exc:
            self._log_once((gpu, check.__name__), f"GPU {gpu}: NVML's answer to {check.__name__[7:]} is not one "
                                                  f"it gives ({type(exc).__name__}: {exc})")

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
        except Exception as exc:  # NVMLError, or OSError from a broken library
            self._log_once((gpu, name, str(exc)), f"GPU {gpu}: {name} failed: {exc}")
        return _FAILED

    def _lose(self, gpu: int, detail: str) -> None:
        if gpu not in self._lost:
            self._lost.add(gpu)
            self._emit("gpu_lost", gpu, 1, f"NVML reports the GPU is lost ({detail})")

    def _emit(self, kind: str, gpu: int, value: int, detail: str) -> None:
        key, now = (gpu, kind, value), time.monotonic()
        last, repeats = self._last.get(key, (-REPEAT_WINDOW, 0))
        if now - last < REPEAT_WINDOW:
            self._last[key] = (last, repeats + 1)
            return
        if len(self._last) >= MAX_REMEMBERED:
            self._last.clear()
        self._last[key] = (now, 0)
        if repeats:
            detail = f"{detail} (repeated {repeats:,} times since its last report)"
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
