"""GPU health on a live job: the real NVML monitor, fed by the stand-in pynvml, acts on real workers.

The launcher runs with tests/fake_nvml first on PYTHONPATH, so its NvmlMonitor imports the stand-in (4
GPUs, CUDA_VISIBLE_DEVICES=0,1,2,3: local rank i uses GPU i). The test pulls the stand-in's trigger by
appending a line to the file named by FAKE_NVML_SCRIPT, when the job's output shows the step it wants;
the workers (tests/workloads/await_train.py) wait on the event log where an order must be guaranteed.
Everything else is real: processes, TCPStore, Gloo, in-place recovery.
"""

from __future__ import annotations

import importlib.util
import os
import selectors
import signal
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from types import ModuleType, SimpleNamespace

import pytest

from conftest import ROOT
from ftrun.agent.gpu_health import DRAIN_BATCH, GpuHealth
from ftrun.event_log import read_events
from ftrun.events import EventLog
from ftrun.health.nvml import NvmlMonitor
from ftrun.health.policy import DEFAULT_TABLE
from ftrun.health.signals import Action
from runs import NO_WATCHDOG, NPROC, RTOL, STEPS, TIMEOUT, TRAINING, Run, check_steps, read_run

FAKE_NVML = ROOT / "tests" / "fake_nvml"


@pytest.fixture
def gpu_job(live_job, workload, tmp_path):
    """Start a 4-worker await_train.py job over the stand-in NVML; returns a Drill to drive it."""

    def start(*ftrun_args: str, wait: str = "") -> Drill:
        script = tmp_path / "nvml_script"
        script.touch()
        log_dir = tmp_path / "logs"
        env = {"PYTHONPATH": os.pathsep.join([str(FAKE_NVML), str(ROOT)]), "FAKE_NVML_SCRIPT": str(script),
               "CUDA_VISIBLE_DEVICES": "0,1,2,3", "AWAIT": wait, "FAULTS": ""}
        proc, _ = live_job("--nproc-per-node", NPROC, "--log-dir", log_dir, *NO_WATCHDOG, *ftrun_args,
                           workload("await_train.py"), *TRAINING, env=env)
        return Drill(proc, script, log_dir)

    return start


class Drill:
    """A running job over the stand-in NVML: read its output, pull NVML triggers, collect the Run."""

    def __init__(self, proc: subprocess.Popen, script: Path, log_dir: Path) -> None:
        self.proc, self.script, self.log_dir = proc, script, log_dir
        self.stdout: list[str] = []

    def nvml(self, command: str) -> None:
        """Have the stand-in NVML deliver ``command`` (``xid GPU CODE``...) to the monitor."""
        with open(self.script, "a") as f:
            f.write(command + "\n")

    def on_lines(self, triggers: list[tuple[Callable[[str], bool], str]]) -> Run:
        """Pull each trigger's NVML command at the first output line it matches (in order); wait for the end."""
        pending = list(triggers)
        for line in self.proc.stdout:
            self.stdout.append(line)
            if pending and pending[0][0](line):
                self.nvml(pending.pop(0)[1])
        stderr = self.proc.stderr.read()
        result = subprocess.CompletedProcess(self.proc.args, self.proc.wait(timeout=TIMEOUT), "".join(self.stdout),
                                             stderr)
        run = read_run(result, self.log_dir)
        assert not pending, f"triggers never pulled: {pending}\n{run.explain()}"
        return run


def commit(step: int, world: int) -> Callable[[str], bool]:
    """Matches a worker's commit line of ``step`` in a world of ``world``."""
    return lambda line: f" world={world} step={step} " in line


def health_events(run: Run) -> list[tuple]:
    return [(e["kind"], e["gpu"], e["local_rank"], e["value"], e["action"], e["source"]) for e in run.of("gpu_health")]


def starts_by_uid(run: Run) -> dict[int, dict]:
    return {e["uid"]: e for e in run.of("worker_start")}


