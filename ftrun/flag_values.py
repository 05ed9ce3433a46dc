"""The value of one flag (or of the variable torchrun reads in its place), parsed and checked: each function
returns what the launch configuration holds, or raises UsageError with a line that says how to fix it."""

from __future__ import annotations

import ipaddress
import os
import shutil
import signal
import sys
import uuid
from pathlib import Path

from ftrun.errors import UsageError
from ftrun.health.devices import listed_gpus
from ftrun.health.nvml import gpu_count
from ftrun.launcher.hosts import MAX_WORKERS_PER_NODE, Host, parse_host_list, read_hostfile
from ftrun.paths import is_dir, is_file
from ftrun.protocol import MAX_SECONDS, is_duration
from ftrun.store import etcd_config
from ftrun.store.auth import SECRET_FILE_VARIABLE, new_secret, read_secret_file
from ftrun.store.etcd_config import EtcdOptions


def seconds(flag: str, value: float, *, zero: bool = False) -> float:
    """``value``, when it is a duration ``flag`` may give (:func:`~ftrun.protocol.is_duration`: more than 0, or
    0 with ``zero``, and at most :data:`~ftrun.protocol.MAX_SECONDS`); else UsageError."""
    if not is_duration(value, zero=zero):
        least = "0 or more" if zero else "a positive number of"
        raise UsageError(f"{flag} must be {least} seconds, at most {MAX_SECONDS:,.0f}, not {value:g}")
    return value


def parse_nnodes(value: str) -> tuple[int, int]:
    """Parse torchrun's --nnodes ``N`` or ``MIN:MAX``."""
    try:
        parts = [int(p) for p in value.split(":")]
    except ValueError:
        parts = []
    if len(parts) == 1:
        parts = parts * 2
    if len(parts) != 2 or not 1 <= parts[0] <= parts[1]:
        raise UsageError(f"--nnodes {value!r} is not valid: use N or MIN:MAX with 1 <= MIN <= MAX")
    return parts[0], parts[1]


def resolve_nproc(value: str | None) -> int:
    """Turn --nproc-per-node (int, gpu, cpu, auto, or unset) into a worker count.

    Unset means one worker per visible GPU, else 1 -- ftrun's one deliberate departure from torchrun,
    whose default is 1.
    """
    if value is None or value == "":
        return _gpu_workers(visible_gpu_count()) or 1
    if value == "cpu":
        return os.cpu_count() or 1
    if value in ("gpu", "auto"):
        gpus = _gpu_workers(visible_gpu_count())
        if gpus:
            return gpus
        if value == "gpu":
            raise UsageError("--nproc-per-node gpu: no GPU is visible here; give a number, or 'cpu'")
        return os.cpu_count() or 1
    if not value.isascii() or not value.isdigit() or len(value) > 6:
        raise UsageError(f"--nproc-per-node {value[:20]!r} is not valid: use a number, 'gpu', 'cpu' or 'auto'")
    nproc = int(value)
    if not 1 <= nproc <= MAX_WORKERS_PER_NODE:
        raise UsageError(f"--nproc-per-node {nproc}: give between 1 and {MAX_WORKERS_PER_NODE} workers per node")
    return nproc


def visible_gpu_count() -> int:
    """Count the GPUs this process may use: those CUDA_VISIBLE_DEVICES lists where it is set, else NVML's; 0
    without NVML."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    return listed_gpus(visible) if visible is not None else gpu_count()


def _gpu_workers(gpus: int) -> int:
    """One worker per visible GPU, within what one node may run."""
    if gpus > MAX_WORKERS_PER_NODE:
        raise UsageError(f"{gpus} GPUs are visible (CUDA_VISIBLE_DEVICES), more than the {MAX_WORKERS_PER_NODE} "
                         "workers one node may run: give --nproc-per-node")
    return gpus


def spares_refusal(nproc: int, spares: int, gpus: int) -> str | None:
    """Why ``spares`` spare workers cannot start beside ``nproc`` training workers on a node of ``gpus`` GPUs,
    or None. Where the workers have a GPU each, a spare needs one of its own: its local rank would wrap around
    onto a training worker's GPU (two ranks of one NCCL communicator on one device, which NCCL refuses), and the
    lost worker's GPU would stay idle. A node with fewer GPUs than workers (or none) shares them already."""
    if spares and nproc <= gpus < nproc + spares:
        return (f"--spares {spares}: this node has {gpus} GPUs and {nproc} train on them, and a spare needs a GPU of "
                f"its own: give at most {gpus - nproc} spares or a lower --nproc-per-node, or use --respawn (a lost "
                "worker restarts on its GPU)")
    return None


