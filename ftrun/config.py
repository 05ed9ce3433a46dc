"""One launch configuration: every flag and PET_* variable lands here, parsed and validated once."""

from __future__ import annotations

import ipaddress
import os
import signal
import socket
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from ftrun import flag_values
from ftrun.errors import UsageError
from ftrun.health.policy import DEFAULT_TABLE, load_table
from ftrun.health.signals import Action
from ftrun.launcher.hosts import MAX_WORKERS_PER_NODE, Host, is_local, listen_address
from ftrun.launcher.slurm import slurm_node
from ftrun.store import etcd_config
from ftrun.store.auth import new_secret
from ftrun.store.etcd_config import EtcdOptions
from ftrun.store.leases import fence_margin


@dataclass(frozen=True)
class Endpoint:
    """Where the rendezvous store listens."""

    host: str
    port: int  # 0: pick a free port


DATA_RECONFIGURE = ("fresh", "native")
"""--data-reconfigure's values: a new data group each generation, or torch's in-place reconfigure of one."""


@dataclass
class RecoveryConfig:
    """ftrun's own knobs for in-process recovery."""

    enabled: bool = True
    respawn: bool = False
    spares: int = 0
    min_nproc: int = 1
    recovery_timeout: float = 30.0
    join_timeout: float = 60.0
    hang_timeout: float | None = None  # None: adaptive (see ftrun.health.hangs)
    xid_policy: str | None = None  # --xid-policy: a TOML or JSON file of Xid overrides
    refresh_every: int | None = None  # --refresh-every: sharded state's copies, every K steps (None: the script's)
    data_reconfigure: str = "fresh"  # --data-reconfigure: fresh (a new data group each generation) or native


@dataclass
class LaunchConfig:
    """Everything a launch needs, validated: built by :func:`build_config` from flags and PET_* vars."""

    command: list[str]
    script: str
    nproc_per_node: int
    script_args: list[str] = field(default_factory=list)
    min_nodes: int = 1
    max_nodes: int = 1
    node_rank: int = 0
    store: Endpoint = Endpoint("localhost", 0)
    master_addr: str = "localhost"
    run_id: str = "none"
    rdzv_backend: str = "static"
    max_restarts: int = 0
    monitor_interval: float = 0.1
    role: str = "default"
    log_dir: Path | None = None
    redirects: dict[int, int] = field(default_factory=dict)  # streams kept off the console: --redirects, less --tee
    tee: dict[int, int] = field(default_factory=dict)
    local_ranks_filter: set[int] | None = None
    log_line_prefix_template: str = "[${role_name}${rank}]: "  # printed as is before each line ('': none)
    local_addr: str | None = None
    signals_to_handle: list[signal.Signals] = field(default_factory=list)
    shutdown_timeout: float = 30.0
    virtual_local_rank: bool = False
    recovery: RecoveryConfig = field(default_factory=RecoveryConfig)
    node_sizes: tuple[int, ...] = ()  # workers per node, by node rank; () means nproc_per_node on every node
    node_name: str = field(default_factory=socket.gethostname)  # this node's name in output prefixes
    host_store: bool = True  # this process serves the store (False: the hostfile launcher or node 0 does)
    store_listen: str = "127.0.0.1"  # the address the store listens on, where this process hosts it
    secret: str = field(default_factory=new_secret, repr=False)  # the run's: signs every value in the store
    node_timeout: float = 10.0  # a node whose lease is older than this is lost; an agent that cannot renew fences
    node_start_timeout: float = 60.0  # --rdzv-conf join_timeout: seconds a node has to first renew its lease
    metrics_port: int | None = None  # --metrics-port: every agent serves Prometheus metrics on it
    fork_server: bool = True  # later workers are forked from a process that has imported torch (--no-fork-server)
    run_name: str | None = None  # the run directory's name, shared by every node of a multi-node job
    hosts: list[Host] | None = None  # --hostfile / -H: launch one agent per host from here
    under_launcher: bool = False  # this agent was started by a --hostfile launcher, which registers the run
    xid_table: dict[int, tuple[Action, str]] = field(default_factory=lambda: dict(DEFAULT_TABLE))
    """Xid code -> (action, description): ftrun.health.policy.DEFAULT_TABLE with --xid-policy's overrides."""
    resume_from: Path | None = None
    """--resume-from: the run directory of an earlier launch whose saved state this one starts from."""
    etcd: EtcdOptions | None = None
    """--rdzv-backend etcd: ftrun's own keys live in this etcd cluster (the process groups' rendezvous goes through
    the TCPStore node 0 hosts, whose address node 0 publishes there)."""

    @property
    def sizes(self) -> tuple[int, ...]:
        """Workers per node, by node rank."""
        return self.node_sizes or (self.nproc_per_node,) * self.min_nodes

    @property
    def world_size(self) -> int:
        """Number of training workers (spares excluded)."""
        return sum(self.sizes)

    @property
    def rank_offset(self) -> int:
        """Global rank of this node's local rank 0."""
        return sum(self.sizes[: self.node_rank])

    @property
    def multinode(self) -> bool:
        """Whether the job spans more than one node (or may, with --nnodes MIN:MAX)."""
        return self.max_nodes > 1

    @property
    def joins_late(self) -> bool:
        """Whether this node is one of --nnodes MIN:MAX's optional ones (rank MIN or more): it joins the
        running job, its workers placed at the next generation."""
        return self.node_rank >= self.min_nodes


