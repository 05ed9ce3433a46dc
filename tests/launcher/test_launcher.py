"""The launcher's torchrun-compatible behaviour, checked with real `ftrun` and `torchrun` processes."""

from __future__ import annotations

import functools
import json
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

FTRUN = [sys.executable, "-m", "ftrun"]
TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]
# Variables that legitimately differ between two launches: a fresh run id, a free port, a temp path.
PER_LAUNCH = {"TORCHELASTIC_RUN_ID", "MASTER_PORT", "TORCHELASTIC_ERROR_FILE"}
FTRUN_CORE_VARS = {"FTRUN_UID", "FTRUN_RUN_DIR", "FTRUN_CHANNEL_FD"}


# --------------------------------------------------------------------------------------------- helpers
def wait_for_files(paths: list[Path], proc: subprocess.Popen, timeout: float = 30) -> None:
    """Wait until every path exists; fail early if ``proc`` ends first."""
    deadline = time.monotonic() + timeout
    while not all(p.exists() for p in paths):
        if proc.poll() is not None:
            out, err = proc.communicate()
            pytest.fail(f"launcher ended ({proc.returncode}) before its workers started:\n{out}\n{err}")
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting for {[str(p) for p in paths if not p.exists()]}")
        time.sleep(0.02)


def gone(proc: psutil.Process) -> bool:
    """True when the process has ended (a zombie waiting for a reaper counts as ended)."""
    try:
        return proc.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def still_running(procs: list[psutil.Process], timeout: float = 10) -> list[psutil.Process]:
    """Wait up to ``timeout`` seconds for the processes to end; return those still running."""
    deadline = time.monotonic() + timeout
    alive = [p for p in procs if not gone(p)]
    while alive and time.monotonic() < deadline:
        psutil.wait_procs(alive, timeout=0.1)
        alive = [p for p in alive if not gone(p)]
    return alive


def read_envs(out_dir: Path) -> dict[str, dict[str, str]]:
    """The environments written by dump_env.py, keyed by file stem (env_<attempt>_<local rank>)."""
    return {p.stem: json.loads(p.read_text()) for p in sorted(out_dir.glob("env_*.json"))}


def added(env: dict[str, str], parent: dict[str, str]) -> dict[str, str]:
    """Variables the launcher set or changed on top of its own environment."""
    return {k: v for k, v in env.items() if parent.get(k) != v}


def report_of(stderr: str) -> str:
    """ftrun's final failure report: everything from its 'ftrun: <script> failed' line on."""
    lines = stderr.splitlines()
    start = next((i for i, line in enumerate(lines) if line.startswith("ftrun: ") and line.endswith(" failed")), None)
    assert start is not None, f"no failure report in stderr:\n{stderr}"
    return "\n".join(lines[start:])


@functools.cache
def installed_torchrun_flags() -> frozenset[str]:
    """The flags of the torchrun installed beside the tests, from its own parser (torch 2.6's lacks flags that
    today's has)."""
    from torch.distributed.run import get_args_parser

    return frozenset(get_args_parser()._option_string_actions)