def check_spares_fit(nproc: int, spares: int, where: str = "") -> None:
    """Raise UsageError (prefixed by ``where``, a host's name) when ``spares`` cannot start beside ``nproc``
    training workers on this node's visible GPUs (:func:`spares_refusal`)."""
    refusal = spares_refusal(nproc, spares, visible_gpu_count()) if spares else None
    if refusal:
        raise UsageError(f"{where}: {refusal}" if where else refusal)


def parse_std_spec(spec: str, flag: str, nproc: int) -> dict[int, int]:
    """Parse torchrun's --redirects/--tee value into {local_rank: stream mask}.

    ``"3"`` applies mask 3 (stdout and stderr) to every local rank; ``"0:1,1:2"`` gives local rank 0 its
    stdout and local rank 1 its stderr.
    """
    spec = spec.strip() or "0"
    try:
        if ":" not in spec:
            mask = int(spec)
            masks = {rank: mask for rank in range(nproc)}
        else:
            masks = {}
            for part in spec.split(","):
                rank, mask = part.split(":")
                masks[int(rank)] = int(mask)
    except ValueError:
        raise UsageError(f"{flag} {spec!r} is not valid: use 0-3, or LOCAL_RANK:0-3 pairs like 0:1,1:2") from None
    if any(not 0 <= mask <= 3 for mask in masks.values()):
        raise UsageError(f"{flag} {spec!r} is not valid: each stream mask is 0 (none), 1 (stdout), 2 (stderr) "
                         "or 3 (both)")
    return masks


def kept_off_console(redirects: dict[int, int], tee: dict[int, int]) -> dict[int, int]:
    """Streams kept off the console, by local rank: those --redirects names, unless --tee names them too
    (torchrun tees a stream that is both redirected and tee'd)."""
    return {rank: mask & ~tee.get(rank, 0) for rank, mask in redirects.items()}


def prefix_template(given: str | None, multinode: bool) -> str:
    """The console prefix of worker lines: --log-line-prefix-template as given, else
    TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE (as torchrun reads it), else ftrun's default, ``[default0]: ``
    (``[host:0]: `` across nodes). The prefix is printed as is: an empty template means no prefix."""
    if given is None:
        given = os.environ.get("TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE")
    if given is not None:
        return given
    return "[${hostname}:${rank}]: " if multinode else "[${role_name}${rank}]: "


def parse_ranks_filter(value: str) -> set[int] | None:
    """--local-ranks-filter ``0,1,2``: the local ranks whose output is shown (None: every rank's)."""
    if not value:
        return None
    try:
        return {int(rank) for rank in value.split(",")}
    except ValueError:
        raise UsageError(f"--local-ranks-filter {value!r} is not valid: use ranks like 0,1,2") from None


def parse_signals(value: str) -> list[signal.Signals]:
    """Parse --signals-to-handle ``SIGTERM,SIGINT`` into signal numbers."""
    result = []
    for name in filter(None, (n.strip() for n in value.split(","))):
        try:
            result.append(signal.Signals[name if name.startswith("SIG") else f"SIG{name}"])
        except KeyError:
            raise UsageError(f"--signals-to-handle: {name!r} is not a signal name (e.g. SIGTERM,SIGUSR1)") from None
    return result