def _store_endpoint(
    rdzv_backend: str, rdzv_endpoint: str, master_addr: str, master_port: int | None, standalone: bool
) -> tuple[Endpoint, str]:
    """Where ftrun hosts the store, and MASTER_ADDR as torchrun would set it."""
    if standalone or (rdzv_backend == "static" and not rdzv_endpoint and master_port is None):
        return Endpoint("localhost", 0), "localhost"
    if rdzv_backend == "static" and not rdzv_endpoint:
        return Endpoint(master_addr, int(master_port or 0)), master_addr
    host, sep, port = rdzv_endpoint.rpartition(":")
    if not sep:
        host, port = rdzv_endpoint, "29400"
    if not (port.isascii() and port.isdigit() and len(port) <= 5 and 0 < int(port) < 65536):
        raise UsageError(f"--rdzv-endpoint {rdzv_endpoint[:60]!r} is not HOST:PORT with a port from 1 to 65535")
    return Endpoint(host or "localhost", int(port)), host or "localhost"


def build_config(
    *,
    script: str,
    script_args: list[str],
    nproc_per_node: str | None,
    nnodes: str,
    master_addr: str | None,
    master_port: int | None,
    rdzv_backend: str,
    rdzv_endpoint: str,
    rdzv_id: str,
    rdzv_conf: str,
    standalone: bool,
    max_restarts: int,
    monitor_interval: float,
    start_method: str,
    role: str,
    module: bool,
    no_python: bool,
    run_path: bool,
    log_dir: str | None,
    redirects: str,
    tee: str,
    local_ranks_filter: str,
    local_addr: str | None,
    signals_to_handle: str,
    shutdown_timeout: float | None,
    log_line_prefix_template: str | None,
    virtual_local_rank: bool,
    unsupported: dict[str, object],
    recovery: RecoveryConfig,
    node_rank: int | None = None,
    hostfile: str | None = None,
    host_list: str | None = None,
    node_timeout: float = 10.0,
    metrics_port: int | None = None,
    resume_from: str | None = None,
    fork_server: bool = True,
) -> LaunchConfig:
    """Validate the flags and build the one :class:`LaunchConfig` the launch runs on."""
    for flag, value in unsupported.items():
        if value:
            raise UsageError(f"{flag} is not supported by ftrun; remove it (ftrun has no equivalent yet)")
    min_nodes, max_nodes = flag_values.parse_nnodes(nnodes)
    hosts = flag_values.launch_hosts(hostfile, host_list, nnodes=max_nodes, node_rank=node_rank)
    if hosts is not None:
        min_nodes = max_nodes = len(hosts)
    slurm = slurm_node(os.environ) if max_nodes > 1 and hosts is None else None
    if node_rank is None:
        node_rank = slurm.node_rank if slurm else 0
    if not 0 <= node_rank < max_nodes:
        raise UsageError(f"--node-rank {node_rank}: must be between 0 and --nnodes - 1 ({max_nodes - 1})")
    if max_nodes > 1 and hosts is None and not rdzv_endpoint and master_port is None:
        if slurm is None:
            raise UsageError(f"--nnodes {max_nodes}: every node needs the store's address: add "
                             "--rdzv-endpoint HOST:PORT (HOST runs node rank 0), or use --hostfile")
        rdzv_endpoint, rdzv_backend = f"{slurm.head}:29400", "c10d"
    if start_method not in ("spawn", "fork", "forkserver"):
        raise UsageError(f"--start-method {start_method!r} is not valid: use spawn, fork or forkserver")
    if rdzv_backend not in ("static", "c10d", *etcd_config.BACKENDS):
        raise UsageError(f"--rdzv-backend {rdzv_backend!r} is not supported: use c10d or static (ftrun hosts the "
                         "store), or etcd / etcd-v2 (an etcd cluster holds it)")
    if max_restarts < 0:
        raise UsageError("--max-restarts must be 0 or more")
    flag_values.seconds("--monitor-interval", monitor_interval)
    shutdown_timeout = flag_values.shutdown_timeout(shutdown_timeout)
    conf = flag_values.parse_rdzv_conf(rdzv_conf)
    bind, node_start_timeout = conf.get("bind"), flag_values.join_timeout(conf, LaunchConfig.node_start_timeout)
    if master_port is not None and not 0 <= master_port <= 65535:
        raise UsageError(f"--master-port {master_port}: a port is between 1 and 65535 (0: pick a free one)")
    nproc = flag_values.resolve_nproc(nproc_per_node)
    if standalone and max_nodes > 1:
        raise UsageError("--standalone is for one node: remove it, or --nnodes/--hostfile")
    etcd = None
    if rdzv_backend in etcd_config.BACKENDS:
        etcd = flag_values.etcd_backend(rdzv_endpoint, rdzv_id, rdzv_conf, multinode=max_nodes > 1 and hosts is None)
        # the process groups' store is node 0's (as with static): on a free port unless --master-port says
        rdzv_backend, rdzv_endpoint = "static", ""
        if max_nodes > 1 and hosts is None:
            master_addr, master_port = master_addr or socket.getfqdn(), master_port or 0
    store, addr = _store_endpoint(rdzv_backend, rdzv_endpoint, master_addr or "127.0.0.1", master_port, standalone)
    node_sizes: tuple[int, ...] = ()
    if hosts is not None:
        node_sizes = tuple(nproc if nproc_per_node else (h.slots or nproc) for h in hosts)
        if etcd is not None:  # node 0 serves the process groups' store, on its host
            addr = master_addr or ("localhost" if all(is_local(h.name) for h in hosts) else hosts[0].name)
            store = Endpoint(addr, master_port or 0)
        elif not rdzv_endpoint:
            addr = master_addr or ("localhost" if all(is_local(h.name) for h in hosts) else socket.getfqdn())
            store = Endpoint(addr, master_port or 0)
    if standalone or (rdzv_backend == "static" and not rdzv_endpoint and master_port is None):
        run_id = str(uuid.uuid4())
        rdzv_backend = "c10d"
    else:
        run_id = rdzv_id
    if etcd is not None:
        run_id, rdzv_backend = etcd.run_id, "etcd"
    multinode = max_nodes > 1 or hosts is not None
    # this process hosts the store: it listens (with etcd and --hostfile, node 0's agent does, on its host)
    serves_store = (hosts is not None and etcd is None) or (hosts is None and node_rank == 0)
    store_listen = bind or (listen_address(store.host, multinode) if serves_store else "")
    if bind and serves_store and not multinode and not ipaddress.ip_address(bind).is_unspecified:
        store, addr = Endpoint(bind, store.port), bind  # it listens there alone: the workers reach it there
    ranks_filter = flag_values.parse_ranks_filter(local_ranks_filter)
    log_path = flag_values.writable_log_dir(log_dir) if log_dir else None
    tee_masks = flag_values.parse_std_spec(tee, "--tee", max(node_sizes, default=nproc))
    if not 0 <= recovery.spares <= MAX_WORKERS_PER_NODE - max(node_sizes, default=nproc):
        raise UsageError(f"--spares {recovery.spares}: give 0 or more, and at most {MAX_WORKERS_PER_NODE} workers "
                         "per node with the training workers")
    if hosts is None:  # this node's GPUs (with --hostfile each host's agent checks its own)
        flag_values.check_spares_fit(nproc, recovery.spares)
    for flag, seconds in (("--recovery-timeout", recovery.recovery_timeout), ("--join-timeout", recovery.join_timeout),
                          ("--hang-timeout", recovery.hang_timeout), ("--node-timeout", node_timeout)):
        if seconds is not None:
            flag_values.seconds(flag, seconds)
    if metrics_port is not None and not 0 < metrics_port < 65536:
        raise UsageError(f"--metrics-port {metrics_port}: a port is between 1 and 65535")
    if multinode and monitor_interval > fence_margin(node_timeout) / 2:
        raise UsageError(f"--node-timeout {node_timeout:g} leaves a cut-off node {fence_margin(node_timeout):g} s to "
                         f"stop its workers before the others go on without it, too little for --monitor-interval "
                         f"{monitor_interval:g}: raise --node-timeout to {8 * monitor_interval:g} or more")
    if recovery.refresh_every is not None and recovery.refresh_every < 0:
        raise UsageError(f"--refresh-every {recovery.refresh_every}: give 0 (no copies) or a number of steps")
    if recovery.data_reconfigure not in DATA_RECONFIGURE:
        raise UsageError(f"--data-reconfigure {recovery.data_reconfigure[:20]!r}: give fresh or native")
    world = sum(node_sizes) if node_sizes else nproc * min_nodes
    if not 1 <= recovery.min_nproc <= world:
        raise UsageError(f"--min-nproc {recovery.min_nproc} must be between 1 and the number of workers ({world})")
    try:
        xid_table = load_table(recovery.xid_policy) if recovery.xid_policy is not None else dict(DEFAULT_TABLE)
    except UsageError as exc:
        raise UsageError(f"--xid-policy: {exc}") from None
    resume_dir = flag_values.resume_dir(resume_from, node_rank) if resume_from else None
    return LaunchConfig(
        command=flag_values.worker_command(script, script_args, module, no_python, run_path),
        script=script,
        script_args=list(script_args),
        nproc_per_node=nproc,
        min_nodes=min_nodes,
        max_nodes=max_nodes,
        node_rank=node_rank,
        store=store,
        master_addr=addr,
        run_id=run_id,
        rdzv_backend=rdzv_backend,
        max_restarts=max_restarts,
        monitor_interval=monitor_interval,
        role=role,
        log_dir=log_path,
        redirects=flag_values.kept_off_console(
            flag_values.parse_std_spec(redirects, "--redirects", max(node_sizes, default=nproc)), tee_masks),
        tee=tee_masks,
        local_ranks_filter=ranks_filter,
        log_line_prefix_template=flag_values.prefix_template(log_line_prefix_template,
                                                             multinode=max_nodes > 1 or bool(hosts)),
        local_addr=local_addr,
        signals_to_handle=flag_values.parse_signals(signals_to_handle),
        shutdown_timeout=shutdown_timeout,
        virtual_local_rank=virtual_local_rank,
        recovery=recovery,
        node_sizes=node_sizes,
        host_store=hosts is None and node_rank == 0,
        store_listen=store_listen,
        secret=flag_values.run_secret(scheduled=max_nodes > 1 and hosts is None),
        node_timeout=node_timeout,
        node_start_timeout=node_start_timeout,
        metrics_port=metrics_port,
        fork_server=fork_server,
        hosts=hosts,
        xid_table=xid_table,
        resume_from=resume_dir,
        etcd=etcd,
    )


