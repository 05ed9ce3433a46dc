"""The real NvmlMonitor against the stand-in pynvml in tests/fake_nvml.

No test sleeps to synchronise: signals are awaited on a condition variable with
a timeout, and "nothing more was reported" is checked after waiting for the
stand-in to have served further polls.
"""

from __future__ import annotations

import importlib.util
import logging
import re
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType, SimpleNamespace

import pytest

from ftrun.health import nvml as nvml_module
from ftrun.health.devices import listed_gpus, visible_gpus
from ftrun.health.nvml import NvmlMonitor
from ftrun.health.policy import decide
from ftrun.health.signals import Action, HealthSignal

pytestmark = pytest.mark.fast

FAKE_PYNVML = Path(__file__).parents[1] / "fake_nvml" / "pynvml.py"
TIMEOUT = 10.0
ECC_CALL = "nvmlDeviceGetTotalEccErrors"


@pytest.fixture
def nvml(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    """A fresh stand-in pynvml with 4 healthy GPUs, installed as sys.modules['pynvml'] for one test."""
    spec = importlib.util.spec_from_file_location("pynvml", FAKE_PYNVML)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    monkeypatch.setitem(sys.modules, "pynvml", module)
    return module


class Recorder:
    """The on_signal callback: keeps every signal and lets a test wait for one."""

    def __init__(self) -> None:
        self.signals: list[HealthSignal] = []
        self._cond = threading.Condition()

    def __call__(self, signal: HealthSignal) -> None:
        with self._cond:
            self.signals.append(signal)
            self._cond.notify_all()

    def wait_for(self, predicate: Callable[[HealthSignal], bool], what: str) -> HealthSignal:
        with self._cond:
            found = self._cond.wait_for(lambda: [s for s in self.signals if predicate(s)], timeout=TIMEOUT)
        assert found, f"no {what} signal within {TIMEOUT}s; got {self.signals}"
        return found[0]

    def of(self, kind: str, gpu: int | None = None) -> list[HealthSignal]:
        with self._cond:
            return [s for s in self.signals if s.kind == kind and gpu in (None, s.gpu_index)]


@pytest.fixture
def monitor_for() -> Iterator[Callable[..., tuple[NvmlMonitor, Recorder]]]:
    """Build monitors (polling every 20 ms unless told otherwise); all are stopped after the test."""
    monitors: list[NvmlMonitor] = []

    def make(cuda_visible_devices: str | None = None, **kwargs) -> tuple[NvmlMonitor, Recorder]:
        kwargs.setdefault("poll_interval", 0.02)
        kwargs.setdefault("event_timeout", 0.05)
        recorder = Recorder()
        monitor = NvmlMonitor(recorder, cuda_visible_devices=cuda_visible_devices, **kwargs)
        monitors.append(monitor)
        return monitor, recorder

    yield make
    for monitor in monitors:
        monitor.stop()


def wait_more_polls(nvml: ModuleType, polls: int, per_poll: int = 1) -> None:
    """Wait until the monitor has read the ECC counters ``polls`` more times."""
    target = nvml.calls[ECC_CALL] + polls * per_poll
    assert nvml.wait_calls(ECC_CALL, target, TIMEOUT), "the monitor stopped polling"


def test_xid_13_event_has_the_physical_index_and_the_local_rank(nvml, monitor_for) -> None:
    monitor, recorder = monitor_for("2,3")
    assert monitor.start()
    assert monitor.gpus == {2: 0, 3: 1}

    nvml.inject_xid(0, 13)  # not visible to this node's ranks: not watched
    nvml.inject_xid(3, 13)
    signal = recorder.wait_for(lambda s: s.kind == "xid", "Xid")
    assert (signal.gpu_index, signal.local_rank, signal.value) == (3, 1, 13)
    assert signal.time > 0
    assert decide(signal).action is Action.RESTART_RANK

    nvml.inject_xid(2, 31)
    signal = recorder.wait_for(lambda s: s.kind == "xid" and s.gpu_index == 2, "Xid on GPU 2")
    assert (signal.local_rank, signal.value) == (0, 31)
    assert [s.gpu_index for s in recorder.of("xid")] == [3, 2]
    assert nvml.device(0) not in nvml._event_sets[0].masks


def test_xid_79_means_gpu_lost_and_evicting_the_node(nvml, monitor_for) -> None:
    monitor, recorder = monitor_for("0,1")
    assert monitor.start()
    wait_more_polls(nvml, 1, per_poll=2)

    nvml.inject_xid(1, 79)  # the stand-in also makes GPU 1 lost, as the hardware does
    xid = recorder.wait_for(lambda s: s.kind == "xid", "Xid 79")
    lost = recorder.wait_for(lambda s: s.kind == "gpu_lost", "gpu_lost")
    assert (xid.gpu_index, xid.value, lost.gpu_index, lost.local_rank) == (1, 79, 1, 1)
    assert decide(xid).action is Action.EVICT_NODE
    assert decide(lost).action is Action.EVICT_NODE

    wait_more_polls(nvml, 3)  # GPU 0 is still polled; GPU 1 is left alone
    assert len(recorder.of("gpu_lost")) == 1
    assert monitor.describe_devices()[1]["lost"] is True


def test_ecc_increase_is_reported_once(nvml, monitor_for) -> None:
    nvml.set_ecc(1, 5)  # errors from before the start are the baseline, not news
    monitor, recorder = monitor_for("0,1")
    assert monitor.start()
    wait_more_polls(nvml, 1, per_poll=2)

    nvml.set_ecc(0, 2)
    signal = recorder.wait_for(lambda s: s.kind == "ecc_uncorrected", "ECC")
    assert (signal.gpu_index, signal.local_rank, signal.value) == (0, 0, 2)
    assert decide(signal).action is Action.EVICT_GPU

    wait_more_polls(nvml, 5, per_poll=2)
    assert recorder.of("ecc_uncorrected") == [signal]

    nvml.set_ecc(0, 3)
    recorder.wait_for(lambda s: s.kind == "ecc_uncorrected" and s.value == 3, "second ECC")
    assert len(recorder.of("ecc_uncorrected")) == 2


def test_double_bit_ecc_event_is_reported_without_waiting_for_a_poll(nvml, monitor_for) -> None:
    monitor, recorder = monitor_for("0", poll_interval=3600)
    assert monitor.start()
    assert nvml.wait_calls(ECC_CALL, 1, TIMEOUT)  # the first poll took the baseline

    nvml.inject_dbe(0)
    signal = recorder.wait_for(lambda s: s.kind == "ecc_uncorrected", "ECC")
    assert signal.value == 1


def test_gpu_lost_raised_from_a_call(nvml, monitor_for) -> None:
    monitor, recorder = monitor_for("2,3")
    assert monitor.start()
    wait_more_polls(nvml, 1, per_poll=2)

    nvml.lose_gpu(2)
    signal = recorder.wait_for(lambda s: s.kind == "gpu_lost", "gpu_lost")
    assert (signal.gpu_index, signal.local_rank) == (2, 0)
    assert decide(signal).action is Action.EVICT_NODE

    nvml.set_ecc(3, 1)  # the other GPU is still watched
    recorder.wait_for(lambda s: s.kind == "ecc_uncorrected" and s.gpu_index == 3, "ECC on GPU 3")
    assert len(recorder.of("gpu_lost")) == 1


def test_gpu_lost_found_by_a_probe_when_nothing_is_supported(nvml, monitor_for) -> None:
    nvml.set_unsupported(0, "ecc", "remap", "recovery", "events")
    monitor, recorder = monitor_for("0")
    assert monitor.start()
    assert nvml.wait_calls("nvmlDeviceGetTemperature", 1, TIMEOUT)
    assert nvml.calls["nvmlDeviceGetRemappedRows"] == 1, "an unsupported feature is not asked again"

    nvml.lose_gpu(0)
    recorder.wait_for(lambda s: s.kind == "gpu_lost", "gpu_lost")
    assert recorder.of("ecc_uncorrected") == [] and recorder.of("xid") == []


def test_row_remap_and_recovery_action_are_reported_when_they_change(nvml, monitor_for) -> None:
    nvml.set_row_remap(1, pending=True)  # already pending at start: reported
    monitor, recorder = monitor_for("0,1")
    assert monitor.start()
    pending = recorder.wait_for(lambda s: s.kind == "row_remap_pending", "row remap pending")
    assert (pending.gpu_index, pending.value) == (1, 1)
    assert decide(pending).action is Action.IGNORE

    nvml.set_row_remap(0, failure=True)
    failure = recorder.wait_for(lambda s: s.kind == "row_remap_failure", "row remap failure")
    assert (failure.gpu_index, decide(failure).action) == (0, Action.EVICT_GPU)

    nvml.set_recovery_action(0, nvml.NVML_GPU_RECOVERY_ACTION_NODE_REBOOT)
    action = recorder.wait_for(lambda s: s.kind == "recovery_action", "recovery action")
    assert (action.gpu_index, action.value, decide(action).action) == (0, 2, Action.EVICT_NODE)

    wait_more_polls(nvml, 5, per_poll=2)
    assert [len(recorder.of(k)) for k in ("row_remap_pending", "row_remap_failure", "recovery_action")] == [1, 1, 1]


def test_describe_devices(nvml, monitor_for) -> None:
    nvml.set_ecc(3, 4)
    monitor, _ = monitor_for("3,2")
    assert monitor.start()
    devices = monitor.describe_devices()
    assert [(d["index"], d["local_rank"]) for d in devices] == [(2, 1), (3, 0)]
    three = devices[1]
    assert three["name"] == "Fake GPU 80GB"
    assert three["uuid"] == nvml.device(3).uuid
    assert three["memory_total"] == 80 << 30 and three["memory_used"] == 10 << 30
    assert three["temperature"] == 43 and three["utilization"] == 50
    assert three["ecc_uncorrected_volatile"] == 4 and three["ecc_uncorrected_aggregate"] == 4
    assert three["lost"] is False


def test_gpus_named_by_uuid(nvml, monitor_for) -> None:
    uuid3, uuid1 = nvml.device(3).uuid, nvml.device(1).uuid
    monitor, recorder = monitor_for(f"{uuid3},{uuid1[:12]}")
    assert monitor.start()
    assert monitor.gpus == {3: 0, 1: 1}
    nvml.inject_xid(1, 94)
    signal = recorder.wait_for(lambda s: s.kind == "xid", "Xid")
    assert (signal.gpu_index, signal.local_rank) == (1, 1)


def test_one_init_and_a_clean_stop(nvml, monitor_for) -> None:
    monitor, _ = monitor_for(None)
    assert monitor.start()
    assert monitor.start(), "a second start is a no-op"
    assert monitor.gpus == {0: 0, 1: 1, 2: 2, 3: 3}
    assert nvml.wait_calls(ECC_CALL, 4, TIMEOUT)
    monitor.stop()
    assert nvml.calls["nvmlInit"] == 1
    assert nvml.calls["nvmlEventSetFree"] == 1
    assert not nvml.initialized()
    assert monitor.describe_devices()[0]["name"] is None


def _health_records(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name.startswith("ftrun.health")]


def test_nvml_absent_start_returns_false_with_one_log_line(monkeypatch, monitor_for, caplog) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", None)  # import pynvml raises ImportError
    monitor, recorder = monitor_for("0")
    with caplog.at_level(logging.DEBUG, logger="ftrun.health"):
        assert monitor.start() is False
    records = _health_records(caplog)
    assert len(records) == 1
    assert "GPU health monitoring is off" in records[0].getMessage()
    assert "\n" not in records[0].getMessage()
    assert recorder.signals == [] and monitor.describe_devices() == []


def test_nvml_init_failure_start_returns_false_with_one_log_line(nvml, monitor_for, caplog) -> None:
    nvml.reset(init_error=nvml.NVML_ERROR_LIBRARY_NOT_FOUND)
    monitor, _ = monitor_for("0")
    with caplog.at_level(logging.DEBUG, logger="ftrun.health"):
        assert monitor.start() is False
    records = _health_records(caplog)
    assert [r.getMessage() for r in records] == [
        "GPU health monitoring is off: nvmlInit failed: NVML Shared Library Not Found"
    ]


def test_no_visible_gpu(nvml, monitor_for, caplog) -> None:
    monitor, _ = monitor_for("")
    with caplog.at_level(logging.DEBUG, logger="ftrun.health"):
        assert monitor.start() is False
    assert len(_health_records(caplog)) == 1
    assert not nvml.initialized()


@pytest.mark.parametrize(
    ("cvd", "expected"),
    [
        (None, {0: 0, 1: 1, 2: 2, 3: 3}),
        ("", {}),
        ("2,3", {2: 0, 3: 1}),
        (" 3 , 0 ", {3: 0, 0: 1}),
        ("1,9,2", {1: 0}),  # CUDA stops at the first invalid entry
        ("-1", {}),
        ("1,1", {1: 0}),
        ("GPU-cccc", {2: 0}),
        ("gpu-cccc2222,GPU-aaaa", {2: 0, 0: 1}),
        ("GPU-dd,GPU-dd", {3: 0}),
        ("GPU-,0", {}),
        ("MIG-1234", {}),
    ],
)
def test_visible_gpus(cvd: str | None, expected: dict[int, int]) -> None:
    uuids = ["GPU-aaaa0000", "GPU-bbbb1111", "GPU-cccc2222", "GPU-dddd3333"]
    assert visible_gpus(cvd, uuids) == expected


# -- a driver that misbehaves: floods, hangs, answers of other shapes, waits that do not wait ----------------------

def test_a_flood_of_one_xid_is_reported_once_a_window_then_with_its_count(nvml, monitor_for, monkeypatch) -> None:
    """A driver that repeats one Xid without end (each wait answers at once) gets it reported once per
    REPEAT_WINDOW, the repeats counted into the next report: not once per event, which flooded the agent's
    queue, console and event log without bound."""
    monkeypatch.setattr(nvml_module, "REPEAT_WINDOW", 3600.0)
    monkeypatch.setattr(nvml_module, "MAX_EVENT_RATE", 10**9)

    def flood(event_set, timeoutms):
        nvml._enter("nvmlEventSetWait")
        return SimpleNamespace(device=nvml.device(0), eventType=nvml.nvmlEventTypeXidCriticalError, eventData=43)

    monkeypatch.setattr(nvml, "nvmlEventSetWait", flood)
    monitor, recorder = monitor_for("0", poll_interval=3600)
    assert monitor.start()
    assert nvml.wait_calls("nvmlEventSetWait", 500, TIMEOUT)
    assert [(s.kind, s.value, s.detail) for s in recorder.of("xid")] == [("xid", 43, "Xid 43 reported by the driver")]
    monkeypatch.setattr(nvml_module, "REPEAT_WINDOW", 0.0)
    again = recorder.wait_for(lambda s: "repeated" in s.detail, "the repeats' report")
    assert re.fullmatch(r"Xid 43 reported by the driver \(repeated [\d,]+ times since its last report\)", again.detail)
    assert int(re.search(r"[\d,]+", again.detail.split("repeated ")[1])[0].replace(",", "")) >= 499


def test_a_hung_nvml_call_holds_only_the_monitors_thread(nvml, monitor_for, monkeypatch) -> None:
    """A GPU fallen off the bus can make NVML calls hang: describe_devices() and readings(), which the agent's
    loop calls for `ftrun status`, answer from what the monitor last read, whatever NVML does meanwhile."""
    entered, release = threading.Event(), threading.Event()
    reads = nvml.nvmlDeviceGetTemperature

    def hang(handle, sensor):
        if entered.is_set() or nvml.calls[ECC_CALL] >= 4:
            entered.set()
            release.wait(TIMEOUT)
        return reads(handle, sensor)

    monkeypatch.setattr(nvml, "nvmlDeviceGetTemperature", hang)
    monitor, _ = monitor_for("0,1")
    try:
        assert monitor.start()
        assert entered.wait(TIMEOUT), "the monitor never reached the call that hangs"
        answers: list = []
        reader = threading.Thread(target=lambda: answers.extend([monitor.describe_devices(), monitor.readings()]))
        reader.start()
        reader.join(TIMEOUT)
        assert not reader.is_alive(), "a status read waited on the hung NVML call"
        assert [d["temperature"] for d in answers[0]] == [40, 41] and sorted(answers[1]) == [0, 1]
    finally:
        release.set()


def test_nvml_that_does_not_answer_at_start_leaves_monitoring_off_in_one_line(nvml, monitor_for, monkeypatch,
                                                                              caplog) -> None:
    release = threading.Event()
    monkeypatch.setattr(nvml_module, "START_TIMEOUT", 0.2)
    monkeypatch.setattr(nvml, "nvmlInit", lambda: release.wait(TIMEOUT))
    monitor, _ = monitor_for("0")
    try:
        with caplog.at_level(logging.DEBUG, logger="ftrun.health"):
            assert monitor.start() is False
        assert [r.getMessage() for r in _health_records(caplog)] == [
            "GPU health monitoring is off: NVML did not answer within 0.2 s"]
        assert nvml_module.gpu_count(timeout=0.2) == 0  # the command line's count: no GPU, rather than no answer
    finally:
        release.set()


def test_answers_of_another_shape_than_nvmls_cost_one_line_each_and_the_watch_goes_on(nvml, monitor_for, monkeypatch,
                                                                                      caplog) -> None:
    def broken(*args):
        nvml._enter(ECC_CALL)
        raise RuntimeError("driver exploded")

    monkeypatch.setattr(nvml, ECC_CALL, broken)
    monkeypatch.setattr(nvml, "nvmlDeviceGetRemappedRows", lambda handle: (0, 0))  # a 2-tuple, not 4
    monkeypatch.setattr(nvml, "nvmlEventSetCreate", lambda: 1 / 0)
    monitor, recorder = monitor_for("0")
    with caplog.at_level(logging.DEBUG, logger="ftrun.health"):
        assert monitor.start() and monitor.event_gpus == []  # no events: polling only
        wait_more_polls(nvml, 3)
        nvml.set_recovery_action(0, nvml.NVML_GPU_RECOVERY_ACTION_NODE_REBOOT)
        recorder.wait_for(lambda s: s.kind == "recovery_action", "the recovery action, polled after both")
    warnings = [r.getMessage() for r in _health_records(caplog) if r.levelno >= logging.WARNING]
    assert len(warnings) == 2, warnings
    assert "nvmlDeviceGetTotalEccErrors failed: driver exploded" in warnings[0]
    assert "NVML's answer to remap is not one it gives (ValueError" in warnings[1]


def test_a_wait_for_events_that_answers_at_once_still_waits_its_time(nvml, monitor_for, monkeypatch) -> None:
    """NVML's event wait answering "timeout" (or "a GPU is lost") at once made the monitor spin a core."""
    def at_once(event_set, timeoutms):
        nvml._enter("nvmlEventSetWait")
        raise nvml.NVMLError(nvml.NVML_ERROR_TIMEOUT)

    monkeypatch.setattr(nvml, "nvmlEventSetWait", at_once)
    monitor, _ = monitor_for("0", poll_interval=3600, event_timeout=0.05)
    assert monitor.start()
    assert nvml.wait_calls("nvmlEventSetWait", 1, TIMEOUT)
    began = time.monotonic()
    assert nvml.wait_calls("nvmlEventSetWait", 6, TIMEOUT)
    assert time.monotonic() - began >= 5 * 0.05 * 0.9  # five more waits of 50 ms each, at the least


@pytest.mark.parametrize(("cvd", "count"), [
    ("0,1,2,3", 4), ("", 0), ("-1", 0), ("0,-1,1", 1), ("0,0", 1), ("00,0", 1), ("void", 0), ("none", 0),
    ("NoDevFiles", 0), ("GPU-ab,GPU-cd", 2), ("MIG-x,0", 2), ("GPU-", 0), (" 2 , 3 ", 2), ("\u0663", 0),
    ("0," * 1000, 1), (",".join(map(str, range(2000))), 2000),
])
def test_the_gpus_a_cuda_visible_devices_lists_are_counted_as_cuda_reads_it(cvd: str, count: int) -> None:
    assert listed_gpus(cvd) == count
