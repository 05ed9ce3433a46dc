"""Where a resumed launch finds another node's saved state: that node's run directory, under node 0's.

With ``--hostfile`` every node's run directory is ``<log dir>/<run>/node<N>`` under the one run name the
launcher gave them, so ``--resume-from <node 0's run dir>`` leads each node to its own ``node<N>/rescue``. In
scheduler mode each node names its run directory itself; a node that saved state links it under node 0's
(``<node 0's run dir>/node<N>``, on its own host: created there if need be) as its agent ends.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from ftrun import registry
from ftrun.console import Console
from ftrun.flag_values import holds_saved_state
from ftrun.store.auth import MalformedValue
from ftrun.store.job import JobStore


def link_saved_state(store: JobStore, node_rank: int, run_dir: Path, console: Console) -> None:
    """Link ``run_dir`` under node 0's where it holds saved state and is not there already (scheduler mode, where
    each node names its own), so that `--resume-from <node 0's run dir>` finds this node's state; where it cannot,
    one line says so."""
    if not holds_saved_state(run_dir / "rescue"):
        return
    try:
        link = link_path(store.read_job(0), node_rank, run_dir)
    except (RuntimeError, MalformedValue):  # node 0's store is gone, or says nothing readable
        return
    why = link_under_leader(link, run_dir) if link is not None else None
    if why is not None:
        console.notice(f"ftrun: node {node_rank}: cannot link {link} to {run_dir} ({why}): "
                       "copy it there, or `--resume-from` on this node reads node 0's state", style="yellow")


def link_path(job: Any, node_rank: int, run_dir: Path) -> Path | None:
    """Where node ``node_rank``'s run directory ``run_dir`` is linked under node 0's, as the job's description
    (``job``, node 0's, from the store) names it; None where it is there already (``--hostfile``) or the
    description names no absolute directory."""
    where = job.get("run_dir") if isinstance(job, dict) else None
    if not isinstance(where, str) or not os.path.isabs(where) or "\0" in where:
        return None
    link = Path(where) / f"node{node_rank}"
    return None if link == run_dir else link


def link_under_leader(link: Path, run_dir: Path) -> str | None:
    """Make ``link`` a symbolic link to ``run_dir`` (its parent created, private, where this host has none);
    why not, in a few words, where it cannot be (something else is there, or the directory is not writable)."""
    if link.is_symlink() and link.resolve() == run_dir.resolve():
        return None
    try:
        registry.private_dir(link.parent)
        link.symlink_to(run_dir, target_is_directory=True)
    except OSError as exc:
        return exc.strerror or str(exc)
    return None