def launch_both(torchrun_args: list[str], ftrun_args: list[str], env: dict[str, str],
                torchrun_env: dict[str, str] | None = None):
    """Run torchrun and ftrun side by side (they don't share ports or output dirs), torchrun with
    ``torchrun_env`` added to ``env``; return both results."""
    procs = [subprocess.Popen(cmd, env=cmd_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for cmd, cmd_env in (([*TORCHRUN, *torchrun_args], {**env, **(torchrun_env or {})}),
                                  ([*FTRUN, *ftrun_args], env))]
    results = []
    for proc in procs:
        try:
            out, err = proc.communicate(timeout=60)
        finally:
            proc.kill()
        results.append(subprocess.CompletedProcess(proc.args, proc.returncode, out, err))
    return results


# ------------------------------------------------------------------------------------ 1. environment
def _assert_env_parity(tmp_path, workload, launcher_env, extra_t, extra_f, check_per_launch,
                        per_launch=PER_LAUNCH):
    t_dir, f_dir = tmp_path / "torchrun", tmp_path / "ftrun"
    t_dir.mkdir()
    f_dir.mkdir()
    dump = workload("dump_env.py")
    t_res, f_res = launch_both(["--nproc-per-node", "2", *extra_t, dump, str(t_dir)],
                               ["--nproc-per-node", "2", *extra_f, dump, str(f_dir)], launcher_env)
    assert t_res.returncode == 0, t_res.stderr
    assert f_res.returncode == 0, f_res.stderr
    t_envs, f_envs = read_envs(t_dir), read_envs(f_dir)
    assert set(t_envs) == set(f_envs) == {"env_0_0", "env_0_1"}
    # ftrun sets what today's torchrun sets; an older torchrun (2.6) lacks the variable of a flag it lacks
    newer = set() if "--signals-to-handle" in installed_torchrun_flags() else {"TORCHELASTIC_SIGNALS_TO_HANDLE"}
    for name in t_envs:
        t_env = added(t_envs[name], launcher_env)
        f_env = added(f_envs[name], launcher_env)
        assert FTRUN_CORE_VARS <= set(f_env), f"ftrun's own variables missing: {FTRUN_CORE_VARS - set(f_env)}"
        f_env = {k: v for k, v in f_env.items() if not k.startswith("FTRUN_") and k not in newer}
        assert set(f_env) == set(t_env), f"only torchrun: {set(t_env) - set(f_env)}; only ftrun: {set(f_env) - set(t_env)}"
        assert {k: v for k, v in f_env.items() if k not in per_launch} == \
               {k: v for k, v in t_env.items() if k not in per_launch}
        local_rank = name.rsplit("_", 1)[1]
        for env in (t_env, f_env):
            assert Path(env["TORCHELASTIC_ERROR_FILE"]).parts[-3:] == ("attempt_0", local_rank, "error.json")
        check_per_launch(t_env, f_env)


def test_worker_env_matches_torchrun_with_default_rendezvous(tmp_path, workload, launcher_env):
    def per_launch(t_env, f_env):
        # today's torchrun alone on one node rendezvouses on localhost, at a free port, with a fresh id; 2.6's
        # kept to the static default (127.0.0.1:29500, id "none"), and ftrun does as today's on every torch
        static = t_env["TORCHELASTIC_RUN_ID"] == "none"
        assert (t_env["MASTER_ADDR"], t_env["MASTER_PORT"]) == ("127.0.0.1", "29500") if static \
            else t_env["MASTER_ADDR"] == "localhost"
        assert f_env["MASTER_ADDR"] == "localhost"
        assert f_env["TORCHELASTIC_RUN_ID"] not in ("", "none")  # a fresh id per run, like torchrun's uuid
        assert int(f_env["MASTER_PORT"]) > 0

    _assert_env_parity(tmp_path, workload, launcher_env, [], [], per_launch, PER_LAUNCH | {"MASTER_ADDR"})


def test_worker_env_matches_torchrun_with_explicit_master_port(tmp_path, workload, launcher_env, free_port):
    t_port, f_port = free_port(), free_port()
    while f_port == t_port:
        f_port = free_port()

    def per_launch(t_env, f_env):
        assert t_env["MASTER_ADDR"] == f_env["MASTER_ADDR"] == "127.0.0.1"
        assert t_env["TORCHELASTIC_RUN_ID"] == f_env["TORCHELASTIC_RUN_ID"] == "none"
        assert (t_env["MASTER_PORT"], f_env["MASTER_PORT"]) == (str(t_port), str(f_port))

    _assert_env_parity(tmp_path, workload, launcher_env, ["--master-port", str(t_port)],
                       ["--master-port", str(f_port)], per_launch)


def test_gloo_env_init_and_all_reduce_work_under_ftrun_with_the_store_bound_to_one_address(run_ftrun, workload):
    """The store listens on 127.0.0.2 alone (--rdzv-conf bind): the workers' MASTER_ADDR is that address, where
    "localhost" would leave them connecting to 127.0.0.1 until their store timeout."""
    res = run_ftrun("--nproc-per-node", "2", "--rdzv-conf", "bind=127.0.0.2", workload("allreduce.py"))
    assert res.returncode == 0, res.stderr
    for rank in (0, 1):
        for step in (0, 1):
            assert f"[default{rank}]: attempt 0 step {step} sum 3 world 2" in res.stdout.splitlines()


# ------------------------------------------------------------------------------ 2. PET_* and spellings
def test_pet_nproc_per_node_env_var_sets_worker_count(tmp_path, run_ftrun, workload):
    res = run_ftrun(workload("dump_env.py"), tmp_path, env={"PET_NPROC_PER_NODE": "3"})
    assert res.returncode == 0, res.stderr
    envs = read_envs(tmp_path)
    assert set(envs) == {"env_0_0", "env_0_1", "env_0_2"}
    assert {e["WORLD_SIZE"] for e in envs.values()} == {"3"}
    assert sorted(e["RANK"] for e in envs.values()) == ["0", "1", "2"]


def test_underscore_nproc_per_node_spelling_sets_worker_count(tmp_path, run_ftrun, workload):
    # --nproc-per-node (hyphens) is what every other test here uses.
    res = run_ftrun("--nproc_per_node", "2", workload("dump_env.py"), tmp_path)
    assert res.returncode == 0, res.stderr
    envs = read_envs(tmp_path)
    assert set(envs) == {"env_0_0", "env_0_1"}
    assert {e["WORLD_SIZE"] for e in envs.values()} == {"2"}


# ------------------------------------------------------------------------------------ 3. console, logs
@pytest.fixture(scope="module")
def echo_run(tmp_path_factory, run_ftrun, workload):
    log_dir = tmp_path_factory.mktemp("logs")
    res = run_ftrun("--nproc-per-node", "2", "--log-dir", log_dir, workload("echo_lines.py"))
    assert res.returncode == 0, res.stderr
    return res, log_dir


def test_console_lines_are_prefixed_with_role_and_rank(echo_run):
    res, _ = echo_run
    out, err = res.stdout.splitlines(), res.stderr.splitlines()
    for rank in (0, 1):
        assert sum(line.startswith(f"[default{rank}]:") for line in out) == 1
        assert any(line.startswith(f"[default{rank}]:") and line.endswith(f"hello on stdout from rank {rank}")
                   for line in out)
        assert any(line.startswith(f"[default{rank}]:") and line.endswith(f"hello on stderr from rank {rank}")
                   for line in err)
    assert not any("hello on stderr" in line for line in out)


def test_log_dir_keeps_each_workers_stdout_and_stderr_in_torchrun_layout(echo_run):
    _, log_dir = echo_run
    runs = [p for p in log_dir.iterdir() if p.is_dir()]
    assert len(runs) == 1, runs
    for rank in (0, 1):
        worker_dir = runs[0] / "attempt_0" / str(rank)
        assert (worker_dir / "stdout.log").read_text() == f"hello on stdout from rank {rank}\n"
        assert (worker_dir / "stderr.log").read_text() == f"hello on stderr from rank {rank}\n"


def worker_lines(text: str, prefix: str) -> list[str]:
    """The lines of worker output (those starting with ``prefix``), sorted: ranks interleave freely."""
    return sorted(line for line in text.splitlines() if line.startswith(prefix))


@pytest.mark.parametrize("torchrun_flags, ftrun_flags, env, prefix", [
    # PET_REDIRECTS and PET_TEE (named after the long flags); tee wins over redirects; the template's variable
    ([], [], {"PET_REDIRECTS": "3", "PET_TEE": "1", "TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE": "<${local_rank}>"}, "<"),
    # an abbreviation argparse accepts, and a template printed as given (its own space, none added)
    (["--redirect=3", "--tee", "2", "--log-line-prefix-template", "[x${rank}] "],
     ["--redirect=3", "--tee", "2", "--log-line-prefix-template", "[x${rank}] "], {}, "[x"),
    # ftrun's empty template: the bare lines torchrun prints without --tee
    ([], ["--log-line-prefix-template", ""], {}, "hello"),
], ids=["pet-variables", "abbreviation-and-template", "empty-template"])
def test_console_output_matches_torchrun(tmp_path, workload, launcher_env, torchrun_flags, ftrun_flags, env, prefix):
    logs = {name: ["--log-dir", str(tmp_path / name)] for name in ("torchrun", "ftrun")}
    torchrun_env = {}
    flag = "--log-line-prefix-template"
    if flag in torchrun_flags and flag not in installed_torchrun_flags():  # 2.6's takes the variable alone
        at = torchrun_flags.index(flag)
        torchrun_env["TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE"] = torchrun_flags[at + 1]
        torchrun_flags = torchrun_flags[:at] + torchrun_flags[at + 2:]
    t_res, f_res = launch_both(["--nproc-per-node", "2", *logs["torchrun"], *torchrun_flags, workload("echo_lines.py")],
                               ["--nproc-per-node", "2", *logs["ftrun"], *ftrun_flags, workload("echo_lines.py")],
                               {**launcher_env, **env}, torchrun_env)
    assert t_res.returncode == 0 and f_res.returncode == 0, (t_res.stderr, f_res.stderr)
    for stream in ("stdout", "stderr"):
        expected = worker_lines(getattr(t_res, stream), prefix)
        assert worker_lines(getattr(f_res, stream), prefix) == expected, stream
    assert worker_lines(f_res.stdout + f_res.stderr, prefix), "no worker line at all: the comparison proves nothing"


def test_a_progress_bar_reaches_the_console_before_its_line_ends(tmp_path, launcher_env, workload):
    marker = tmp_path / "seen"
    proc = subprocess.Popen([*FTRUN, "--nproc-per-node", "1", workload("progress_bar.py"), str(marker)],
                            env=launcher_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        seen = b""
        while b"[default0]: progress 50%" not in seen:  # the worker waits for the marker before its newline
            chunk = proc.stderr.read1(4096)
            assert chunk, f"ftrun ended first: {seen!r}"
            seen += chunk
        marker.touch()
        out, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 0, err
    assert (seen + err).count(b"[default0]: progress 100%\n") == 1


def test_pet_variables_take_torchruns_names_from_the_long_flags(private_registry, monkeypatch, capsys):
    from ftrun.cli import main

    monkeypatch.setenv("PET_NO_PYTHON", "1")
    monkeypatch.setenv("PET_MODULE", "1")
    with pytest.raises(SystemExit) as exited:
        main(["some.module"])
    assert exited.value.code == 2
    assert capsys.readouterr().err == "ftrun: error: -m/--module and --no-python cannot be combined\n"


# ------------------------------------------------------------------------------------------ 4. failure
@pytest.fixture(scope="module")
def failed_runs(tmp_path_factory, run_ftrun, workload):
    """ftrun over fail_rank1.py, by mode (run once each): rank 1 raises, rank 0 waits to be stopped.

    Returns (result, {rank: pid}, log dir).
    """
    runs = {}

    def get(mode: str):
        if mode not in runs:
            markers = tmp_path_factory.mktemp(f"markers_{mode}")
            log_dir = tmp_path_factory.mktemp(f"logs_{mode}")
            res = run_ftrun("--nproc-per-node", "2", "--log-dir", log_dir, workload("fail_rank1.py"), markers, mode)
            pids = {rank: int((markers / f"started_{rank}").read_text()) for rank in (0, 1)}
            runs[mode] = res, pids, log_dir
        return runs[mode]

    return get


FAILURE_MODES = pytest.mark.parametrize("mode", ["raise", "record"], ids=["plain", "with_record"])


@FAILURE_MODES
def test_worker_exception_fails_launch_with_exit_code_1(failed_runs, mode):
    res, _, _ = failed_runs(mode)
    assert res.returncode == 1, res.stderr


@FAILURE_MODES
def test_failure_report_names_rank_local_rank_pid_exit_code_and_traceback(failed_runs, mode):
    res, pids, _ = failed_runs(mode)
    report = report_of(res.stderr)
    assert f"rank 1 (local rank 1, pid {pids[1]}) ended with exit code 1" in report
    assert "RuntimeError: boom from rank 1" in report
    assert 'raise RuntimeError("boom from rank 1")' in report
    assert "in explode" in report
    assert f"pid {pids[0]}" not in report  # the worker ftrun stopped is not blamed


@FAILURE_MODES
def test_failure_stops_the_other_worker(failed_runs, mode):
    _, pids, _ = failed_runs(mode)
    assert not psutil.pid_exists(pids[0]) or gone(psutil.Process(pids[0]))


def test_record_decorator_writes_error_json_into_log_dir(failed_runs):
    _, _, log_dir = failed_runs("record")
    (error_file,) = log_dir.glob("*/attempt_0/1/error.json")
    error = json.loads(error_file.read_text())
    assert "boom from rank 1" in json.dumps(error["message"])
    assert not list(log_dir.glob("*/attempt_0/0/error.json"))
    (stderr_log,) = log_dir.glob("*/attempt_0/1/stderr.log")
    assert "RuntimeError: boom from rank 1" in stderr_log.read_text()


def test_worker_killed_by_signal_is_reported_with_signal_name(tmp_path, run_ftrun, workload):
    res = run_ftrun("--nproc-per-node", "2", workload("fail_rank1.py"), tmp_path, "sigkill")
    assert res.returncode == 1, res.stderr
    pid = int((tmp_path / "started_1").read_text())
    report = report_of(res.stderr)
    assert f"rank 1 (local rank 1, pid {pid}) ended with signal SIGKILL" in report
    assert "Traceback" not in res.stderr


# ------------------------------------------------------------------------------------- 5. group restart
def test_max_restarts_restarts_group_and_second_attempt_sees_restart_count_1(tmp_path, run_ftrun, workload):
    res = run_ftrun("--nproc-per-node", "2", "--max-restarts", "1", workload("dump_env.py"), tmp_path,
                    "--fail-first-attempt")
    assert res.returncode == 0, res.stderr
    envs = read_envs(tmp_path)
    assert set(envs) == {"env_0_0", "env_0_1", "env_1_0", "env_1_1"}
    assert {envs[f"env_1_{r}"]["TORCHELASTIC_RESTART_COUNT"] for r in (0, 1)} == {"1"}
    assert {e["TORCHELASTIC_MAX_RESTARTS"] for e in envs.values()} == {"1"}


def test_group_restart_under_a_hostfile_launcher_that_hosts_the_store(run_ftrun, workload):
    """With -H the launcher, not node 0's agent, hosts the job's store: node 0's agent serves the restarted
    attempt's store, on its address toward the launcher's, and the second attempt forms its group there."""
    res = run_ftrun("-H", "localhost:2", "--max-restarts", "1", workload("allreduce.py"), "--crash-first-attempt",
                    timeout=120)
    assert res.returncode == 0, res.stderr
    assert "restarting the group (restart 1 of 1)" in res.stderr, res.stderr
    assert "[localhost:0]: attempt 1 store holds: left_by_attempt_0 False, ftrun/job False" in res.stdout, res.stdout
    # the worker's planted traceback is forwarded with its prefixes; ftrun itself prints none
    assert "[localhost:1]: [rank1]: RuntimeError: rank 1 crashes" in res.stderr, res.stderr
    assert not re.search(r"^Traceback", res.stderr, re.M), res.stderr


def test_gloo_group_forms_again_after_group_restart(run_ftrun, workload):
    # The dead group's addresses must not linger in the store for the new one to read (pytorch#135712): the
    # restarted attempt rendezvous in a new store, which holds no key of the last attempt's, nor of ftrun's,
    # whether or not the server can list its keys to delete them (torch 2.6's cannot).
    res = run_ftrun("--nproc-per-node", "2", "--max-restarts", "1", workload("allreduce.py"),
                    "--crash-first-attempt")
    assert res.returncode == 0, res.stderr
    out = res.stdout.splitlines()
    assert "[default0]: attempt 1 store holds: left_by_attempt_0 False, ftrun/job False" in out, res.stdout
    assert "[default1]: attempt 0 step 0 sum 3 world 2" in out
    for rank in (0, 1):
        for step in (0, 1):
            assert f"[default{rank}]: attempt 1 step {step} sum 3 world 2" in out
    assert "rank 1 crashes on attempt 0" in res.stderr


# -------------------------------------------------------------------------------------------- 6. signals
def _start_waiting_workers(tmp_path, launcher_env, workload, *extra):
    proc = subprocess.Popen([*FTRUN, "--nproc-per-node", "2", workload("wait_forever.py"), str(tmp_path), *extra],
                            env=launcher_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    markers = [tmp_path / f"started_{rank}" for rank in (0, 1)]
    wait_for_files(markers, proc)
    worker_pids = [int(pid) for m in markers for pid in m.read_text().split()]
    return proc, worker_pids


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_signal_to_ftrun_stops_all_workers_and_exits_128_plus_signum(tmp_path, launcher_env, workload, sig):
    proc, worker_pids = _start_waiting_workers(tmp_path, launcher_env, workload, "--child")
    try:
        descendants = psutil.Process(proc.pid).children(recursive=True)
        assert set(worker_pids) <= {p.pid for p in descendants}
        proc.send_signal(sig)
        out, err = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert proc.returncode == 128 + sig, err
    assert f"stopped by {sig.name}" in err
    assert f"ftrun: received {sig.name}, stopping the workers: no worker uses the worker API (ftrun.init()), so " \
           "ftrun has no state to save" in err  # a plain torchrun script: its own checkpoints are what there is
    assert still_running(descendants, timeout=5) == []


def test_workers_die_when_ftrun_is_killed_with_sigkill(tmp_path, launcher_env, workload):
    proc, worker_pids = _start_waiting_workers(tmp_path, launcher_env, workload)
    workers = [psutil.Process(pid) for pid in worker_pids]
    proc.kill()
    proc.communicate(timeout=30)
    assert proc.returncode == -signal.SIGKILL
    assert still_running(workers, timeout=10) == []


# ---------------------------------------------------------------------------------------- 7. bad input
def _assert_usage_error(res: subprocess.CompletedProcess, *words: str) -> None:
    assert res.returncode == 2, (res.stdout, res.stderr)
    lines = res.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("ftrun: error:"), res.stderr
    assert "Traceback" not in res.stderr + res.stdout
    for word in words:
        assert word in lines[0]


def test_missing_script_is_a_usage_error(tmp_path, run_ftrun):
    _assert_usage_error(run_ftrun(tmp_path / "no_such_script.py"), "no_such_script.py")


def test_zero_nproc_per_node_is_a_usage_error(run_ftrun, workload):
    _assert_usage_error(run_ftrun("--nproc-per-node", "0", workload("echo_lines.py")), "--nproc-per-node")


def test_nproc_per_node_gpu_without_gpu_is_a_usage_error(run_ftrun, workload):
    res = run_ftrun("--nproc-per-node", "gpu", workload("echo_lines.py"), env={"CUDA_VISIBLE_DEVICES": ""})
    _assert_usage_error(res, "gpu")


def test_busy_master_port_is_a_usage_error(run_ftrun, workload):
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as busy:
        busy.bind(("", 0))
        busy.listen(1)
        port = busy.getsockname()[1]
        _assert_usage_error(run_ftrun("--master-port", port, workload("echo_lines.py")), str(port))


def test_unknown_flag_is_a_usage_error(run_ftrun, workload):
    # Only before the script: flags after it belong to the script (--fail-first-attempt above gets through).
    _assert_usage_error(run_ftrun("--bogus", workload("echo_lines.py")), "--bogus")


def test_log_dir_that_cannot_be_created_is_a_usage_error(tmp_path, run_ftrun, workload):
    regular_file = tmp_path / "a_file"
    regular_file.write_text("")
    _assert_usage_error(run_ftrun("--log-dir", regular_file / "logs", workload("echo_lines.py")), "--log-dir")


def test_multi_node_nnodes_is_refused(run_ftrun, workload):
    _assert_usage_error(run_ftrun("--nnodes", "2", workload("echo_lines.py")), "--nnodes 2")
