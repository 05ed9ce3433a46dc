"""Hostfiles and ``-H`` host lists for multi-node launches, parsed and validated in one place, and which
host names are this machine.

Accepted hostfile lines (``#`` starts a comment, blank lines are skipped)::

    node1                    # one host per line: slots default to the local GPU count or 1
    node2 slots=4            # DeepSpeed / Open MPI
    node3 slots=4 max_slots=8
    node4 max-slots=8        # Open MPI: slots follow max slots
    node5:4                  # MPICH
    [fe80::1]:4              # IPv6 addresses go in brackets
"""

from __future__ import annotations

import functools
import ipaddress
import os
import re
import socket
from dataclasses import dataclass

import psutil

from ftrun.errors import UsageError, quoted
from ftrun.paths import Unreadable, read_small_file
from ftrun.protocol import MAX_HOST_NAME, is_host_name

_BRACKETED = re.compile(r"\[([^\]]*)\](?::(.*))?")
_SLOT_KEYS = {"slots": "slots", "max_slots": "max_slots", "max-slots": "max_slots"}
MAX_WORKERS_PER_NODE = 1024
"""Workers (with spares) one node may run: more is a typo, not a job."""
_COUNT_FIX = f"use a whole number from 1 to {MAX_WORKERS_PER_NODE}"


@dataclass(frozen=True)
class Host:
    """One host to launch on: ``slots`` workers, or None to default to the local GPU count or 1."""

    name: str
    slots: int | None = None


MAX_HOSTS = 4096
"""Hosts one ``--hostfile`` / ``-H`` launch may name: each is an ssh session (and its pipes) held by this
process for the whole job. Larger jobs start each node in scheduler mode (``--nnodes``, srun, a Kubernetes
JobSet), where nothing runs per node on one machine."""

HOSTFILE_LIMIT = 16 << 20
"""Bytes a hostfile may hold: hundreds of thousands of lines."""


class _Refused(Exception):
    """A bad entry; the caller adds where it was (``hosts:3``, ``-H entry 2``)."""



def _count(text: str, what: str) -> int:
    """Parse a slot count: digits only, at least 1."""
    if not (text.isascii() and text.isdigit() and len(text) <= 6 and 1 <= int(text) <= MAX_WORKERS_PER_NODE):
        raise _Refused(f"bad {what} {text[:20]!r}: {_COUNT_FIX}")
    return int(text)


def _host_token(token: str) -> Host:
    """Parse ``name``, ``name:N``, ``[v6]`` or ``[v6]:N``; an IPv6 name is stored bare and normalized."""
    bracketed = _BRACKETED.fullmatch(token)
    if bracketed:
        address, slots = bracketed.groups()
        try:
            name = str(ipaddress.IPv6Address(address))
        except ValueError:
            raise _Refused(f"{quoted(address)} is not an IPv6 address: write it like [fe80::1] or [fe80::1]:4") from None
    elif token.startswith("["):
        raise _Refused(f"{quoted(token)} is not a bracketed IPv6 address: write it like [fe80::1] or [fe80::1]:4")
    elif token.count(":") > 1:
        raise _Refused(f"IPv6 address {quoted(token)} must be in brackets: write [fe80::1] or [fe80::1]:4")
    else:
        name, colon, slots = token.partition(":")
        slots = slots if colon else None
        if not is_host_name(name):
            fix = f"use at most {MAX_HOST_NAME} letters, digits, '_', '.' and '-', not starting with '.' or '-'"
            raise _Refused(f"{quoted(name)} is not a host name: {fix}")
    return Host(name, None if slots is None else _count(slots, "slot count"))


def _parse_line(line: str) -> Host:
    """Parse one hostfile line (comment already removed): a host token, then optional key=value pairs."""
    first, *pairs = line.split()
    host = _host_token(first)
    found: dict[str, int] = {} if host.slots is None else {"slots": host.slots}
    for pair in pairs:
        key, equals, value = pair.partition("=")
        if not equals or key not in _SLOT_KEYS:
            raise _Refused(f"unexpected {quoted(pair)} after the host name: only slots=N and max_slots=N are understood")
        if _SLOT_KEYS[key] in found:
            raise _Refused(f"{_SLOT_KEYS[key]} given twice in {quoted(line)}: give it once")
        found[_SLOT_KEYS[key]] = _count(value, f"{key} value")
    slots, max_slots = found.get("slots"), found.get("max_slots")
    if slots is not None and max_slots is not None and slots > max_slots:
        raise _Refused(f"slots={slots} is more than max_slots={max_slots}: lower slots or raise max_slots")
    return Host(host.name, slots if slots is not None else max_slots)


def _add(hosts: list[Host], seen: dict[str, str], host: Host, where: str, here: str) -> None:
    """Append ``host`` unless it is already listed (names compare case-insensitively)."""
    key = host.name.lower()
    if len(hosts) == MAX_HOSTS:
        raise UsageError(f"{where}: more than {MAX_HOSTS} hosts, each an ssh session held from here: start a job "
                         "this large in scheduler mode (--nnodes and --rdzv-endpoint on each node, or srun)")
    if key in seen:
        raise UsageError(f"{where}: duplicate host {host.name!r} (already {seen[key]}): list each host once")
    seen[key] = here
    hosts.append(host)


