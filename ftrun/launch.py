"""Start a launch: bind the store, run the agent, return ftrun's exit code."""

from __future__ import annotations

from ftrun.agent.agent import Agent
from ftrun.agent.output import Console2
from ftrun.config import LaunchConfig
from ftrun.store import StoreHost


def launch(config: LaunchConfig) -> int:
    """Run the job described by ``config`` on this node and return the exit code for the shell."""
    console = Console2()
    store_host = StoreHost(config.store)
    if config.nproc_per_node > 1 and "OMP_NUM_THREADS" not in __import__("os").environ:
        console.notice(
            "ftrun: setting OMP_NUM_THREADS=1 for each worker to avoid overloading the machine; "
            "set it yourself to tune performance", style="yellow")
    return Agent(config, store_host, console).run()
