"""Start a launch: this node's agent, or (with --hostfile / -H) one agent per host."""

from __future__ import annotations

import os

from ftrun.agent.agent import Agent
from ftrun.agent.output import Console2
from ftrun.config import LaunchConfig
from ftrun.store import StoreHost


def launch(config: LaunchConfig) -> int:
    """Run the job described by ``config`` and return the exit code for the shell."""
    console = Console2()
    if config.hosts is not None:
        from ftrun.hostlaunch import HostLauncher

        return HostLauncher(config, console).run()
    store_host = StoreHost(config.store) if config.host_store else None
    if config.nproc_per_node > 1 and "OMP_NUM_THREADS" not in os.environ and not config.under_launcher:
        console.notice(
            "ftrun: setting OMP_NUM_THREADS=1 for each worker to avoid overloading the machine; "
            "set it yourself to tune performance", style="yellow")
    return Agent(config, store_host, console).run()