def parse_hostfile(text: str, source: str = "hostfile") -> list[Host]:
    """Parse a hostfile's text into hosts in file order.

    Raises UsageError naming ``source`` and the line number for duplicate hosts, bad slot counts,
    unknown ``key=value`` pairs, bare IPv6 addresses, other garbage, or a file that lists no host.
    """
    hosts: list[Host] = []
    seen: dict[str, str] = {}
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        try:
            host = _parse_line(line)
        except _Refused as refused:
            raise UsageError(f"{source}:{number}: {refused}") from None
        _add(hosts, seen, host, f"{source}:{number}", f"on line {number}")
    if not hosts:
        raise UsageError(f"{source} lists no hosts: write one host per line, like 'node1 slots=4'")
    return hosts


def parse_host_list(spec: str) -> list[Host]:
    """Parse ``-H host1:4,host2:4`` (slots optional) into hosts in order, refusing what parse_hostfile refuses."""
    hosts: list[Host] = []
    seen: dict[str, str] = {}
    for position, entry in enumerate(spec.split(","), start=1):
        entry = entry.strip()
        try:
            if not entry:
                raise _Refused("empty entry: remove the extra comma, or list hosts like host1:4,host2:4")
            host = _host_token(entry)
        except _Refused as refused:
            raise UsageError(f"-H entry {position}: {refused}") from None
        _add(hosts, seen, host, f"-H entry {position}", f"entry {position}")
    return hosts


def read_hostfile(path: str | os.PathLike[str]) -> list[Host]:
    """Read and parse the hostfile at ``path``; a missing or unreadable file is a one-line UsageError."""
    try:
        text = read_small_file(path, HOSTFILE_LIMIT)[0].decode("utf-8")
    except (Unreadable, UnicodeDecodeError) as error:
        reason = "not UTF-8 text" if isinstance(error, UnicodeDecodeError) else str(error)
        raise UsageError(f"cannot read hostfile {os.fspath(path)}: {reason}: check the path and permissions") from None
    return parse_hostfile(text, source=os.fspath(path))


@functools.cache
def _host_names() -> frozenset[str]:
    """This machine's names, lower-cased; looked up once, as finding the FQDN may wait on DNS."""
    return frozenset({"localhost", socket.gethostname().lower(), socket.getfqdn().lower()})


def _local_names() -> set[str]:
    """This machine's host names and current interface addresses, lower-cased."""
    names = set(_host_names())
    for addresses in psutil.net_if_addrs().values():
        for address in addresses:
            if address.family in (socket.AF_INET, socket.AF_INET6):
                names.add(address.address.split("%", 1)[0].lower())
    return names


def _is_loopback(address: str) -> bool:
    """Whether ``address`` is an IP address on the loopback network (127.0.0.0/8, ::1)."""
    try:
        return ipaddress.ip_address(address.split("%", 1)[0]).is_loopback
    except ValueError:
        return False


def is_local(host: str) -> bool:
    """Whether ``host`` is this machine: ``localhost``, a loopback address, this machine's name or FQDN, one
    of its interface addresses, or a name that resolves to one of those."""
    host = host.strip("[]").lower()
    local = _local_names()
    if host in local or _is_loopback(host):
        return True
    try:
        resolved = {info[4][0] for info in socket.getaddrinfo(host, None)}
    except (OSError, UnicodeError):
        return False
    return any(_is_loopback(address) or address.lower() in local for address in resolved)


def choose_listen_address(host: str, resolved: list[str], local: set[str], multinode: bool) -> str:
    """The address the store listens on for clients that reach it as ``host`` (which resolves, here, to
    ``resolved``, in order; ``local``: this machine's interface addresses): the one they will connect to.

    Loopback for a job on this machine only; for several nodes, the address of this machine that ``host``
    names, so that the store answers on the network the hosts share and on no other. UsageError when there
    is none: a name that only resolves to loopback here (the ``127.0.1.1 hostname`` line of many
    ``/etc/hosts``) would be unreachable from the other hosts.
    """
    addresses = [a.split("%", 1)[0].lower() for a in resolved]
    mine = [a for a in addresses if a in local and not _is_loopback(a)]
    if mine:
        return mine[0]
    loopback = [a for a in addresses if _is_loopback(a)]
    if loopback and (not multinode or host.lower() == "localhost" or _is_loopback(host)):
        return next((a for a in loopback if ":" not in a), loopback[0])  # clients try every address in turn
    if loopback:
        raise UsageError(f"the store's host {host!r} resolves to {loopback[0]} (loopback) on this machine, which "
                         "the other hosts cannot reach: give this machine's address on their network with "
                         "--master-addr (or --rdzv-endpoint), or listen on every interface with --rdzv-conf "
                         "bind=0.0.0.0")
    found = ", ".join(addresses) or "no address"
    raise UsageError(f"the store's host {host!r} ({found}) is not this machine, which hosts the store: give this "
                     "machine's name or address with --master-addr (or --rdzv-endpoint)")


def listen_address(host: str, multinode: bool) -> str:
    """:func:`choose_listen_address` for ``host`` as this machine resolves it; UsageError if it cannot."""
    try:
        resolved = [info[4][0] for info in socket.getaddrinfo(host.strip("[]"), None, type=socket.SOCK_STREAM)]
    except (OSError, UnicodeError) as exc:
        why = exc.strerror if isinstance(exc, OSError) and exc.strerror else exc
        raise UsageError(f"cannot resolve the store's host {host!r}: {why}") from None
    return choose_listen_address(host.strip("[]"), resolved, _local_names(), multinode)


def address_toward(host: str, port: int) -> str:
    """This machine's address on the way to ``host`` (the interface the kernel routes to it through), as the
    peers that reach ``host`` too would reach this machine. No packet is sent."""
    family = socket.AF_INET6 if ":" in host.strip("[]") else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        probe.connect((host.strip("[]"), port))
        return probe.getsockname()[0]