def test_evict_gpu_restart_rank_and_ignore_in_one_job(gpu_job, baseline, tmp_path):
    # Xid 48 on GPU 2 evicts it: its rank is killed, the 3 others go on in place. Then Xid 43, which
    # --xid-policy turns from "ignore" into "restart_rank", restarts the rank on GPU 1: killed, the 2
    # others go on, and a new worker on local rank 1 (GPU 1) joins them, without --respawn. Xid 92 on
    # GPU 3 is only recorded.
    # Order: members wait before step 3 until the first fault is logged, before step 5 until the second
    # is, and before step 8 until the replacement has been placed; the replacement waits until the
    # third drill is logged, which the test pulls once generation 2 has committed step 6: DDP, rebuilt
    # for a new generation, runs a collective in the forward pass of its second step, which a new plan
    # arriving at that moment would break (a limit of the recovery layer, not of GPU health).
    policy = tmp_path / "policy.toml"
    policy.write_text('[xid]\n43 = "restart_rank"\n')
    drill = gpu_job("--xid-policy", policy, wait="3:fault,5:fault*2,8:joined,joiner:gpu_health*3")
    run = drill.on_lines([(commit(1, 4), "xid 2 48"), (commit(4, 3), "xid 1 43"), (commit(6, 2), "xid 3 92")])
    why = run.explain()
    assert run.returncode == 0, why
    assert health_events(run) == [("xid", 2, 2, 48, "evict_gpu", "nvml"), ("xid", 1, 1, 43, "restart_rank", "nvml"),
                                  ("xid", 3, 3, 92, "ignore", "nvml")], why
    assert "ftrun: GPU health: GPU 2: Xid 48 (double-bit ECC error) -> evict_gpu" in run.stderr, why
    assert not run.of("recovery_refused") and not run.of("recovery_failed") and not run.of("group_failure"), why

    # the worker on each GPU was killed, and nothing else: the survivors are the processes started first
    starts = starts_by_uid(run)
    exits = {e["uid"]: e for e in run.of("worker_exit")}
    health = run.of("gpu_health")
    assert health[0]["pids"] == [starts[2]["pid"]] and health[1]["pids"] == [starts[1]["pid"]], why
    assert (exits[2]["exitcode"], exits[1]["exitcode"]) == (-9, -9), why
    for uid in (0, 3):
        assert (exits[uid]["pid"], exits[uid]["exitcode"]) == (starts[uid]["pid"], 0), why

    # one replacement, on the restarted rank's local rank; none ever on the evicted GPU 2
    assert sorted(starts) == [0, 1, 2, 3, 4], why
    assert (starts[4]["local_rank"], starts[4]["joiner"], exits[4]["exitcode"]) == (1, True, 0), why

    # in-place recoveries: 4 -> 3 (rank 2 lost), 3 -> 2 (rank 1 lost), 2 -> 3 (the replacement joins)
    recoveries = [(r["kind"], r["lost_ranks"], r["world_before"], r["world_after"], r["joiners"], r["steps_lost"])
                  for r in run.of("recovery")]
    assert recoveries == [("fault", [2], 4, 3, [], 0), ("fault", [1], 3, 2, [], 0), ("join", [], 2, 3, [4], 0)], why
    assert [g["members"] for g in run.of("generation")] == [[0, 1, 3], [0, 3], [0, 3, 4]], why

    # every step committed once by its generation, with the fault-free run's loss
    check_steps(run, baseline, {2: -9})
    final = run.commits()[0][-1]
    assert (final.step, final.world) == (STEPS - 1, 3) and final.loss == pytest.approx(baseline[STEPS - 1], rel=RTOL)


def test_group_restart_skips_the_evicted_gpu_and_node_eviction_ends_the_job(gpu_job, baseline):
    # Without in-place recovery, evicting GPU 2 fails the group; the restart runs 3 workers, on local
    # ranks 0, 1 and 3, as ranks 0-2 of a world of 3. Xid 79 (GPU fallen off the bus) then evicts the
    # node: every worker is killed and, restarts left or not, the job ends with the reason.
    # Members wait before step 3 until the first drill is logged, and before step 5 until the second is.
    drill = gpu_job("--no-recovery", "--max-restarts", "2", wait="3:gpu_health,5:gpu_health*2")
    run = drill.on_lines([(commit(1, 4), "xid 2 48"), (commit(4, 3), "xid 0 79")])
    why = run.explain()
    assert run.returncode == 1, why
    assert health_events(run)[:2] == [("xid", 2, 2, 48, "evict_gpu", "nvml"), ("xid", 0, 0, 79, "evict_node", "nvml")], why
    second = [e for e in run.of("worker_start") if e["attempt"] == 1]
    assert [(e["local_rank"], e["rank"]) for e in second] == [(0, 0), (1, 1), (3, 2)], why
    assert [e["attempt"] for e in run.of("attempt_end")] == [0, 1], why  # no third attempt
    for lines in run.commits(attempt=1).values():
        assert lines and all(c.world == 3 for c in lines), why
        assert all(c.loss == pytest.approx(baseline[c.step], rel=RTOL) for c in lines), why
    (end,) = run.of("end")
    assert end["outcome"] == "failed" and "this node is evicted: GPU 0: Xid 79" in end["reason"], why
    assert "failed: this node is evicted: GPU 0: Xid 79 (GPU has fallen off the bus)" in run.stderr, why
    assert "restart 2 of 2" not in run.stderr and "Traceback" not in run.stderr, why