def worker_command(script: str, script_args: list[str], module: bool, no_python: bool, run_path: bool) -> list[str]:
    """The worker command line, as torchrun builds it (python -u, -m, --no-python, --run-path)."""
    if module and no_python:
        raise UsageError("-m/--module and --no-python cannot be combined")
    if run_path:
        if not is_file(Path(script)):
            raise UsageError(f"script {script!r} not found: give the path of an existing file")
        runner = "import runpy, sys; sys.argv = sys.argv[1:]; runpy.run_path(sys.argv[0], run_name='__main__')"
        return [sys.executable, "-u", "-c", runner, os.path.abspath(script), *script_args]
    if module:
        return [sys.executable, "-u", "-m", script, *script_args]
    if no_python:
        if shutil.which(script) is None:
            raise UsageError(f"--no-python: {script!r} is not an executable file or a command on PATH")
        return [script, *script_args]
    if not is_file(Path(script)):
        raise UsageError(f"script {script!r} not found: give the path of an existing file (or use -m for a module)")
    return [sys.executable, "-u", script, *script_args]


def launch_hosts(hostfile: str | None, host_list: str | None, *, nnodes: int,
                 node_rank: int | None) -> list[Host] | None:
    """The hosts of a --hostfile / -H launch, or None for a launch of this node only."""
    if hostfile is not None and host_list is not None:
        raise UsageError("--hostfile and -H/--hosts both list hosts: give one of them")
    if hostfile is None and host_list is None:
        return None
    if nnodes > 1 or node_rank is not None:
        raise UsageError("--hostfile/-H starts every node from here: remove --nnodes and --node-rank")
    return read_hostfile(hostfile) if hostfile is not None else parse_host_list(host_list)


def etcd_backend(endpoints: str, rdzv_id: str, rdzv_conf: str, *, multinode: bool) -> EtcdOptions:
    """The etcd backend's options; a job without a --rdzv-id gets a run id of its own, but for nodes started
    one by one (``multinode``), which must all name the same."""
    if not endpoints:
        raise UsageError("--rdzv-backend etcd needs the cluster's --rdzv-endpoint h1:2379[,h2:2379,...]")
    if rdzv_id == "none" and multinode:
        raise UsageError("--rdzv-backend etcd: give every node the same --rdzv-id (the job's keys in etcd are "
                         "under it)")
    run_id = str(uuid.uuid4()) if rdzv_id == "none" else rdzv_id
    if not run_id.replace("-", "").replace("_", "").replace(".", "").isalnum() or len(run_id) > 128:
        raise UsageError(f"--rdzv-id {run_id[:40]!r}: with etcd, use letters, digits, '-', '_' and '.' (at most "
                         "128)")
    return etcd_config.etcd_options(endpoints, run_id, parse_rdzv_conf(rdzv_conf))


def parse_rdzv_conf(text: str) -> dict[str, str]:
    """--rdzv-conf ``KEY=VALUE,...``. ftrun reads ``bind``: the address the store listens on, given as an IP
    address (``0.0.0.0`` or ``::`` for every interface), ``join_timeout`` (torchrun's: the seconds the nodes
    the job starts with have to arrive, :func:`join_timeout`), and with etcd the keys of
    :data:`ftrun.store.etcd.CONF_KEYS`; torchrun's other keys are accepted and unused."""
    conf = {}
    for item in filter(None, text.split(",")):
        key, equals, value = item.partition("=")
        if not equals or not key.strip():
            raise UsageError(f"--rdzv-conf {text[:80]!r} is not valid: use KEY=VALUE pairs separated by commas")
        conf[key.strip()] = value.strip()
    bind = conf.get("bind")
    if bind is not None:
        try:
            address = ipaddress.ip_address(bind.strip("[]"))
            if address.is_multicast or address == ipaddress.IPv4Address("255.255.255.255"):
                raise ValueError("no host has it")
        except ValueError:
            raise UsageError(f"--rdzv-conf bind={bind[:60]}: give an IP address of this machine, or 0.0.0.0 (or ::) "
                             "to listen on every interface") from None
        conf["bind"] = str(address)
    return conf


