"""A launch's run directory on this node: made, given the run's secret, entered in the run registry.

Each step that cannot be done (a full disk, a registry that cannot be written) is said in one line: only a
run directory that cannot be made stops the launch.
"""

from __future__ import annotations

import uuid
from pathlib import Path

from ftrun import registry
from ftrun.config import LaunchConfig
from ftrun.console import Console
from ftrun.errors import UsageError
from ftrun.store.auth import write_secret_file


def make_run_dir(config: LaunchConfig) -> tuple[Path, str]:
    """This node's run directory (node 0's is the run's; another node's is ``node<N>`` in it) and the run's
    name, the same on every node: the run id `ftrun status` shows."""
    root = config.log_dir or registry.default_runs_root()
    try:
        run = registry.private_dir(root / (config.run_name or f"{config.run_id}_{uuid.uuid4().hex[:8]}"))
        return (run if config.node_rank == 0 else registry.private_dir(run / f"node{config.node_rank}")), run.name
    except OSError as exc:
        raise UsageError(f"cannot create the run directory under {root} ({exc.strerror}): "
                         "free some space there, or pick another --log-dir") from None


def write_run_secret(run_dir: Path, secret: str, console: Console) -> None:
    """Write the run's secret to ``run_dir/secret``, for `ftrun status --secret-file`; a full disk is said, and
    the job goes on (this machine's registry still holds the secret)."""
    try:
        write_secret_file(run_dir / "secret", secret)
    except OSError as exc:
        (run_dir / "secret").unlink(missing_ok=True)
        console.notice(f"ftrun: cannot write {run_dir / 'secret'} ({exc.strerror or exc}): "
                       "`ftrun status` and `ftrun inject` from another machine cannot be given the "
                       "run's secret (--secret-file)", style="yellow")


def register_launch(config: LaunchConfig, run_dir: Path, console: Console) -> Path | None:
    """Enter this launch in the run registry (its entry's path); a registry that cannot be written is said once."""
    entry = registry.new_entry(run_dir.name, config.run_id, config.master_addr, config.store.port, run_dir,
                               config.secret, config.etcd.url() if config.etcd else None)
    try:
        return registry.register(entry)
    except OSError as exc:
        console.notice(f"ftrun: cannot enter this run in the run registry ({exc.strerror or exc}): "
                       f"`ftrun status` and `ftrun inject` need --endpoint {entry.endpoint}", style="yellow")
        return None