def test_without_nvml_the_job_runs_with_one_notice(run_ftrun, workload, tmp_path):
    # pynvml that cannot be imported: the monitor stays off, one line says so, the job is unaffected
    (tmp_path / "pynvml.py").write_text("raise ImportError('no NVML on this machine')\n")
    result = run_ftrun("--nproc-per-node", 2, workload("allreduce.py"),
                       env={"PYTHONPATH": os.pathsep.join([str(tmp_path), str(ROOT)])}, timeout=TIMEOUT)
    assert result.returncode == 0, result.stderr
    notices = [line for line in result.stderr.splitlines() if "GPU health" in line]
    assert notices == ["ftrun: GPU health monitoring is off: cannot import pynvml: no NVML on this machine"], \
        result.stderr
    assert "Traceback" not in result.stderr


def test_bad_xid_policy_file_is_one_line_and_exit_2(run_ftrun, workload, tmp_path):
    policy = tmp_path / "policy.toml"
    policy.write_text('[xid]\n13 = "reboot"\n')
    result = run_ftrun("--xid-policy", policy, workload("allreduce.py"))
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        f"ftrun: error: --xid-policy: health policy file {policy}: Xid 13: unknown action 'reboot' "
        "(choose from ignore, restart_rank, evict_gpu, evict_node)"]



# ------------------------------------------------------------- GpuHealth in-process, with a stand-in agent
class StubWorker:
    """What GpuHealth reads of a worker, and the signals it was sent (with the thread that sent them)."""

    def __init__(self, uid: int, local_rank: int) -> None:
        self.uid, self.pid, self.slot = uid, 1000 + uid, SimpleNamespace(local_rank=local_rank)
        self.signals: list[tuple[int, str]] = []

    def send_signal(self, sig: int) -> None:
        self.signals.append((sig, threading.current_thread().name))


class StubNode:
    """The ports GpuHealth is given: an event log, notices, this node's workers, end_attempt; and a selector
    watching its wake pipe, as the agent's loop does."""

    def __init__(self, tmp_path: Path, nproc: int = 4) -> None:
        self.selector = selectors.DefaultSelector()
        self.events = EventLog(tmp_path / "events.jsonl")
        self.notices: list[str] = []
        self.workers = [StubWorker(uid, uid) for uid in range(nproc)]
        self.ended: list[str] = []

    def notice(self, text: str, style: str = "") -> None:
        self.notices.append(text)

    def get(self, uid: int) -> StubWorker | None:
        return self.workers[uid] if 0 <= uid < len(self.workers) else None

    def all(self) -> list[StubWorker]:
        return list(self.workers)

    def live(self) -> list[StubWorker]:
        return [w for w in self.workers if not w.signals]

    def end_attempt(self, reason: str) -> None:
        self.ended.append(reason)

    def logged(self) -> list[dict]:
        return [e for e in read_events(self.events.path) if e["event"] == "gpu_health"]


