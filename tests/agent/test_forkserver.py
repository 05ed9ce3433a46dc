"""Workers forked by the fork server (ftrun/agent/forkserver.py) are the workers a new process would be.

Real runs of tests/workloads/worker_facts.py, a torch script that writes what a worker can see of how it was
started: with the fork server and with --no-fork-server, the facts and the exit statuses are compared; the
fork server killed mid-run leaves the agent starting workers as new processes. The choice of which scripts
the server serves is tested on source files.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
from pathlib import Path

import psutil
import pytest

from ftrun.agent import forkserver
from ftrun.agent.forkserver import PRELOAD, WORKER_API, ForkServer, can_serve, preload_for
from ftrun.agent.script_imports import script_imports
from ftrun.agent.workers import WorkerSlot, fork_worker, spawn_worker
from ftrun.events import EventLog
from ftrun.status.render import describe
from runs import TIMEOUT, read_run

NPROC = 2
# What differs between any two runs, forked or not: where each one writes, its port and run id, and the
# number its control channel's descriptor happens to get (the descriptors' kinds are compared).
PER_RUN = ("MASTER_PORT", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_ERROR_FILE", "FTRUN_RUN_DIR", "FTRUN_CHANNEL_FD")
DRAWN = ("torch_seed", "torch_rand", "random")  # drawn anew by each process: must differ between workers


def facts_of(out: Path, attempt: int, rank: int) -> dict:
    return json.loads((out / f"facts_{attempt}_{rank}.json").read_text())


def comparable(facts: dict, out: Path) -> dict:
    """The facts without what differs between any two runs (the output directory named as OUT)."""
    facts = json.loads(json.dumps(facts).replace(str(out), "OUT"))
    facts["environ"] = {k: v for k, v in facts["environ"].items() if k not in PER_RUN}
    facts["fds"] = sorted(facts["fds"].values())
    for key in ("pid", *DRAWN):
        del facts[key]
    return facts


def test_a_forked_worker_is_a_new_process_to_the_script_and_restarts_from_the_server(run_ftrun, workload,
                                                                                     tmp_path):
    # attempt 0: rank 1 exits with code 3 (a group restart); attempt 1: rank 0 dies of SIGUSR1 (the end)
    runs, outs = {}, {}
    for mode, flags in (("forked", []), ("new", ["--no-fork-server"])):
        outs[mode], logs = tmp_path / mode, tmp_path / f"{mode}_logs"
        outs[mode].mkdir()
        result = run_ftrun(*flags, "--nproc-per-node", NPROC, "--max-restarts", 1, "--log-dir", logs,
                           workload("worker_facts.py"), outs[mode], "exit,signal", timeout=TIMEOUT, cwd=tmp_path)
        runs[mode] = read_run(result, logs)
    forked, new = runs["forked"], runs["new"]
    why = forked.explain() + "\n\n" + new.explain()
    assert forked.returncode == new.returncode == 1, why
    assert [e["forked"] for e in forked.of("worker_start")] == [True] * 2 * NPROC, why
    assert [e["forked"] for e in new.of("worker_start")] == [False] * 2 * NPROC and not new.of("fork_server"), why
    assert [e["state"] for e in forked.of("fork_server")] == ["ready"], why
    assert forked.of("fork_server")[0]["preloaded"] == list(PRELOAD), why  # a torch script: no worker API

    # the same exit statuses, an exit code and a death by signal, each seen by the agent as it happened
    def planted(run) -> list[tuple[int, int]]:
        pids = {e["pid"]: e["attempt"] for e in run.of("worker_start")}
        return sorted((pids[e["pid"]], e["rank"], e["exitcode"]) for e in run.of("worker_exit")
                      if (pids[e["pid"]], e["rank"]) in ((0, 1), (1, 0)))
    assert planted(forked) == planted(new) == [(0, 1, 3), (1, 0, -signal.SIGUSR1)], why

    for attempt in (0, 1):
        for rank in range(NPROC):
            seen, expected = (comparable(facts_of(outs[mode], attempt, rank), outs[mode]) for mode in ("forked", "new"))
            assert seen == expected, f"attempt {attempt} rank {rank}"
    # what a new process draws at random, each forked worker drew for itself
    for key in DRAWN:
        values = [json.dumps(facts_of(outs["forked"], a, r)[key]) for a in (0, 1) for r in range(NPROC)]
        assert len(set(values)) == len(values), key


# A module that, like torch's C++ libraries, registers a C exit handler when it is imported: at exit() it removes
# the file MARKER names. The script then leaves work for its own end: a Python atexit function, a file object it
# never closes, C stdio output it never flushes, and exit code 3.
EXIT_HANDLER_MODULE = """
import ctypes, os
libc = ctypes.CDLL(None)
libc.strdup.restype = ctypes.c_void_p  # C memory: Python's end, before exit(), frees its own objects
libc.__cxa_atexit(ctypes.cast(libc.unlink, ctypes.c_void_p), ctypes.c_void_p(libc.strdup(os.environ["MARKER"].encode())), None)
"""
EXIT_SCRIPT = """
import atexit, ctypes, sys
import registers_exit_handler
out = sys.argv[1]
atexit.register(lambda: open(out + "/atexit", "w").write("ran"))
leftover = open(out + "/leftover", "w")
leftover.write("flushed when Python ends")
libc = ctypes.CDLL(None)
libc.fopen.restype = ctypes.c_void_p
libc.fputs.argtypes = (ctypes.c_char_p, ctypes.c_void_p)
libc.fputs(b"flushed by exit", libc.fopen((out + "/c_stdio").encode(), b"w"))
sys.exit(3)
"""


def test_a_forked_worker_ends_as_python_does_but_without_the_exit_handlers_of_the_servers_imports(tmp_path):
    (tmp_path / "registers_exit_handler.py").write_text(EXIT_HANDLER_MODULE)
    script = tmp_path / "script.py"
    script.write_text(EXIT_SCRIPT)
    ends, slot = {}, WorkerSlot(uid=0, worker_id="0:0", local_rank=0, rank=0)
    for mode in ("new", "forked"):
        out, marker = tmp_path / mode, tmp_path / f"{mode}.marker"
        out.mkdir()
        marker.touch()
        command = [sys.executable, "-u", str(script), str(out)]
        env = dict(os.environ, MARKER=str(marker))
        error_file = out / "error.json"
        if mode == "new":
            worker = spawn_worker(slot, command, env, error_file)
            ended = (worker.reap(), worker.stderr.read())
        else:  # the server imports the module, so its handler is registered before the fork, as torch's are
            server = ForkServer(command, env, tmp_path / "fork_server.log", EventLog(tmp_path / "events.jsonl"),
                                node=0, preload=("registers_exit_handler",))
            try:
                assert server.ready(wait=TIMEOUT), server.reason
                worker = fork_worker(server, slot, env, error_file)
                ended = (worker.reap(), worker.stderr.read())
            finally:
                server.close()
        worker.close()
        ends[mode] = (*ended, {name: (out / name).read_text() for name in ("atexit", "leftover", "c_stdio")})
        # a new process runs the module's handler at its exit; a forked worker ends before it would
        assert marker.exists() == (mode == "forked"), mode
    assert ends["forked"] == ends["new"] == \
        (3, b"", {"atexit": "ran", "leftover": "flushed when Python ends", "c_stdio": "flushed by exit"})


def start_holding(launcher_env: dict[str, str], script: str, tmp_path: Path, nproc: int) -> tuple[subprocess.Popen,
                                                                                                 list[dict]]:
    """Start ftrun over worker_facts.py whose first attempt holds; (ftrun, its events) once every worker held."""
    logs, out = tmp_path / "logs", tmp_path / "out"
    out.mkdir()
    proc = subprocess.Popen([sys.executable, "-m", "ftrun", "--nproc-per-node", str(nproc), "--max-restarts", "1",
                             "--log-dir", str(logs), script, str(out), "hold"],
                            env=launcher_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    held = 0
    for line in proc.stdout:  # each worker says when its facts are written
        held += "facts attempt=0" in line
        if held == nproc:
            break
    if held < nproc:
        proc.kill()
        raise AssertionError(f"ftrun ended before its workers held (exit {proc.wait()}): {proc.stderr.read()}")
    (events_file,) = logs.glob("*/events.jsonl")
    return proc, [json.loads(line) for line in events_file.read_text().splitlines()]


def test_the_fork_server_killed_mid_run_leaves_workers_starting_as_new_processes(launcher_env, workload, tmp_path):
    # attempt 0 holds; killing the server kills its children (as the agent's death kills a worker), so the
    # group restarts, from new processes, and attempt 1 succeeds
    logs, out = tmp_path / "logs", tmp_path / "out"
    proc, events = start_holding(launcher_env, workload("worker_facts.py"), tmp_path, NPROC)
    try:
        (server,) = [e for e in events if e["event"] == "fork_server"]
        os.kill(server["pid"], signal.SIGKILL)
        stdout, stderr = proc.communicate(timeout=TIMEOUT)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    run = read_run(subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr), logs)
    why = run.explain()
    assert run.returncode == 0, why
    starts = [(e["attempt"], e["forked"]) for e in run.of("worker_start")]
    assert starts == [(0, True)] * NPROC + [(1, False)] * NPROC, why
    assert sorted(e["exitcode"] for e in run.of("worker_exit")) == [-signal.SIGKILL] * NPROC + [0] * NPROC, why
    assert [e["state"] for e in run.of("fork_server")] == ["ready", "gone"], why
    notices = [line for line in stderr.splitlines() if "new processes" in line]
    assert len(notices) == 1 and re.fullmatch(r"ftrun: the fork server (stopped taking requests|did not answer a "
                                              r"request): .+; workers start as new processes from now on",
                                              notices[0]), why
    assert "Traceback" not in stderr, why
    assert all((out / f"facts_1_{rank}.json").is_file() for rank in range(NPROC)), why


def test_ftrun_killed_with_sigkill_takes_the_fork_server_and_its_workers_along(launcher_env, workload, tmp_path):
    proc, events = start_holding(launcher_env, workload("worker_facts.py"), tmp_path, 1)
    pids = [e["pid"] for e in events if e["event"] in ("fork_server", "worker_start")]
    processes = [psutil.Process(pid) for pid in pids]
    assert len(processes) == 2 and [e["forked"] for e in events if e["event"] == "worker_start"] == [True]
    proc.kill()
    proc.communicate(timeout=30)
    _, alive = psutil.wait_procs(processes, timeout=10)  # both die with their parents (PR_SET_PDEATHSIG)
    assert alive == []


@pytest.mark.fast
def test_only_a_python_script_or_run_path_can_be_forked():
    python = [sys.executable, "-u"]
    assert can_serve([*python, "train.py", "--lr", "1"])
    assert can_serve([*python, "-c", "import runpy", "/abs/train.py"])  # --run-path
    assert not can_serve([*python, "-m", "pkg.train"])
    assert not can_serve(["./train.sh", "--lr", "1"])  # --no-python
    assert not can_serve(["/other/python", "-u", "train.py"])


@pytest.mark.fast
def test_a_script_imports_torch_itself_or_through_its_own_modules(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    files = {
        "direct.py": "import os\nfrom torch import nn\n",
        "api.py": "import ftrun.worker as ft\n",
        "both.py": "import ftrun\nfrom model import Net\n",
        "lazy.py": "def main():\n    import torch.distributed\n",
        "via_module.py": "from model import Net\n",
        "model.py": "import torch\nNet = None\n",
        "via_package.py": "import pkg.sub\n",
        "pkg/__init__.py": "",
        "pkg/sub.py": "from . import inner\n",
        "pkg/inner.py": "import torch.nn\n",
        "plain.py": "import json, sys\nimport torchvision_like\n",
        "broken.py": "import torch(\n",
        "cycle_a.py": "import cycle_b\n",
        "cycle_b.py": "import cycle_a\n",
        "long_name.py": f"import torch\nimport {'m' * 300}\n",  # no such file can be looked up: not a traceback
    }
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    torch_scripts = {"direct.py", "lazy.py", "via_module.py", "via_package.py", "model.py", "pkg/sub.py",
                     "pkg/inner.py", "long_name.py"}
    imported = {name: script_imports(name) for name in files if name.endswith(".py") and not name.endswith("__init__.py")}
    assert imported == {name: frozenset({"torch"}) if name in torch_scripts else
                        frozenset({"ftrun"}) if name == "api.py" else
                        frozenset({"torch", "ftrun"}) if name == "both.py" else frozenset() for name in imported}
    assert script_imports("missing.py") == frozenset()
    # what the fork server imports for each: torch's modules, and the worker API's where the script imports ftrun
    assert preload_for(frozenset({"torch"})) == PRELOAD
    assert preload_for(imported["api.py"]) == preload_for(imported["both.py"]) == PRELOAD + WORKER_API


@pytest.mark.fast
def test_fork_server_events_are_described():
    assert describe({"event": "fork_server", "state": "ready", "reason": None, "seconds": 4.3}) == \
        "fork server ready (imports took 4.3 s)"
    assert describe({"event": "fork_server", "state": "gone", "reason": "stopped taking requests: EPIPE"}) == \
        "fork server gone: stopped taking requests: EPIPE"


def test_a_fork_server_sigkill_cannot_end_holds_the_agent_no_longer_than_its_reap_timeout(tmp_path, freezer,
                                                                                          monkeypatch):
    monkeypatch.setattr(forkserver, "REAP_TIMEOUT", 1.0)
    script = tmp_path / "script.py"
    script.write_text("pass\n")
    server = ForkServer([sys.executable, "-u", str(script)], dict(os.environ), tmp_path / "fork_server.log",
                        EventLog(tmp_path / "events.jsonl"), node=0, preload=("json",))
    assert server.ready(wait=TIMEOUT), server.reason
    freezer.add(server.pid)
    freezer.freeze()  # as a process stuck in the kernel: SIGKILL does not end it until thawed
    closing = threading.Thread(target=server.close)
    closing.start()
    closing.join(TIMEOUT)
    assert not closing.is_alive(), "close() waited on for a server that cannot end"
    assert server.proc.poll() is None  # still there, frozen: left to end on its own
    freezer.thaw()
    assert server.proc.wait(timeout=TIMEOUT) == -signal.SIGKILL
