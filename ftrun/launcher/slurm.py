"""Slurm's environment: which node of the allocation this is, and where node 0 is."""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

_GROUP = re.compile(r"([^,\[]+)(?:\[([^\]]+)\])?")


@dataclass(frozen=True)
class SlurmNode:
    """This node's place in a Slurm job step: its node id, the node count and the first node's name."""

    node_rank: int
    nnodes: int
    head: str


def expand_nodelist(nodelist: str) -> list[str]:
    """Expand Slurm's compressed host list: ``gpu[01-03,07],login1`` -> gpu01 gpu02 gpu03 gpu07 login1."""
    hosts = []
    for match in _GROUP.finditer(nodelist):
        prefix, ranges = match.groups()
        prefix = prefix.lstrip(",")
        if not ranges:
            hosts.append(prefix)
            continue
        for part in ranges.split(","):
            first, _, last = part.partition("-")
            width = len(first)
            for number in range(int(first), int(last or first) + 1):
                hosts.append(f"{prefix}{number:0{width}d}")
    return hosts


def slurm_node(environ: Mapping[str, str]) -> SlurmNode | None:
    """This node in the Slurm job it runs in, or None outside Slurm (or with an unreadable environment)."""
    nodelist = environ.get("SLURM_JOB_NODELIST") or environ.get("SLURM_NODELIST")
    node_id = environ.get("SLURM_NODEID")
    if not nodelist or node_id is None or not node_id.isdigit():
        return None
    hosts = expand_nodelist(nodelist)
    if not hosts:
        return None
    return SlurmNode(node_rank=int(node_id), nnodes=len(hosts), head=hosts[0])
