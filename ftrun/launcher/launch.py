"""Start a launch: this node's agent, or (with --hostfile / -H) one agent per host."""

from __future__ import annotations

import dataclasses
import os

from ftrun import flag_values
from ftrun.agent.agent import Agent
from ftrun.config import Endpoint, LaunchConfig
from ftrun.console import Console
from ftrun.errors import UsageError
from ftrun.launcher import handoff
from ftrun.launcher.hosts import listen_address
from ftrun.store.host import StoreHost


def launch(config: LaunchConfig) -> int:
    """Run the job described by ``config`` and return the exit code for the shell."""
    console = Console()
    if config.hosts is not None:
        from ftrun.launcher.multihost import HostLauncher

        return HostLauncher(config, console).run()
    config, store_host = _hosted_here(config)
    if config.nproc_per_node > 1 and "OMP_NUM_THREADS" not in os.environ:
        console.notice(
            "ftrun: setting OMP_NUM_THREADS=1 for each worker to avoid overloading the machine; "
            "set it yourself to tune performance", style="yellow")
    return Agent(config, store_host, console).run()


def launch_handed_off() -> int:
    """Run one host's agent of a --hostfile launch, from the hand-off in its environment."""
    line = os.environ.pop(handoff.VARIABLE, None)
    if line is None:
        raise UsageError(f"no {handoff.VARIABLE} in the environment: this command is started by "
                         "`ftrun --hostfile`, not by hand")
    config = handoff.decode(line)
    # the launcher cannot know a host's GPUs: each host's agent checks its spares against its own
    flag_values.check_spares_fit(config.nproc_per_node, config.recovery.spares, config.node_name)
    config, store_host = _hosted_here(config)
    return Agent(config, store_host, Console()).run()


def _hosted_here(config: LaunchConfig) -> tuple[LaunchConfig, StoreHost | None]:
    """Listen for the store this process hosts, if it hosts one: the configuration with its port. A hostfile
    launch with etcd hands node 0 no listening address: it resolves the store's host itself, on its host."""
    if not config.host_store:
        return config, None
    listen = config.store_listen or listen_address(config.store.host, config.multinode)
    store_host = StoreHost(config.store, listen)
    return dataclasses.replace(config, store=Endpoint(config.store.host, store_host.port), store_listen=listen), \
        store_host
