"""Slurm's environment: which node of the allocation this is, and where node 0 is.

Node lists come compressed (``gpu[01-04,07],login1``). ``scontrol show hostnames`` expands them where it is
installed and configured; elsewhere (or if it fails, or takes too long) :func:`expand_nodelist` does, following
Slurm's hostlist syntax.
"""

from __future__ import annotations

import math
import re
import shutil
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass
from itertools import product

from ftrun.errors import UsageError, quoted

SCONTROL_TIMEOUT = 5.0
"""Seconds ``scontrol show hostnames`` may take before the node list is expanded here instead."""

MAX_NODES = 100_000
"""Hosts a node list may expand to: more than any cluster has (``n[0-9999999999]`` would fill the memory)."""
MAX_DIGITS = 18
"""Digits a number in a node list's brackets may have."""

_RANGE = re.compile(r"([0-9]{1,%d})(?:-([0-9]{1,%d}))?" % (MAX_DIGITS, MAX_DIGITS))


@dataclass(frozen=True)
class SlurmNode:
    """This node's place in a Slurm job step: its node id, the node count and the first node's name."""

    node_rank: int
    nnodes: int
    head: str


def expand_nodelist(nodelist: str) -> list[str]:
    """Expand a Slurm host list, in Slurm's order; ValueError for one that is malformed.

    Hosts are separated by commas or spaces outside brackets. A bracket holds numbers and ranges
    (``[1-3,7]``), zero-padded to the width of each range's first number (``[08-10]``: 08 09 10); a
    host may have several bracket groups and text around them (``rack[1-2]-node[01-02]-ib``), which
    expand leftmost slowest: rack1-node01-ib, rack1-node02-ib, rack2-node01-ib, rack2-node02-ib.
    """
    hosts: list[str] = []
    for token in _split_top_level(nodelist):
        parts = re.split(r"\[([^\[\]]*)\]", token)  # text, bracket, text, bracket, ..., text
        texts, groups = parts[0::2], parts[1::2]
        if any("[" in t or "]" in t for t in texts):
            raise ValueError(f"unbalanced brackets in {quoted(token)}")
        choices = [_numbers(group, token) for group in groups]
        if len(hosts) + math.prod(len(numbers) for numbers in choices) > MAX_NODES:
            raise ValueError(f"it names more than {MAX_NODES:,} hosts")
        for numbers in product(*choices):
            hosts.append("".join(text + number for text, number in zip(texts, (*numbers, ""))))
    return hosts


def _split_top_level(nodelist: str) -> list[str]:
    """The host expressions of a list: split at commas and spaces that are not inside brackets."""
    tokens, current, depth = [], "", 0
    for char in nodelist:
        depth += {"[": 1, "]": -1}.get(char, 0)
        if depth < 0 or depth > 1:
            raise ValueError(f"unbalanced brackets in {quoted(nodelist)}")
        if depth == 0 and (char == "," or char.isspace()):
            tokens.append(current)
            current = ""
        else:
            current += char
    if depth:
        raise ValueError(f"unbalanced brackets in {quoted(nodelist)}")
    return [t for t in [*tokens, current] if t]


def _numbers(group: str, token: str) -> list[str]:
    """The numbers of one bracket group, as text: ``08-10,15`` -> 08 09 10 15 (at most MAX_NODES)."""
    numbers: list[str] = []
    for item in group.split(","):
        match = _RANGE.fullmatch(item.strip())
        if not match:
            raise ValueError(f"[{group[:60]}] in {quoted(token)} is not a list of numbers and ranges like [1-4,7]")
        first, last = match.group(1), match.group(2) or match.group(1)
        if int(last) < int(first):
            raise ValueError(f"range {quoted(item)} in {quoted(token)} runs backwards")
        if len(numbers) + int(last) - int(first) + 1 > MAX_NODES:
            raise ValueError(f"it names more than {MAX_NODES:,} hosts")
        numbers += [f"{n:0{len(first)}d}" for n in range(int(first), int(last) + 1)]
    return numbers



def scontrol_hostnames(nodelist: str, timeout: float = SCONTROL_TIMEOUT) -> list[str] | None:
    """``scontrol show hostnames NODELIST``, or None where scontrol is missing, fails or takes too long."""
    scontrol = shutil.which("scontrol")
    if scontrol is None:
        return None
    try:
        done = subprocess.run([scontrol, "show", "hostnames", nodelist], capture_output=True, text=True,
                              timeout=timeout, stdin=subprocess.DEVNULL)
    except (OSError, subprocess.TimeoutExpired):
        return None
    hosts = done.stdout.split()
    # scontrol reports a list it cannot parse on stdout, and may still exit 0
    if done.returncode != 0 or done.stderr.strip() or not hosts or "Invalid hostlist" in done.stdout:
        return None
    return hosts


def hostnames(nodelist: str) -> list[str]:
    """The hosts of a Slurm node list: scontrol's expansion where it works, else :func:`expand_nodelist`'s."""
    return scontrol_hostnames(nodelist) or expand_nodelist(nodelist)


def slurm_node(environ: Mapping[str, str]) -> SlurmNode | None:
    """This node in the Slurm job it runs in, or None outside Slurm; UsageError for a node list that
    cannot be expanded."""
    nodelist = environ.get("SLURM_JOB_NODELIST") or environ.get("SLURM_NODELIST")
    node_id = environ.get("SLURM_NODEID")
    if not nodelist or not node_id:
        return None
    if not (node_id.isascii() and node_id.isdigit() and len(node_id) <= MAX_DIGITS):
        raise UsageError(f"SLURM_NODEID={quoted(node_id)} is not a node number; "
                         "give --node-rank and --rdzv-endpoint HOST:PORT instead")
    try:
        hosts = hostnames(nodelist)
    except ValueError as exc:
        raise UsageError(f"SLURM_JOB_NODELIST={quoted(nodelist)} cannot be expanded: {exc}; "
                         "give --rdzv-endpoint HOST:PORT instead") from None
    if not hosts:
        return None
    return SlurmNode(node_rank=int(node_id), nnodes=len(hosts), head=hosts[0])
