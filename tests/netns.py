"""Network namespaces as separate "hosts" for multi-node tests (needs root and iproute2's ``ip``).

``Network.create(n)`` makes n namespaces, each with loopback up and an ``eth0`` whose other end is attached
to a bridge in the root namespace. The bridge has the subnet's first address (``10.77.X.1``, the launcher's
side, where a store listens) and the hosts the next ones (``10.77.X.2``, ``10.77.X.3``...). Hosts reach each
other and the root namespace over the bridge. ``cut(host)`` takes the host's cable out (its bridge port goes
down: packets to and from it are lost) and ``restore(host)`` puts it back.

Gloo inside a namespace needs ``GLOO_SOCKET_IFNAME=eth0``: otherwise it advertises the address the
machine's host name resolves to (often 127.0.0.1, shared by every namespace) and peers cannot connect.
"""

from __future__ import annotations

import ipaddress
import os
import socket
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass, field

import psutil

SUBNETS = ipaddress.ip_network("10.77.0.0/16")
"""The /24 subnets tried for a network, lowest first; one in use on this machine is skipped."""

HOST_IFNAME = "eth0"
"""Each host's interface name inside its namespace; set GLOO_SOCKET_IFNAME to it for Gloo."""


class NetnsError(RuntimeError):
    """An ``ip`` command failed; the message holds the command and ip's own error."""


def ip(*args: str, check: bool = True) -> None:
    """Run ``ip ARGS``; raise NetnsError with ip's message if it fails (unless ``check`` is false)."""
    done = subprocess.run(["ip", *args], capture_output=True, text=True, stdin=subprocess.DEVNULL)
    if check and done.returncode != 0:
        raise NetnsError(f"ip {' '.join(args)}: {done.stderr.strip() or f'exit status {done.returncode}'}")


def unsupported() -> str | None:
    """Why namespaces cannot be made here (the exact error), or None when they can."""
    name = f"ftrun-probe-{os.getpid()}"
    try:
        ip("netns", "add", name)
    except FileNotFoundError:
        return "the ip command (iproute2) is not installed"
    except NetnsError as error:
        return str(error)
    ip("netns", "delete", name)
    return None


def _free_subnet() -> ipaddress.IPv4Network:
    """The first /24 of SUBNETS with no address on this machine's interfaces, in this pytest-xdist worker's
    share of them (``gw0`` the first 128, ``gw1`` the next...), so that two workers never pick the same."""
    used = {ipaddress.ip_address(a.address) for addrs in psutil.net_if_addrs().values() for a in addrs
            if a.family == socket.AF_INET}
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw")
    share = int(worker) % 2 if worker.isdigit() else 0
    for subnet in list(SUBNETS.subnets(new_prefix=24))[share * 128:(share + 1) * 128]:
        if not any(address in subnet for address in used):
            return subnet
    raise NetnsError(f"no free /24 left in {SUBNETS}")


@dataclass(frozen=True)
class NetnsHost:
    """One namespace "host": its namespace, its address, and the root-namespace end of its cable."""

    netns: str
    address: str
    cable: str

    @property
    def prefix(self) -> list[str]:
        """Prepend to a command to run it on this host."""
        return ["ip", "netns", "exec", self.netns]

    def run(self, argv: Sequence[str], **kwargs) -> subprocess.CompletedProcess:
        """Run ``argv`` on this host (subprocess.run keyword arguments pass through)."""
        return subprocess.run([*self.prefix, *argv], **kwargs)


@dataclass
class Network:
    """A bridge in the root namespace (``gateway`` address) and the namespace hosts attached to it."""

    bridge: str
    gateway: str
    hosts: list[NetnsHost] = field(default_factory=list)

    @classmethod
    def create(cls, count: int) -> Network:
        """Make ``count`` connected hosts; on any failure, remove what was made and raise NetnsError."""
        tag = f"{os.getpid() % 0x10000:04x}"
        subnet = _free_subnet()
        addresses = subnet.hosts()
        network = cls(bridge=f"ftbr{tag}", gateway=str(next(addresses)))
        try:
            ip("link", "add", network.bridge, "type", "bridge")
            ip("addr", "add", f"{network.gateway}/{subnet.prefixlen}", "dev", network.bridge)
            ip("link", "set", network.bridge, "up")
            for index in range(count):
                network._add_host(f"ftrun-{tag}-h{index}", f"ftv{tag}h{index}", str(next(addresses)),
                                  subnet.prefixlen)
        except BaseException:
            network.delete()
            raise
        return network

    def _add_host(self, netns: str, cable: str, address: str, prefixlen: int) -> None:
        ip("netns", "add", netns)
        host = NetnsHost(netns, address, cable)
        self.hosts.append(host)
        ip("link", "add", cable, "type", "veth", "peer", "name", HOST_IFNAME, "netns", netns)
        ip("link", "set", cable, "master", self.bridge)
        ip("link", "set", cable, "up")
        ip("-n", netns, "addr", "add", f"{address}/{prefixlen}", "dev", HOST_IFNAME)
        ip("-n", netns, "link", "set", HOST_IFNAME, "up")
        ip("-n", netns, "link", "set", "lo", "up")

    def cut(self, host: NetnsHost) -> None:
        """Unplug ``host``: its packets are dropped silently, like a failed switch port."""
        ip("link", "set", host.cable, "down")

    def drop_between(self, first: NetnsHost, second: NetnsHost) -> None:
        """Drop every packet between two hosts, silently, both ways: each routes the other through a next hop
        that never answers. Their links to everyone else (the store on the bridge) keep working."""
        nowhere = str(ipaddress.ip_address(self.gateway) + 250)  # on the bridge's /24, and nobody's
        for here, there in ((first, second), (second, first)):
            ip("-n", here.netns, "route", "add", f"{there.address}/32", "via", nowhere)

    def restore(self, host: NetnsHost) -> None:
        """Plug ``host`` back in."""
        ip("link", "set", host.cable, "up")

    def delete(self) -> None:
        """Remove every namespace, cable and the bridge; parts already gone are skipped."""
        for host in self.hosts:
            ip("link", "delete", host.cable, check=False)
            ip("netns", "delete", host.netns, check=False)
        ip("link", "delete", self.bridge, check=False)
        self.hosts.clear()
