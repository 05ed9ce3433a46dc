"""The environment each worker gets: torchrun's variables, then ftrun's own FTRUN_* ones."""

from __future__ import annotations

import os
from pathlib import Path

from ftrun.config import Endpoint, LaunchConfig


def launch_env(config: LaunchConfig) -> dict[str, str]:
    """What every worker of this launch has in its environment: this process's, with torchrun's defaults.

    The fork server runs with exactly this (its imports see what a worker's would); each worker's own
    variables (:func:`worker_env`) come on top.
    """
    env = dict(os.environ)
    if "OMP_NUM_THREADS" not in env and config.nproc_per_node > 1:
        env["OMP_NUM_THREADS"] = "1"
    env.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")
    return env


def worker_env(
    config: LaunchConfig,
    *,
    rank: int,
    local_rank: int,
    uid: int,
    restart_count: int,
    store: Endpoint,
    run_dir: str,
    joiner: bool = False,
    node_sizes: tuple[int, ...] | None = None,
    rescue_from: Path | None = None,
) -> dict[str, str]:
    """Build one worker's environment exactly as torchrun 2.14 does, plus FTRUN_* variables.

    ``uid`` is the worker's incarnation id, unique within a run; a spare gets the rank it would have if
    it joined now, and FTRUN_JOINER=1. ``node_sizes`` (training workers per node) defaults to the
    configuration's; an attempt started without evicted GPUs' workers passes its smaller sizes.
    ``rescue_from``: the directory of rescued state the workers start from (FTRUN_RESCUE_FROM). ``store``: where
    the workers' process groups rendezvous (MASTER_ADDR, MASTER_PORT).
    """
    env = launch_env(config)
    sizes = config.sizes if node_sizes is None else node_sizes
    # a node that joins late (--nnodes MIN:MAX) is not among the starting sizes: its workers are joiners
    world = sum(sizes)
    local_world = sizes[config.node_rank] if config.node_rank < len(sizes) else config.nproc_per_node
    env.update(
        LOCAL_RANK="0" if config.virtual_local_rank else str(local_rank),
        RANK=str(rank),
        GROUP_RANK=str(config.node_rank),
        ROLE_RANK=str(rank),
        ROLE_NAME=config.role,
        LOCAL_WORLD_SIZE=str(local_world),
        WORLD_SIZE=str(world),
        GROUP_WORLD_SIZE=str(config.min_nodes),
        ROLE_WORLD_SIZE=str(world),
        MASTER_ADDR=store.host,
        MASTER_PORT=str(store.port),
        TORCHELASTIC_RESTART_COUNT=str(restart_count),
        TORCHELASTIC_MAX_RESTARTS=str(config.max_restarts),
        TORCHELASTIC_RUN_ID=config.run_id,
        TORCHELASTIC_USE_AGENT_STORE="True",
        TORCHELASTIC_SIGNALS_TO_HANDLE=",".join(s.name for s in config.signals_to_handle),
        FTRUN_UID=str(uid),
        FTRUN_NODE_SIZES=",".join(map(str, sizes)),
        FTRUN_RUN_DIR=run_dir,
        FTRUN_JOINER="1" if joiner else "0",
        FTRUN_RECOVERY="1" if config.recovery.enabled else "0",
        FTRUN_RECOVERY_DEADLINE=str(config.recovery.recovery_timeout + config.recovery.join_timeout),
        FTRUN_DATA_RECONFIGURE=config.recovery.data_reconfigure,
    )
    env.pop("FTRUN_REFRESH_EVERY", None)
    if config.recovery.refresh_every is not None:
        env["FTRUN_REFRESH_EVERY"] = str(config.recovery.refresh_every)
    env.pop("FTRUN_RESCUE_FROM", None)
    if rescue_from is not None:
        env["FTRUN_RESCUE_FROM"] = str(rescue_from)
    if config.virtual_local_rank and "CUDA_VISIBLE_DEVICES" not in os.environ:
        env["CUDA_VISIBLE_DEVICES"] = str(local_rank)
    return env