@pytest.fixture
def fake_nvml(monkeypatch) -> ModuleType:
    """The stand-in pynvml (4 GPUs, all visible) as sys.modules['pynvml'], fresh for one test."""
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)  # the machine the suite runs on is not its GPUs
    spec = importlib.util.spec_from_file_location("pynvml", FAKE_NVML / "pynvml.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    monkeypatch.setitem(sys.modules, "pynvml", module)
    return module


@pytest.fixture
def health_for(tmp_path):
    """Build a started GpuHealth over a StubNode; stopped after the test."""
    made: list[GpuHealth] = []

    def make(nproc: int = 4) -> tuple[GpuHealth, StubNode]:
        node = StubNode(tmp_path, nproc)
        health = GpuHealth(node.events, node, node, node.end_attempt, DEFAULT_TABLE, local_ranks=nproc,
                           poll_interval=0.05)
        node.selector.register(health.wake_fd, selectors.EVENT_READ, "gpu")
        health.start()
        made.append(health)
        return health, node

    yield make
    for health in made:
        health.stop()


@pytest.mark.fast
def test_a_monitor_signal_is_acted_on_by_the_loop_thread(fake_nvml, health_for, monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1,2")  # local rank 0 -> GPU 1, local rank 1 -> GPU 2
    health, agent = health_for(nproc=2)
    assert health.monitoring and health.gpu_of(1) == 2
    fake_nvml.inject_xid(2, 48)
    keys = [key for key, _ in agent.selector.select(10)]  # the wake pipe, as in the agent's loop
    assert [key.data for key in keys] == ["gpu"]
    health.drain()
    victim = agent.workers[1]
    assert victim.signals == [(signal.SIGKILL, threading.current_thread().name)] and not agent.workers[0].signals
    assert health.evicted == {2} and not health.usable(1) and health.usable(0)
    (event,) = agent.logged()
    assert (event["kind"], event["gpu"], event["local_rank"], event["value"], event["action"], event["source"],
            event["pids"]) == ("xid", 2, 1, 48, "evict_gpu", "nvml", [victim.pid])
    assert agent.notices == ["ftrun: GPU health: GPU 2: Xid 48 (double-bit ECC error) -> evict_gpu"]


@pytest.mark.fast
def test_a_burst_of_signals_is_handled_a_batch_per_wake_up_so_the_loop_serves_its_workers_between(fake_nvml,
                                                                                                   health_for):
    health, agent = health_for(nproc=2)
    for code in range(1000, 1000 + 3 * DRAIN_BATCH):  # distinct unknown Xids: each reported, each ignored
        fake_nvml.inject_xid(0, code)
    handled = 0
    while handled < 3 * DRAIN_BATCH:
        assert [key.data for key, _ in agent.selector.select(10)] == ["gpu"], f"{handled} handled, then silence"
        health.drain()
        now = len(agent.logged())
        assert now - handled <= DRAIN_BATCH
        handled = now
    assert [e["value"] for e in agent.logged()] == list(range(1000, 1000 + 3 * DRAIN_BATCH))
    assert {e["action"] for e in agent.logged()} == {"ignore"}


@pytest.mark.fast
def test_gpu_status_per_local_rank(fake_nvml, health_for):
    health, agent = health_for()
    health.inject("xid", 3, 74)  # NVLink error: evict GPU 3
    status = health.gpu_status()
    assert sorted(status) == [0, 1, 2, 3]
    assert status[3] == {"gpu_index": 3, "util": 50, "mem_used": 10 << 30, "mem_total": 80 << 30,
                         "temperature": 43, "ecc_uncorrected": 0, "last_xid": 74, "evicted": True}
    assert status[0]["last_xid"] is None and not status[0]["evicted"]


@pytest.mark.fast
def test_without_nvml_drills_use_the_local_rank_as_a_virtual_gpu(health_for, monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", None)  # import pynvml fails
    health, agent = health_for()
    assert not health.monitoring and health.gpu_status() == {}
    assert agent.notices == ["ftrun: GPU health monitoring is off: cannot import pynvml: "
                             "import of pynvml halted; None in sys.modules"]
    decision = health.inject("xid", 2, 13)
    assert decision.action is Action.RESTART_RANK and health.restarts == {2} and health.usable(2)
    assert [w.uid for w in agent.workers if w.signals] == [2]
    assert health.inject("ecc_uncorrected", 1, 2).action is Action.EVICT_GPU and not health.usable(1)
    assert health.inject("xid", 0, 92).action is Action.IGNORE and not agent.workers[0].signals
    assert health.inject("gpu_lost", 0, 1).action is Action.EVICT_NODE
    assert agent.ended == ["this node is evicted: GPU 0: GPU is lost (NVML_ERROR_GPU_IS_LOST)"]
    assert not health.usable(3)  # nothing starts on an evicted node
    assert [e["source"] for e in agent.logged()] == ["inject"] * 4
    with pytest.raises(ValueError, match="unknown health signal kind 'xdi'"):
        health.inject("xdi", 0, 13)
    with pytest.raises(ValueError, match="local rank 4 is not on this node"):
        health.inject("xid", 4, 13)


@pytest.mark.fast
def test_monitor_readings_and_event_registration_for_the_gpu_check(fake_nvml):
    fake_nvml.set_unsupported(1, "recovery", "events")
    fake_nvml.set_ecc(0, 3)
    fake_nvml.lose_gpu(3)
    monitor = NvmlMonitor(lambda signal: None, poll_interval=3600, cuda_visible_devices="0,1,2,3")
    assert monitor.start()
    try:
        monitor.poll()
        assert monitor.event_gpus == [0, 2]  # GPU 1 has no events; GPU 3 is lost
        readings = monitor.readings()
    finally:
        monitor.stop()
    assert readings[0] == {"ecc_uncorrected_volatile": 3, "row_remap_pending": 0, "row_remap_failure": 0,
                           "recovery_action": 0}
    assert readings[1]["recovery_action"] == "unsupported" and readings[1]["ecc_uncorrected_volatile"] == 0
    assert set(readings[3].values()) == {"lost"}


@pytest.mark.fast
def test_readme_xid_table_is_the_default_table():
    readme = (ROOT / "README.md").read_text()
    documented = {}
    for action in Action:
        (row,) = [line for line in readme.splitlines() if line.startswith(f"| `{action.value}` | ") and
                  line.rstrip(" |").split("| ")[-1].replace(", ", "").isdigit()]
        documented.update({int(code): action for code in row.rstrip(" |").split("| ")[-1].split(", ")})
    assert documented == {code: action for code, (action, _) in DEFAULT_TABLE.items()}
