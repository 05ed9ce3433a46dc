"""The ftrun command line: `ftrun [torchrun flags] script.py [args]`, plus its subcommands."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Optional

import typer

try:  # recent typer releases bundle their own copy of click (and no longer depend on click)
    from typer._click import exceptions as click_exceptions
except ImportError:
    from click import exceptions as click_exceptions

from ftrun.config import RecoveryConfig, build_config
from ftrun.errors import EXIT_USAGE, UsageError


_ABORTS = (typer.Abort, getattr(click_exceptions, "Abort", typer.Abort))

app = typer.Typer(
    name="ftrun",
    help="A fault-tolerant torchrun: survivors keep training in place when a worker dies.\n\n"
    "ftrun FLAGS script.py ARGS is short for ftrun run FLAGS script.py ARGS.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)

SUBCOMMANDS = {"run"}


@app.callback()
def _group() -> None:
    """A fault-tolerant torchrun: survivors keep training in place when a worker dies.

    `ftrun [flags] script.py [args]` is short for `ftrun run [flags] script.py [args]`.
    """
_RUN_CONTEXT = {"allow_interspersed_args": False, "ignore_unknown_options": False,
                "help_option_names": ["-h", "--help"]}


def _opt(*names: str, help: str, **kwargs):
    """A torchrun-compatible option: both spellings, and the PET_<NAME> environment variable."""
    env = "PET_" + names[0].lstrip("-").replace("-", "_").upper()
    default = kwargs.pop("default", None)
    return typer.Option(default, *names, envvar=env, help=help, show_envvar=False, **kwargs)


@app.command(context_settings=_RUN_CONTEXT)
def run(
    script: str = typer.Argument(..., help="Training script (or module with -m, or program with --no-python)."),
    script_args: Optional[list[str]] = typer.Argument(None, help="Arguments passed to the script."),
    nproc_per_node: Optional[str] = _opt("--nproc-per-node", "--nproc_per_node",
                                         help="Workers per node: N, gpu, cpu or auto. Default: one per visible GPU, else 1."),
    nnodes: str = _opt("--nnodes", help="Number of nodes, N or MIN:MAX.", default="1:1"),
    node_rank: Optional[int] = _opt("--node-rank", "--node_rank",
                                    help="Rank of this node (default 0, or SLURM_NODEID under Slurm)."),
    master_addr: Optional[str] = _opt("--master-addr", "--master_addr",
                                      help="Address of the store host (static rendezvous; default 127.0.0.1, "
                                      "with --hostfile this machine's name)."),
    master_port: Optional[int] = _opt("--master-port", "--master_port",
                                      help="Port of the store (static rendezvous). Default: a free port."),
    rdzv_backend: str = _opt("--rdzv-backend", "--rdzv_backend", help="static or c10d (ftrun hosts the store).",
                             default="static"),
    rdzv_endpoint: str = _opt("--rdzv-endpoint", "--rdzv_endpoint", help="Store endpoint HOST:PORT.", default=""),
    rdzv_id: str = _opt("--rdzv-id", "--rdzv_id", help="Run id (TORCHELASTIC_RUN_ID).", default="none"),
    rdzv_conf: str = _opt("--rdzv-conf", "--rdzv_conf", help="Rendezvous options KEY=VALUE,...", default=""),
    standalone: bool = _opt("--standalone", help="Single node: store on a free local port, random run id.",
                            default=False),
    max_restarts: int = _opt("--max-restarts", "--max_restarts", help="Group restarts allowed before failing.",
                             default=0),
    monitor_interval: float = _opt("--monitor-interval", "--monitor_interval",
                                   help="Seconds between housekeeping passes (exits are seen at once).", default=0.1),
    start_method: str = _opt("--start-method", "--start_method",
                             help="spawn, fork or forkserver (accepted; scripts always start as processes).",
                             default="spawn"),
    event_log_handler: str = _opt("--event-log-handler", "--event_log_handler",
                                  help="torchrun's event handler; ftrun writes events.jsonl instead.", default="null"),
    role: str = _opt("--role", help="Role name of the workers (ROLE_NAME).", default="default"),
    module: bool = _opt("-m", "--module", help="Run the script as a module, like python -m.", default=False),
    no_python: bool = _opt("--no-python", "--no_python", help="Run the script directly, not with python.",
                           default=False),
    run_path: bool = _opt("--run-path", "--run_path", help="Run the script with runpy.run_path.", default=False),
    log_dir: Optional[str] = _opt("--log-dir", "--log_dir",
                                  help="Write <run>/attempt_<n>/<local_rank>/{stdout,stderr}.log, error.json here."),
    redirects: str = _opt("-r", "--redirects", help="Streams kept off the console, file only: 0-3 or RANK:MASK,...",
                          default="0"),
    tee: str = _opt("-t", "--tee", help="Streams to console and file (ftrun always tees with --log-dir).",
                    default="0"),
    log_line_prefix_template: str = _opt("--log-line-prefix-template", "--log_line_prefix_template",
                                         help="Prefix of console lines: ${role_name} ${rank} ${local_rank} ${hostname}.",
                                         default=""),
    local_ranks_filter: str = _opt("--local-ranks-filter", "--local_ranks_filter",
                                   help="Only show these local ranks on the console, e.g. 0,1.", default=""),
    duplicate_stdout_filters: str = _opt("--duplicate-stdout-filters", "--duplicate_stdout_filters",
                                         help="Not supported.", default="", hidden=True),
    duplicate_stderr_filters: str = _opt("--duplicate-stderr-filters", "--duplicate_stderr_filters",
                                         help="Not supported.", default="", hidden=True),
    local_addr: Optional[str] = _opt("--local-addr", "--local_addr", help="Address of this node."),
    logs_specs: Optional[str] = _opt("--logs-specs", "--logs_specs", help="Not supported.", hidden=True),
    numa_binding: Optional[str] = _opt("--numa-binding", "--numa_binding", help="Not supported.", hidden=True),
    signals_to_handle: str = _opt("--signals-to-handle", "--signals_to_handle",
                                  help="Signals forwarded to the workers.", default="SIGTERM,SIGINT,SIGHUP,SIGQUIT"),
    shutdown_timeout: Optional[float] = _opt("--shutdown-timeout", "--shutdown_timeout",
                                             help="Seconds between SIGTERM and SIGKILL when stopping workers (30)."),
    virtual_local_rank: bool = _opt("--virtual-local-rank", "--virtual_local_rank",
                                    help="LOCAL_RANK=0 and one GPU per worker through CUDA_VISIBLE_DEVICES.",
                                    default=False),
    no_recovery: bool = typer.Option(False, "--no-recovery", help="Never recover in place: group restarts only."),
    respawn: bool = typer.Option(False, "--respawn", help="Restart a lost worker; it rejoins with a peer's state."),
    spares: int = typer.Option(0, "--spares", help="Idle workers started up front that replace lost ones at once."),
    min_nproc: int = typer.Option(1, "--min-nproc", help="Below this many workers, wait for joiners, then restart."),
    recovery_timeout: float = typer.Option(RecoveryConfig.recovery_timeout, "--recovery-timeout",
                                           help="Seconds an in-place recovery may take before a group restart."),
    join_timeout: float = typer.Option(RecoveryConfig.join_timeout, "--join-timeout",
                                       help="Seconds to wait for joiners when below --min-nproc."),
    hostfile: Optional[str] = typer.Option(
        None, "--hostfile", help="Start one agent per host of this file (over ssh; local hosts directly)."),
    hosts: Optional[str] = typer.Option(None, "-H", "--hosts", help="Hosts as a list, like host1:4,host2:4."),
    node_timeout: float = typer.Option(
        10.0, "--node-timeout", help="Seconds without a lease renewal before a node is declared lost (and fences)."),
    hang_timeout: Optional[float] = typer.Option(
        None, "--hang-timeout",
        help="Seconds without progress before a rank is declared hung (default: adaptive, 10x the median step)."),
    xid_policy: Optional[str] = typer.Option(
        None, "--xid-policy", metavar="FILE",
        help="TOML or JSON file of Xid overrides: a table xid of code = action, e.g. 13 = \"evict_gpu\"."),
    resume_from: Optional[str] = typer.Option(
        None, "--resume-from", metavar="RUN_DIR",
        help="Start from the state an earlier launch saved as it was stopped (its run directory)."),
) -> None:
    """Launch SCRIPT on this node as torchrun would, recovering in place from worker faults."""
    config = build_config(
        script=script, script_args=script_args or [], nproc_per_node=nproc_per_node, nnodes=nnodes,
        node_rank=node_rank, master_addr=master_addr, master_port=master_port, rdzv_backend=rdzv_backend,
        rdzv_endpoint=rdzv_endpoint, rdzv_id=rdzv_id, rdzv_conf=rdzv_conf, standalone=standalone,
        max_restarts=max_restarts, monitor_interval=monitor_interval, start_method=start_method, role=role,
        module=module, no_python=no_python, run_path=run_path, log_dir=log_dir, redirects=redirects, tee=tee,
        local_ranks_filter=local_ranks_filter, local_addr=local_addr, signals_to_handle=signals_to_handle,
        shutdown_timeout=shutdown_timeout, log_line_prefix_template=log_line_prefix_template,
        virtual_local_rank=virtual_local_rank, hostfile=hostfile, host_list=hosts, node_timeout=node_timeout,
        resume_from=resume_from, unsupported={"--logs-specs": logs_specs, "--numa-binding": numa_binding,
                     "--duplicate-stdout-filters": duplicate_stdout_filters,
                     "--duplicate-stderr-filters": duplicate_stderr_filters,
                     f"--event-log-handler {event_log_handler}": event_log_handler != "null"},
        recovery=RecoveryConfig(enabled=not no_recovery, respawn=respawn, spares=spares, min_nproc=min_nproc,
                                recovery_timeout=recovery_timeout, join_timeout=join_timeout,
                                hang_timeout=hang_timeout, xid_policy=xid_policy),
    )
    from ftrun.launcher.launch import launch

    raise typer.Exit(launch(config))


@app.command("_agent", hidden=True)
def agent() -> None:
    """Run one host's agent of a --hostfile launch, as the launcher's hand-off describes it."""
    from ftrun.launcher.launch import launch_handed_off

    raise typer.Exit(launch_handed_off())


@app.command(context_settings={"help_option_names": ["-h", "--help"]})
def status(
    endpoint: Optional[str] = typer.Option(None, "--endpoint", help="HOST:PORT of the job's store (from anywhere)."),
    run_id: Optional[str] = typer.Option(None, "--run-id", help="The job's run id (or --rdzv-id); "
                                         "a job that ended is summarised from its event log."),
    log_dir: Optional[Path] = typer.Option(None, "--log-dir",
                                           help="The job's --log-dir, or its run directory: show the newest run."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON document instead of the table."),
    watch: bool = typer.Option(False, "--watch", help="Refresh the display in place until Ctrl-C."),
) -> None:
    """Show the live health of a running job (or summarise one that ended).

    Exit status: 0 healthy, 1 degraded (or an ended job that did not succeed), 3 no such job.
    """
    from ftrun.status.command import status as show

    raise typer.Exit(show(endpoint, run_id, log_dir, as_json, watch))


@app.command(context_settings={"help_option_names": ["-h", "--help"]})
def inject(
    kind: str = typer.Argument(..., help="kill, hang, exception, xid CODE, ecc [COUNT], slow SECONDS, or chaos."),
    value: Optional[str] = typer.Argument(None, help="xid: the Xid code; ecc: the error count (1); "
                                                     "slow: seconds added to each step (0 clears)."),
    rank: Optional[int] = typer.Option(None, "--rank", help="The rank to act on (as in its console prefix)."),
    duration_of_slow: Optional[float] = typer.Option(None, "--for", help="slow: only for this many seconds."),
    mtbf: Optional[float] = typer.Option(None, "--mtbf", help="chaos: mean seconds of uptime between faults."),
    duration: Optional[float] = typer.Option(None, "--duration", help="chaos: seconds to keep injecting."),
    kinds: str = typer.Option("kill,hang,exception", "--kinds", help="chaos: the faults to draw from "
                                                                     "(kill, hang, exception, xid, ecc)."),
    seed: Optional[int] = typer.Option(None, "--seed", help="chaos: seed of the fault schedule."),
    run_id: Optional[str] = typer.Option(None, "--run-id", help="The job's run id (default: the only job here)."),
    endpoint: Optional[str] = typer.Option(None, "--endpoint", help="The job's store, HOST:PORT."),
) -> None:
    """Drill a fault into a running job: kill, hang, exception, xid, ecc or slow one rank, or run chaos.

    Exit codes: 0 done (chaos: every fault recovered in place), 1 chaos saw a fault not recovered in place,
    2 bad input: unknown drill, no running job, no such rank, a drill the agent refuses.
    """
    from ftrun import inject as injection

    if kind == "chaos":
        if mtbf is None or duration is None:
            raise UsageError("inject chaos needs --mtbf SECONDS and --duration SECONDS")
        if rank is not None or value is not None:
            raise UsageError("inject chaos picks its ranks itself: drop --rank and the value")
        chosen = injection.parse_kinds(kinds)
        job = injection.Job.connect(injection.job_endpoint(run_id, endpoint))
        raise typer.Exit(injection.run_chaos(job, mtbf, duration, chosen, seed))
    message = injection.drill_message(kind, value, rank, duration_of_slow)
    job = injection.Job.connect(injection.job_endpoint(run_id, endpoint))
    print(job.inject(message)["message"])


def _with_default_command(argv: list[str]) -> list[str]:
    """`ftrun [flags] script.py` means `ftrun run [flags] script.py`."""
    if argv and argv[0] not in SUBCOMMANDS and argv[0] not in ("--help", "-h"):
        return ["run", *argv]
    return argv


def main(argv: list[str] | None = None) -> None:
    """Console entry point: one clear line and exit code 2 for bad input, never a traceback."""
    SUBCOMMANDS.update(app.registered_commands and [c.name or c.callback.__name__ for c in app.registered_commands])
    args = _with_default_command(list(sys.argv[1:] if argv is None else argv))
    command = typer.main.get_command(app)
    try:
        code = command.main(args, prog_name="ftrun", standalone_mode=False)
    except click_exceptions.UsageError as exc:
        if not exc.format_message():  # no arguments at all: the help was shown, nothing more to say
            sys.exit(EXIT_USAGE)
        hint = f" (see 'ftrun {exc.ctx.info_name if exc.ctx and exc.ctx.info_name != 'ftrun' else ''} --help')"
        print(f"ftrun: error: {exc.format_message()}{hint.replace('  ', ' ')}", file=sys.stderr)
        sys.exit(EXIT_USAGE)
    except UsageError as exc:
        print(f"ftrun: error: {exc}", file=sys.stderr)
        sys.exit(exc.exit_code)
    except (*_ABORTS, KeyboardInterrupt):
        sys.exit(130)
    sys.exit(code or 0)