def join_timeout(conf: dict[str, str], default: float) -> float:
    """--rdzv-conf join_timeout (torchrun's key): the seconds the nodes the job starts with have to arrive
    (``default`` when it is not given)."""
    text = conf.get("join_timeout")
    if text is None:
        return default
    try:
        value = float(text)
    except ValueError:
        raise UsageError(f"--rdzv-conf join_timeout={text[:20]}: give the seconds the nodes have to arrive") from None
    return seconds("--rdzv-conf join_timeout", value)


def shutdown_timeout(value: float | None) -> float:
    """--shutdown-timeout, or torchrun's TORCH_ELASTIC_SHUTDOWN_TIMEOUT (30 s when neither is set)."""
    if value is None:
        text = os.environ.get("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", "30")
        try:
            value = float(text)
        except ValueError:
            raise UsageError(f"TORCH_ELASTIC_SHUTDOWN_TIMEOUT={text[:20]!r}: give a number of seconds") from None
    return seconds("--shutdown-timeout", value, zero=True)


def run_secret(scheduled: bool) -> str:
    """The run's secret: from ``FTRUN_SECRET_FILE`` when it is set, else a fresh one. Nodes started one by one
    (by a scheduler) must all use the same secret, so they need the file."""
    path = os.environ.get(SECRET_FILE_VARIABLE)
    if path:
        return read_secret_file(path, SECRET_FILE_VARIABLE)
    if scheduled:
        raise UsageError(f"the nodes of a job started one by one must share a secret: set {SECRET_FILE_VARIABLE} "
                         "on every node to a file only you can read (e.g. `openssl rand -hex 32 > ~/.ftrun-secret; "
                         "chmod 600 ~/.ftrun-secret`), or start every node from here with --hostfile")
    return new_secret()


def writable_log_dir(log_dir: str) -> Path:
    """Create --log-dir if needed and check that it can be written."""
    path = Path(log_dir)
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise UsageError(f"--log-dir {log_dir}: cannot create it ({exc.strerror}); pick a writable directory") from None
    if not os.access(path, os.W_OK | os.X_OK):
        raise UsageError(f"--log-dir {log_dir}: not writable; pick a writable directory")
    return path


def holds_saved_state(rescue: Path) -> bool:
    """Whether the directory ``rescue`` holds saved state: a regular file ``*.pt``, or ``shards/*.pt`` for sharded
    state (a FIFO or a directory there is none). The workers read the files, and skip those they cannot use."""
    return is_dir(rescue) and any(is_file(file) for file in [*rescue.glob("*.pt"), *rescue.glob("shards/*.pt")])


def resumed_rescue(run_dir: Path, node_rank: int) -> Path:
    """The directory of saved state node ``node_rank`` resumes from, in the run directory ``run_dir`` of node 0 of
    an earlier launch: its own node's, ``node<N>/rescue``, where this host holds it (that node saved there, on
    its own disk or on shared storage), else node 0's, ``rescue``."""
    own = run_dir / f"node{node_rank}" / "rescue"
    return own if node_rank > 0 and holds_saved_state(own) else run_dir / "rescue"


def resume_dir(run_dir: str, node_rank: int = 0) -> Path:
    """Check that --resume-from names a run directory holding saved state for node ``node_rank``
    (:func:`resumed_rescue`); its absolute path."""
    path = Path(run_dir).absolute()
    if not holds_saved_state(resumed_rescue(path, node_rank)):
        raise UsageError(f"--resume-from {run_dir}: no saved state there (no file {path / 'rescue'}/*.pt nor "
                         f"{path / 'rescue'}/shards/*.pt): give the "
                         "run directory of a launch that saved its state, as its 'the state of step N is saved' "
                         "line names it")
    return path
