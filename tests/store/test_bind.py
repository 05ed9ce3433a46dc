"""The store listens where its clients connect, and nowhere else: loopback for a job on this machine."""

from __future__ import annotations

import os
import re
import socket
import sys
import subprocess
from pathlib import Path

import psutil
import pytest

from conftest import EXAMPLE, FTRUN
from ftrun.config import Endpoint
from ftrun.errors import UsageError
from ftrun.launcher.hosts import choose_listen_address
from ftrun.store.host import StoreHost
from ftrun.store.wire import StoreClient

LOCAL = {"127.0.0.1", "::1", "10.0.0.5", "fd00::5"}


@pytest.mark.fast
@pytest.mark.parametrize("host, resolved, multinode, expected", [
    ("localhost", ["127.0.0.1"], False, "127.0.0.1"),
    ("localhost", ["::1", "127.0.0.1"], False, "127.0.0.1"),  # clients try each address: IPv4 loopback is there
    ("localhost", ["::1"], False, "::1"),
    ("localhost", ["::1", "127.0.0.1"], True, "127.0.0.1"),  # every node on this machine
    ("127.0.0.1", ["127.0.0.1"], True, "127.0.0.1"),
    ("node0", ["127.0.1.1"], False, "127.0.1.1"),  # one node: its own name's loopback address is where it connects
    ("node0", ["10.0.0.5"], True, "10.0.0.5"),
    ("node0", ["fd00::5", "10.0.0.5"], True, "fd00::5"),
    ("node0", ["127.0.1.1", "10.0.0.5"], True, "10.0.0.5"),
    ("fe80::5", ["fe80::5%eth0"], True, None),
])
def test_the_store_listens_on_the_address_its_clients_use(host, resolved, multinode, expected):
    local = LOCAL | ({"fe80::5"} if expected is None else set())
    assert choose_listen_address(host, resolved, local, multinode) == (expected or "fe80::5")


@pytest.mark.fast
@pytest.mark.parametrize("host, resolved, message", [
    ("node0", ["127.0.1.1"], "resolves to 127.0.1.1 (loopback) on this machine, which the other hosts cannot reach"),
    ("node7", ["10.9.9.9"], "'node7' (10.9.9.9) is not this machine, which hosts the store"),
])
def test_several_nodes_never_get_a_store_they_cannot_reach(host, resolved, message):
    with pytest.raises(UsageError, match=re.escape(message)):
        choose_listen_address(host, resolved, LOCAL, multinode=True)


def test_a_single_node_job_listens_on_loopback_only(live_job, workload, tmp_path):
    proc, entry = live_job("--nproc-per-node", "2", workload("wait_forever.py"), tmp_path)
    listening = [c.laddr for c in psutil.Process(proc.pid).net_connections("inet")
                 if c.status == psutil.CONN_LISTEN and c.laddr.port == entry.port]
    assert [address.ip for address in listening] == ["127.0.0.1"]
    for addresses in psutil.net_if_addrs().values():
        for address in addresses:
            if address.family == socket.AF_INET and not address.address.startswith("127."):
                with pytest.raises(ConnectionRefusedError):  # this machine's other addresses: nobody there
                    socket.create_connection((address.address, entry.port), timeout=5).close()


def test_workers_reach_a_loopback_store_where_localhost_is_ipv6_first(launcher_env, tmp_path):
    """In a network namespace whose /etc/hosts lists ``::1 localhost`` first, the store listens on 127.0.0.1
    and the workers, given MASTER_ADDR=localhost as torchrun gives it, still reach it (each client tries every
    address the name resolves to)."""
    from netns import NetnsError, ip, unsupported

    reason = unsupported()
    if reason:
        pytest.skip(f"network namespaces unavailable: {reason}")
    name = f"ftrun-bind-{os.getpid()}"
    hosts = Path("/etc/netns") / name / "hosts"
    try:
        ip("netns", "add", name)
        ip("-n", name, "link", "set", "lo", "up")
        hosts.parent.mkdir(parents=True)
        hosts.write_text("::1 localhost\n127.0.0.1 localhost\n")  # `ip netns exec` mounts it over /etc/hosts
        first = "import socket; print(socket.getaddrinfo('localhost', 1, type=socket.SOCK_STREAM)[0][4][0])"
        resolved = subprocess.run(["ip", "netns", "exec", name, sys.executable, "-c", first], capture_output=True,
                                  text=True, timeout=30)
        assert resolved.stdout == "::1\n", resolved
        result = subprocess.run(["ip", "netns", "exec", name, *FTRUN, "--nproc-per-node", "2", EXAMPLE, "--steps",
                                 "3"], env={**launcher_env, "XDG_CACHE_HOME": str(tmp_path)}, capture_output=True,
                                text=True, timeout=180)
    except NetnsError as error:
        pytest.skip(f"namespace cannot be made here: {error}")
    finally:
        ip("netns", "delete", name, check=False)
        hosts.unlink(missing_ok=True)
        if hosts.parent.is_dir():
            hosts.parent.rmdir()
    assert result.returncode == 0, result.stderr
    assert "final step=2 " in result.stdout


def test_a_torch_whose_libuv_server_takes_no_listening_socket_serves_the_store_from_its_classic_one(monkeypatch,
                                                                                                       capfd):
    # torch's libuv server refuses a listening socket before pytorch#150215 (torch 2.6 logs why from C++, then
    # raises NotImplementedError); its classic server takes it, and serves the same protocol
    import torch.distributed

    classic, tried = torch.distributed.TCPStore, []
    refusal = "The libuv TCPStore backend does not support initialization with an listen fd."

    def without_libuv_listen_fd(*args: object, use_libuv: bool, **kwargs: object) -> object:
        tried.append(use_libuv)
        if use_libuv:
            os.write(2, f"[E TCPStore.cpp:259] [c10d] {refusal} Please switch to the legacy TCPStore\n".encode())
            os.write(2, b"another thread's line\n")
            raise NotImplementedError(refusal)
        return classic(*args, use_libuv=use_libuv, **kwargs)

    monkeypatch.setattr(torch.distributed, "TCPStore", without_libuv_listen_fd)
    host = StoreHost(Endpoint("127.0.0.1", 0), "127.0.0.1")
    store = host.start()
    with StoreClient(host.client_host, host.port) as client:
        client.set("key", "value")
        assert client.get("key") == b"value"
    assert store.get("key") == b"value" and tried == [True, False]
    assert capfd.readouterr().err == "another thread's line\n"  # not the advice to do what ftrun did
