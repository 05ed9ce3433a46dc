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
