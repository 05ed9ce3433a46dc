"""ftrun.launcher.ssh against a real sshd (tests/sshd.py) and network-namespace hosts (tests/netns.py)."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys

import psutil
import pytest

from ftrun.errors import UsageError
from ftrun.launcher.hosts import is_local
from ftrun.launcher.ssh import (describe_ssh_failure, environment_preamble, forwarded_env, probe, ssh_argv,
                                ssh_options)
from netns import HOST_IFNAME

needs_ssh = pytest.mark.skipif(shutil.which("ssh") is None, reason="the ssh client is not installed")

# Prints its working directory, the variables it got and its arguments as JSON.
REPORT = "import json, os, sys; print(json.dumps([os.getcwd(), dict(os.environ), sys.argv[1:]]))"
# Prints the pids of its supervisor's other processes and its own, then sleeps or exits.
PIDS = ("import os, sys, time, psutil; sup = psutil.Process(os.getppid()); "
        "print(' '.join(str(p.pid) for p in [sup, *sup.children(recursive=True)]), flush=True); "
        "time.sleep(300 if sys.argv[1] == 'sleep' else 0)")


def start(host: str, argv: list[str], options: list[str], env: dict[str, str] | None = None,
          cwd: str = "/") -> subprocess.Popen:
    """Run argv on host over ssh the way the launcher does: stdin an open pipe starting with the environment
    preamble, output piped."""
    proc = subprocess.Popen(ssh_argv(host, argv, cwd, options=options, connect_timeout=5),
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    proc.stdin.write(environment_preamble(env or {}).decode())
    proc.stdin.flush()
    return proc


def finish(proc: subprocess.Popen) -> tuple[str, str, int]:
    """Read stdout to its end with stdin still open, then close stdin; (stdout, stderr, exit status)."""
    out = proc.stdout.read()
    proc.stdin.close()
    return out, proc.stderr.read(), proc.wait(timeout=30)


def test_runs_in_cwd_with_forwarded_env_and_args_unmangled(sshd, tmp_path):
    cwd = tmp_path / "a dir with 'quotes' and $dollar"
    cwd.mkdir()
    awkward = ["two words", "it's", '"double"', "$HOME", "`date`", "back\\slash", "*", "semi;colon", "new\nline", ""]
    environ = {"NCCL_DEBUG": "INFO", "PYTHONPATH": os.environ.get("PYTHONPATH", ""), "FTRUN_NOTE": "a 'b' $c \\d",
               "CUDA_VISIBLE_DEVICES": "0,1", "UNRELATED": "stays home", "TORCH_LINES": "one\ntwo '\n' \\n"}
    env = forwarded_env(environ)
    out, err, status = finish(start("127.0.0.1", [sys.executable, "-c", REPORT, *awkward], sshd.ssh_options, env,
                                    str(cwd)))
    assert status == 0, err
    remote_cwd, remote_env, remote_args = json.loads(out)
    assert remote_cwd == str(cwd)
    assert remote_args == awkward
    assert {name: remote_env.get(name) for name in env} == env
    assert "UNRELATED" not in remote_env


def test_forwarded_values_show_in_no_command_line(sshd):
    """A token forwarded to the remote command is in its environment, and in no process's command line on
    either side (the local ssh, the remote shell and supervisor, the command): other users can read those."""
    token = f"hf_{os.urandom(16).hex()}"
    proc = start("127.0.0.1", [sys.executable, "-c", PIDS, "sleep"], sshd.ssh_options, {"HF_TOKEN": token})
    remote = [psutil.Process(int(pid)) for pid in proc.stdout.readline().split()]
    command = next(process for process in remote if process.name().startswith("python"))
    assert command.environ().get("HF_TOKEN") == token
    for process in psutil.process_iter(["cmdline"]):
        assert token not in " ".join(process.info["cmdline"] or []), process
    proc.stdin.close()
    proc.wait(timeout=30)


def test_remote_exit_status_and_message(sshd, tmp_path):
    out, err, status = finish(start("127.0.0.1", ["sh", "-c", "echo disk full >&2; exit 3"], sshd.ssh_options))
    assert status == 3
    assert describe_ssh_failure("node7", status, err) == "command on host node7 exited with status 3: disk full"
    out, err, status = finish(start("127.0.0.1", ["true"], sshd.ssh_options, cwd=str(tmp_path / "missing")))
    assert status != 0 and "No such file or directory" in describe_ssh_failure("node7", status, err)


@pytest.mark.parametrize("how", ["kill ssh", "close stdin"])
def test_remote_command_stops_when_ssh_goes(sshd, how):
    """SIGKILL to the local ssh client, or the launcher closing ssh's stdin, stops the remote command and
    its supervisor: nothing is left on the remote host."""
    proc = start("127.0.0.1", [sys.executable, "-c", PIDS, "sleep"], sshd.ssh_options)
    remote = [psutil.Process(int(pid)) for pid in proc.stdout.readline().split()]
    assert len(remote) == 3  # supervisor, its stdin watcher, the command
    if how == "kill ssh":
        proc.kill()
    else:
        proc.stdin.close()
    _, alive = psutil.wait_procs(remote, timeout=20)
    assert alive == []
    proc.wait(timeout=20)




def test_closing_stdin_stops_the_remote_command_and_keeps_its_last_words(sshd):
    """The graceful stop: with the connection still up, what the command prints while stopping and its exit
    status reach the launcher."""
    graceful = ("import signal, sys, time; signal.signal(signal.SIGTERM, lambda *_: sys.exit('stopping on SIGTERM')); "
                "print('ready', flush=True); time.sleep(300)")
    proc = start("127.0.0.1", [sys.executable, "-c", graceful], sshd.ssh_options)
    assert proc.stdout.readline() == "ready\n"
    proc.stdin.close()
    assert proc.stderr.read() == "stopping on SIGTERM\n"
    assert proc.wait(timeout=30) == 1

def test_killed_ssh_stops_a_remote_launcher_and_its_workers(sshd, launcher_env, workload, tmp_path):
    """The single-node launcher stands in for the agent: when its ssh client is killed it gets SIGTERM and
    stops its workers, so neither it nor they outlive the connection."""
    env = forwarded_env(launcher_env, extra=["XDG_CACHE_HOME"])
    argv = [sys.executable, "-m", "ftrun", "--nproc-per-node", "2", workload("wait_forever.py"), str(tmp_path)]
    proc = start("127.0.0.1", argv, sshd.ssh_options, env, os.getcwd())
    for line in proc.stderr:
        if ", attempt 0:" in line:
            break
    else:
        raise AssertionError(f"the launcher ended before starting its workers (exit {proc.wait()})")
    workers = [psutil.Process(int(pid)) for pid in line.split("(pids ")[1].split(")")[0].split()]
    launcher = workers[0].parent()
    remote = [launcher.parent(), launcher, *workers]
    assert "ftrun-remote" in remote[0].cmdline()
    proc.kill()
    _, alive = psutil.wait_procs(remote, timeout=30)
    assert alive == []
    proc.wait(timeout=20)

def test_normal_exit_leaves_nothing_behind(sshd):
    out, err, status = finish(start("127.0.0.1", [sys.executable, "-c", PIDS, "exit"], sshd.ssh_options))
    assert status == 0, err
    remote = [psutil.Process(int(pid)) for pid in out.split() if psutil.pid_exists(int(pid))]
    _, alive = psutil.wait_procs(remote, timeout=20)
    assert alive == []


def test_probe_accepts_a_reachable_host(sshd):
    probe("127.0.0.1", options=sshd.ssh_options, connect_timeout=5)


@needs_ssh
@pytest.mark.parametrize("case", ["refused port", "unknown host"])
def test_unreachable_host_is_one_line_with_host_and_ssh_message(case, free_port, ssh_keys):
    host, port, message = {"refused port": ("127.0.0.1", free_port(), "Connection refused"),
                           "unknown host": ("no-such-host.invalid", None, "Could not resolve hostname")}[case]
    with pytest.raises(UsageError) as raised:
        probe(host, port=port, options=ssh_keys.client_options(), connect_timeout=5)
    text = str(raised.value)
    assert "\n" not in text and f"host {host}" in text and message in text
    assert text.startswith(f"cannot reach host {host} over ssh: ssh: ")


def test_rejected_key_is_reported_with_ssh_message(sshd, ssh_keys):
    options = [*ssh_keys.client_options(identity=ssh_keys.host_key), "-p", str(sshd.port)]
    with pytest.raises(UsageError, match=r"^cannot reach host 127\.0\.0\.1 over ssh: .*Permission denied \(publickey"):
        probe("127.0.0.1", options=options, connect_timeout=5)


@pytest.mark.fast
def test_describe_ssh_failure_cases():
    refused = "ssh: connect to host n1 port 22: No route to host"
    stderr = f"** WARNING: connection is not using a post-quantum key exchange\r\n{refused}\n\n"
    assert describe_ssh_failure("n1", 255, stderr) == f"cannot reach host n1 over ssh: {refused}"
    assert describe_ssh_failure("n1", 255, "") == "cannot reach host n1 over ssh: ssh printed no message"
    assert describe_ssh_failure("n1", -9, "") == "ssh to host n1 was killed by signal 9: ssh printed no message"


@pytest.mark.fast
@needs_ssh
def test_caller_options_and_port_override_the_defaults():
    """ssh keeps the first value it sees, so a port and FTRUN_SSH_OPTS given by the user win."""
    options = ssh_options({"FTRUN_SSH_OPTS": "-o ConnectTimeout=42 -o 'ServerAliveInterval 7'"})
    argv = ssh_argv("node1", ["true"], "/", port=2222, options=options)
    effective = subprocess.run([*argv[:argv.index("--")], "-G", "node1"], capture_output=True, text=True, check=True)
    settings = set(effective.stdout.splitlines())
    assert {"port 2222", "connecttimeout 42", "serveraliveinterval 7", "batchmode yes"} <= settings


@pytest.mark.fast
def test_ssh_options_refuses_bad_quoting():
    assert ssh_options({}) == []
    with pytest.raises(UsageError, match="^FTRUN_SSH_OPTS: No closing quotation"):
        ssh_options({"FTRUN_SSH_OPTS": "-i 'key"})


@pytest.mark.fast
def test_forwarded_env_selection():
    environ = {"NCCL_IB_HCA": "mlx5", "GLOO_SOCKET_IFNAME": "eth0", "PYTHONPATH": "/src", "FTRUN_X": "1",
               "CUDA_HOME": "/cuda", "TORCH_LOGS": "dynamo", "OMP_NUM_THREADS": "4", "OMP_PROC_BIND": "close",
               "HOME": "/root", "HF_HOME": "/hf", "WANDB_PROJECT": "p", "WANDB_KEY": "k", "MYPYTHON": "no"}
    defaults = {"NCCL_IB_HCA", "GLOO_SOCKET_IFNAME", "PYTHONPATH", "FTRUN_X", "CUDA_HOME", "TORCH_LOGS",
                "OMP_NUM_THREADS"}
    assert set(forwarded_env(environ)) == defaults
    assert set(forwarded_env(environ, extra=["HOME", "OMP_*"])) == defaults | {"HOME", "OMP_PROC_BIND"}
    listed = {**environ, "FTRUN_SSH_ENV": " HF_HOME, WANDB_*,"}
    assert set(forwarded_env(listed)) == defaults | {"FTRUN_SSH_ENV", "HF_HOME", "WANDB_PROJECT", "WANDB_KEY"}
    assert forwarded_env(listed)["WANDB_KEY"] == "k"
    with pytest.raises(UsageError, match=r"^FTRUN_SSH_ENV: 'A=B' is not a variable name or prefix"):
        forwarded_env({"FTRUN_SSH_ENV": "A=B"})
    with pytest.raises(UsageError, match=r"'\*X' is not a variable name"):
        forwarded_env({}, extra=["*X"])


@pytest.mark.fast
def test_is_local():
    some_address = next(a.address for addrs in psutil.net_if_addrs().values() for a in addrs
                        if a.family == socket.AF_INET)
    for host in ["localhost", "127.0.0.1", "127.0.0.2", "::1", "[::1]", socket.gethostname(),
                 socket.gethostname().upper(), socket.getfqdn(), some_address]:
        assert is_local(host), host
    for host in ["203.0.113.7", "no-such-host.invalid"]:
        assert not is_local(host), host


def test_namespace_host_over_ssh_with_its_link_cut_and_restored(netns_hosts, ssh_keys):
    network, host = netns_hosts, netns_hosts.hosts[0]
    options = ssh_keys.client_options()
    assert is_local(network.gateway) and not is_local(host.address)
    out, err, status = finish(start(host.address, ["ip", "-o", "-4", "addr", "show", HOST_IFNAME], options))
    assert status == 0 and f"inet {host.address}/" in out, err
    with socket.create_server((network.gateway, 0)) as server:
        address = server.getsockname()
        connect = [sys.executable, "-c", f"import socket; socket.create_connection({address!r}, timeout=1)"]
        assert host.run(connect, capture_output=True).returncode == 0
        network.cut(host)
        try:
            with pytest.raises(UsageError, match=fr"^cannot reach host {host.address} over ssh: ssh: connect to host"):
                probe(host.address, options=options, connect_timeout=1)
            assert host.run(connect, capture_output=True).returncode != 0
        finally:
            network.restore(host)
        probe(host.address, options=options, connect_timeout=5)
        assert host.run(connect, capture_output=True).returncode == 0


def test_gloo_across_namespace_hosts_started_over_ssh(netns_hosts, ssh_keys, workload, launcher_env):
    """Workers on two namespace hosts, started through ssh, form a Gloo group through a store in the root
    namespace: GLOO_SOCKET_IFNAME (forwarded as a GLOO_* variable) makes Gloo use the hosts' own addresses."""
    from torch.distributed import TCPStore

    network = netns_hosts
    store = TCPStore(network.gateway, 0, is_master=True, wait_for_workers=False)
    environ = {**launcher_env, "GLOO_SOCKET_IFNAME": HOST_IFNAME, "TORCHELASTIC_USE_AGENT_STORE": "True",
               "TORCHELASTIC_RESTART_COUNT": "0", "MASTER_ADDR": network.gateway, "MASTER_PORT": str(store.port),
               "WORLD_SIZE": "2"}
    env = forwarded_env(environ, extra=["TORCHELASTIC_*", "MASTER_*", "WORLD_SIZE"])
    procs = [start(host.address, [sys.executable, workload("allreduce.py")], ssh_keys.client_options(),
                   {**env, "RANK": str(rank)}) for rank, host in enumerate(network.hosts)]
    for proc in procs:
        out, err, status = finish(proc)
        assert status == 0, err
        assert "attempt 0 step 1 sum 3 world 2" in out
