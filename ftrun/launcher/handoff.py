"""The hand-off: what a ``--hostfile`` launcher tells each host's agent, as one versioned JSON line.

The launcher parses and validates the flags once, into one :class:`LaunchConfig`; each agent receives that
configuration with its own part filled in (node rank, workers per node, the store's address, the run's
directory name, its host name) and runs on it as it is: no flag is parsed again on another host. The line
travels in the ``FTRUN_HANDOFF`` variable, set in a local agent's environment or, for a remote one, by the
ssh supervisor from ssh's standard input with the forwarded variables (so nothing of it shows in any
process's command line); the agent removes it from its environment before starting workers. It carries the
run's secret (``LaunchConfig.secret``), which the workers never see.

A hand-off of another version is refused with one line: every host must run the same ftrun.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import signal
from pathlib import Path
from typing import Any

from ftrun.config import Endpoint, LaunchConfig, RecoveryConfig
from ftrun.errors import UsageError
from ftrun.health.signals import Action
from ftrun.store.etcd_config import EtcdOptions

VERSION = 1
"""Bumped whenever a field changes meaning; an agent refuses any other version."""
VARIABLE = "FTRUN_HANDOFF"
"""The environment variable that carries the hand-off line to an agent."""
MAX_LENGTH = 100_000
"""Characters a hand-off line may have: one environment variable's value is limited (128 KiB on Linux)."""

_LAUNCHER_ONLY = ("hosts",)
"""Fields that describe the launch from the launcher's side and mean nothing to an agent."""


def agent_config(config: LaunchConfig, *, node_rank: int, node_name: str, store: Endpoint,
                 run_name: str) -> LaunchConfig:
    """The configuration of node ``node_rank``'s agent in the ``--hostfile`` launch ``config``: ``store`` is
    the one the launcher serves, or with etcd node 0's process-group store (node 0 serves it; the others,
    given port 0, read where in etcd)."""
    sizes = config.sizes
    serves = config.etcd is not None and node_rank == 0
    if config.etcd is not None and node_rank != 0:
        store = Endpoint(store.host, 0)
    return dataclasses.replace(
        config, node_rank=node_rank, nproc_per_node=sizes[node_rank], node_sizes=sizes, min_nodes=len(sizes),
        max_nodes=len(sizes), store=store, master_addr=store.host, node_name=node_name, run_name=run_name,
        host_store=serves, store_listen=config.store_listen if serves else "", under_launcher=True, hosts=None)


def encode(config: LaunchConfig) -> str:
    """``config`` as one JSON line."""
    fields = {f.name: _plain(getattr(config, f.name)) for f in dataclasses.fields(config)
              if f.name not in _LAUNCHER_ONLY}
    line = json.dumps({"ftrun_handoff": VERSION, "config": fields}, separators=(",", ":"))
    if len(line) > MAX_LENGTH:
        raise UsageError(f"the hand-off to each host would be {len(line)} characters (at most {MAX_LENGTH}): "
                         "shorten the script's arguments")
    return line


def decode(line: str) -> LaunchConfig:
    """The agent's configuration from :func:`encode`'s line; UsageError (one line) for anything else."""
    try:
        data = json.loads(line)
        version = data.get("ftrun_handoff")
        if version != VERSION:
            raise UsageError(f"this ftrun reads hand-off version {VERSION}, the launcher sent {version!r}: "
                             "install the same ftrun on every host")
        fields = dict(data["config"])
        fields["store"] = Endpoint(**fields["store"])
        fields["recovery"] = RecoveryConfig(**fields["recovery"])
        if fields["etcd"] is not None:
            etcd = dict(fields["etcd"])
            fields["etcd"] = EtcdOptions(**{**etcd, "endpoints": tuple((str(h), int(p)) for h, p in etcd["endpoints"])})
        for name in ("log_dir", "resume_from"):
            fields[name] = None if fields[name] is None else Path(fields[name])
        for name in ("redirects", "tee"):
            fields[name] = {int(rank): int(mask) for rank, mask in fields[name].items()}
        if fields["local_ranks_filter"] is not None:
            fields["local_ranks_filter"] = set(fields["local_ranks_filter"])
        fields["signals_to_handle"] = [signal.Signals[name] for name in fields["signals_to_handle"]]
        fields["node_sizes"] = tuple(fields["node_sizes"])
        fields["xid_table"] = {int(code): (Action(action), text) for code, (action, text) in fields["xid_table"].items()}
        return LaunchConfig(**fields)
    except UsageError:
        raise
    except (ValueError, TypeError, KeyError, AttributeError) as exc:
        raise UsageError(f"the launcher's hand-off could not be read ({type(exc).__name__}: {exc}): "
                         "install the same ftrun on every host") from None


def _plain(value: Any) -> Any:
    """A configuration value as JSON data."""
    if dataclasses.is_dataclass(value):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, signal.Signals):
        return value.name
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, (set, frozenset)):
        return sorted(value)
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    return value
