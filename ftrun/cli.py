"""The ftrun command line: `ftrun [torchrun flags] script.py [args]`, plus its subcommands."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any, Optional

import typer

try:  # recent typer releases bundle their own copy of click (and no longer depend on click)
    from typer._click import exceptions as click_exceptions
except ImportError:
    from click import exceptions as click_exceptions

from ftrun import __version__
from ftrun.argv import expand_abbreviations
from ftrun.config import RecoveryConfig, build_config
from ftrun.errors import EXIT_USAGE, UsageError
from ftrun.processes import Stopped, ignore_late_signals, stop_on_signals


_ABORTS = (typer.Abort, getattr(click_exceptions, "Abort", typer.Abort))

_HELP = {"help_option_names": ["-h", "--help"]}

app = typer.Typer(
    name="ftrun",
    help="A fault-tolerant torchrun: survivors keep training in place when a worker dies.\n\n"
    "ftrun FLAGS script.py ARGS is short for ftrun run FLAGS script.py ARGS.",
    no_args_is_help=True,
    context_settings=_HELP,
    pretty_exceptions_enable=False,
)

SUBCOMMANDS = {"run"}

TORCHRUN_PANEL = "torchrun's flags (same spellings, PET_* variables and defaults)"
RECOVERY_PANEL = "ftrun: recovery in place"
NODES_PANEL = "ftrun: several nodes"
HEALTH_PANEL = "ftrun: hangs, GPU health and metrics"


def _show_version(value: bool) -> None:
    if value:
        print(f"ftrun {__version__}")
        raise typer.Exit()


@app.callback()
def _group(version: bool = typer.Option(False, "--version", is_eager=True, callback=_show_version,
                                        help="Print ftrun's version and exit.")) -> None:
    """A fault-tolerant torchrun: survivors keep training in place when a worker dies.

    `ftrun [flags] script.py [args]` is short for `ftrun run [flags] script.py [args]`.
    """


_RUN_CONTEXT = {"allow_interspersed_args": False, "ignore_unknown_options": False, **_HELP}


def _opt(*names: str, help: str, env: bool = True, **kwargs: Any) -> Any:
    """One of torchrun's options, in its panel: all its spellings and, where torchrun reads one (its ``env``
    and ``check_env`` actions), the variable PET_<DEST>, DEST being the first long spelling, as argparse makes it."""
    dest = next(n for n in names if n.startswith("--")).lstrip("-").replace("-", "_")
    default = kwargs.pop("default", None)
    return typer.Option(default, *names, envvar=f"PET_{dest.upper()}" if env else None, help=help,
                        show_envvar=False, rich_help_panel=TORCHRUN_PANEL, **kwargs)


def _print_completion(shell: Optional[str]) -> None:
    """torchrun's --print-completion SHELL: print ftrun's completion script (typer's) and exit."""
    if shell is None:
        return
    try:
        from typer._completion_shared import Shells, get_completion_script
    except ImportError:  # an older or newer typer without it: its own option still works
        raise UsageError("--print-completion is not available with this typer; use ftrun --show-completion") from None
    shells = [s.value for s in Shells]
    if shell not in shells:
        raise UsageError(f"--print-completion {shell}: ftrun completes {', '.join(shells)}")
    print(get_completion_script(prog_name="ftrun", complete_var="_FTRUN_COMPLETE", shell=shell))
    raise typer.Exit()


@app.command(context_settings=_RUN_CONTEXT)
def run(
    script: str = typer.Argument(..., help="Training script (or module with -m, or program with --no-python)."),
    script_args: Optional[list[str]] = typer.Argument(None, help="Arguments passed to the script."),
    # ftrun's own flags, first in the help
    no_recovery: bool = typer.Option(False, "--no-recovery", rich_help_panel=RECOVERY_PANEL,
                                     help="Never recover in place: group restarts only, as torchrun."),
    respawn: bool = typer.Option(False, "--respawn", rich_help_panel=RECOVERY_PANEL,
                                 help="Restart a lost worker; it rejoins with a peer's state."),
    spares: int = typer.Option(0, "--spares", rich_help_panel=RECOVERY_PANEL,
                               help="Idle workers started up front that replace lost ones at once."),
    min_nproc: int = typer.Option(1, "--min-nproc", rich_help_panel=RECOVERY_PANEL,
                                  help="Below this many workers, wait for joiners, then restart."),
    recovery_timeout: float = typer.Option(RecoveryConfig.recovery_timeout, "--recovery-timeout",
                                           rich_help_panel=RECOVERY_PANEL,
                                           help="Seconds an in-place recovery may take before a group restart."),
    join_timeout: float = typer.Option(RecoveryConfig.join_timeout, "--join-timeout", rich_help_panel=RECOVERY_PANEL,
                                       help="Seconds to wait for joiners when below --min-nproc."),
    refresh_every: Optional[int] = typer.Option(
        None, "--refresh-every", metavar="K", rich_help_panel=RECOVERY_PANEL,
        help="Sharded (FSDP2) state: copy each rank's shards to its buddy every K committed steps (0: never); "
             "overrides the script's ft.protect(refresh_every=...)."),
    data_reconfigure: str = typer.Option(
        "fresh", "--data-reconfigure", metavar="fresh|native", rich_help_panel=RECOVERY_PANEL,
        help="How each generation's data group is formed: fresh (a new group, the default) or native (torch's "
             "in-place reconfigure, where the backend offers it; experimental)."),
    hang_timeout: Optional[float] = typer.Option(
        None, "--hang-timeout", rich_help_panel=HEALTH_PANEL,
        help="Seconds without progress before a rank is declared hung (default: adaptive, 10x the median step)."),
    xid_policy: Optional[str] = typer.Option(
        None, "--xid-policy", metavar="FILE", rich_help_panel=HEALTH_PANEL,
        help="TOML or JSON file of Xid overrides: a table xid of code = action, e.g. 13 = \"evict_gpu\"."),
    hostfile: Optional[str] = typer.Option(
        None, "--hostfile", rich_help_panel=NODES_PANEL,
        help="Start one agent per host of this file (over ssh; local hosts directly)."),
    hosts: Optional[str] = typer.Option(None, "-H", "--hosts", rich_help_panel=NODES_PANEL,
                                        help="Hosts as a list, like host1:4,host2:4."),
    node_timeout: float = typer.Option(
        10.0, "--node-timeout", rich_help_panel=NODES_PANEL,
        help="Seconds without a lease renewal before a node is declared lost (and fences)."),
    no_fork_server: bool = typer.Option(
        False, "--no-fork-server", rich_help_panel=RECOVERY_PANEL,
        help="Start every worker as a new Python process, as torchrun does. By default the workers of a script "
             "that imports torch are forked from a process that imported torch once (the fork server), so a "
             "launch, a group restart or a --respawn replacement skips the seconds of importing it."),
    metrics_port: Optional[int] = typer.Option(
        None, "--metrics-port", metavar="PORT", rich_help_panel=HEALTH_PANEL,
        help="Serve Prometheus metrics on this port (each node's agent, all interfaces; read-only)."),
    resume_from: Optional[str] = typer.Option(
        None, "--resume-from", metavar="RUN_DIR", rich_help_panel=RECOVERY_PANEL,
        help="Start from the state an earlier launch saved as it was stopped (its run directory)."),
    # torchrun's flags, in torchrun's order
    nnodes: str = _opt("--nnodes", help="Number of nodes, N (MIN:MAX ranges are refused).", default="1:1"),
    nproc_per_node: Optional[str] = _opt("--nproc-per-node", "--nproc_per_node",
                                         help="Workers per node: N, gpu, cpu or auto. Default: one per visible GPU, else 1."),
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
                                  help="torchrun's event handler: only null (ftrun writes events.jsonl).",
                                  default="null"),
    role: str = _opt("--role", help="Role name of the workers (ROLE_NAME).", default="default"),
    module: bool = _opt("-m", "--module", help="Run the script as a module, like python -m.", default=False),
    no_python: bool = _opt("--no-python", "--no_python", help="Run the script directly, not with python.",
                           default=False),
    run_path: bool = _opt("--run-path", "--run_path", help="Run the script with runpy.run_path.", default=False),
    log_dir: Optional[str] = _opt("--log-dir", "--log_dir",
                                  help="Write <run>/attempt_<n>/<local_rank>/{stdout,stderr}.log, error.json here."),
    redirects: str = _opt("-r", "--redirects", help="Streams kept off the console, file only: 0-3 or RANK:MASK,...",
                          default="0"),
    tee: str = _opt("-t", "--tee", help="Streams to console and file; wins over --redirects (ftrun always "
                                        "shows and, with --log-dir, keeps both streams).", default="0"),
    log_line_prefix_template: Optional[str] = _opt(
        "--log-line-prefix-template", "--log_line_prefix_template",
        help="Prefix of console lines, as given (e.g. '[${rank}] '): ${role_name} ${rank} ${local_rank} ${hostname}; "
             "'' for none. Default: TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE, else '[${role_name}${rank}]: '."),
    local_ranks_filter: str = _opt("--local-ranks-filter", "--local_ranks_filter",
                                   help="Only show these local ranks on the console, e.g. 0,1.", default=""),
    duplicate_stdout_filters: str = _opt("--duplicate-stdout-filters", "--duplicate_stdout_filters",
                                         help="Refused: no equivalent yet.", default=""),
    duplicate_stderr_filters: str = _opt("--duplicate-stderr-filters", "--duplicate_stderr_filters",
                                         help="Refused: no equivalent yet.", default=""),
    node_rank: Optional[int] = _opt("--node-rank", "--node_rank",
                                    help="Rank of this node (default 0, or SLURM_NODEID under Slurm)."),
    master_addr: Optional[str] = _opt("--master-addr", "--master_addr",
                                      help="Address of the store host (static rendezvous; default 127.0.0.1, "
                                      "with --hostfile this machine's name)."),
    master_port: Optional[int] = _opt("--master-port", "--master_port",
                                      help="Port of the store (static rendezvous). Default: a free port."),
    local_addr: Optional[str] = _opt("--local-addr", "--local_addr", help="Address of this node."),
    logs_specs: Optional[str] = _opt("--logs-specs", "--logs_specs", env=False, help="Refused: no equivalent yet."),
    numa_binding: Optional[str] = _opt("--numa-binding", "--numa_binding", env=False,
                                       help="Refused: no equivalent yet."),
    signals_to_handle: str = _opt("--signals-to-handle", "--signals_to_handle",
                                  help="Signals forwarded to the workers.", default="SIGTERM,SIGINT,SIGHUP,SIGQUIT"),
    shutdown_timeout: Optional[float] = _opt("--shutdown-timeout", "--shutdown_timeout",
                                             help="Seconds between SIGTERM and SIGKILL when stopping workers (30)."),
    virtual_local_rank: bool = _opt("--virtual-local-rank", "--virtual_local_rank",
                                    help="LOCAL_RANK=0 and one GPU per worker through CUDA_VISIBLE_DEVICES.",
                                    default=False),
    print_completion: Optional[str] = _opt("--print-completion", "--print_completion", env=False, metavar="SHELL",
                                           is_eager=True, callback=_print_completion, expose_value=False,
                                           help="Print ftrun's shell completion script for SHELL and exit."),
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
        metrics_port=metrics_port, resume_from=resume_from, fork_server=not no_fork_server,
        unsupported={"--logs-specs": logs_specs, "--numa-binding": numa_binding,
                     "--duplicate-stdout-filters": duplicate_stdout_filters,
                     "--duplicate-stderr-filters": duplicate_stderr_filters,
                     f"--event-log-handler {event_log_handler}": event_log_handler != "null"},
        recovery=RecoveryConfig(enabled=not no_recovery, respawn=respawn, spares=spares, min_nproc=min_nproc,
                                recovery_timeout=recovery_timeout, join_timeout=join_timeout,
                                hang_timeout=hang_timeout, xid_policy=xid_policy, refresh_every=refresh_every,
                                data_reconfigure=data_reconfigure),
    )
    from ftrun.launcher.launch import launch

    raise typer.Exit(launch(config))


@app.command("_agent", hidden=True)
def agent() -> None:
    """Run one host's agent of a --hostfile launch, as the launcher's hand-off describes it."""
    from ftrun.launcher.launch import launch_handed_off

    raise typer.Exit(launch_handed_off())


@app.command(context_settings=_HELP)
def status(
    endpoint: Optional[str] = typer.Option(None, "--endpoint", help="HOST:PORT of the job's store (from anywhere)."),
    run_id: Optional[str] = typer.Option(None, "--run-id", help="The job's run id (or --rdzv-id); "
                                         "a job that ended is summarised from its event log."),
    log_dir: Optional[Path] = typer.Option(None, "--log-dir",
                                           help="The job's --log-dir, or its run directory: show the newest run."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON document instead of the table."),
    watch: bool = typer.Option(False, "--watch", help="Refresh the display in place until Ctrl-C."),
    secret_file: Optional[str] = typer.Option(None, "--secret-file", metavar="FILE",
                                              help="With --endpoint: the run's secret (its run directory's `secret`)."),
) -> None:
    """Show the live health of the running job (or summarise one that ended).

    Exit status: 0 healthy, 1 degraded (or an ended job that did not succeed), 2 bad input or several jobs
    running here (name one with --run-id), 3 no such job.
    """
    from ftrun.status.command import status as show

    raise typer.Exit(show(endpoint, run_id, log_dir, as_json, watch, secret_file))


@app.command(context_settings=_HELP)
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
    secret_file: Optional[str] = typer.Option(None, "--secret-file", metavar="FILE",
                                              help="With --endpoint: the run's secret (its run directory's `secret`)."),
) -> None:
    """Drill a fault into the running job: kill, hang, exception, xid, ecc or slow one rank, or run chaos.

    Exit codes: 0 done (chaos: every fault recovered in place), 1 chaos saw a fault not recovered in place,
    2 bad input: unknown drill, several jobs running here (name one with --run-id), no such rank, a drill the
    agent refuses; 3 no such job.
    """
    from ftrun import inject as injection

    if kind == "chaos":
        if mtbf is None or duration is None:
            raise UsageError("inject chaos needs --mtbf SECONDS and --duration SECONDS")
        if rank is not None or value is not None:
            raise UsageError("inject chaos picks its ranks itself: drop --rank and the value")
        chosen = injection.parse_kinds(kinds)
        injection.check_chaos(mtbf, duration)
        job = injection.Job.connect(injection.job_store(run_id, endpoint, secret_file))
        raise typer.Exit(injection.run_chaos(job, mtbf, duration, chosen, seed))
    message = injection.drill_message(kind, value, rank, duration_of_slow)
    job = injection.Job.connect(injection.job_store(run_id, endpoint, secret_file))
    answer = job.inject(message)
    print(f"run {answer['run']}: {answer['message']}")


@app.command(context_settings=_HELP)
def report(
    run: Optional[str] = typer.Argument(None, help="A run directory, a folder of runs (its newest), or a run id "
                                                   "(default: the newest run)."),
    log_dir: Optional[Path] = typer.Option(None, "--log-dir", help="Where to look for a run id: the job's --log-dir."),
    output: Optional[Path] = typer.Option(None, "-o", "--output", help="The SVG file to write "
                                                                      "(default: report.svg in the run directory)."),
) -> None:
    """Draw a run's timeline into an SVG file: world size, step rate, faults, each recovery's phases, and the
    loss where the workers printed it (step=N loss=X, kept with --log-dir)."""
    from ftrun.report.command import report as draw

    written = draw(run, log_dir, output)
    sys.stdout.flush()
    sys.stdout.buffer.write(os.fsencode(written) + b"\n")  # the name's own bytes, which may not be text


def _with_default_command(argv: list[str], top_level: set[str]) -> list[str]:
    """`ftrun [flags] script.py` means `ftrun run [flags] script.py`; ftrun's own top-level options stay."""
    if argv and argv[0] not in SUBCOMMANDS and argv[0] not in top_level:
        return ["run", *argv]
    return argv


def _option_names(command: Any) -> dict[str, bool]:
    """Every option spelling of a click command -> whether it takes a value."""
    return {name: not param.is_flag for param in command.params if param.param_type_name == "option"
            for name in (*param.opts, *param.secondary_opts)}


def _spelled_out(run_command: Any, args: list[str]) -> list[str]:
    """``ftrun run`` arguments with argparse-style abbreviations of torchrun's flags written out."""
    torchrun = [name for param in run_command.params if getattr(param, "rich_help_panel", None) == TORCHRUN_PANEL
                for name in param.opts if name.startswith("--")]
    return expand_abbreviations(args, {**_option_names(run_command), "--help": False}, ["--help", *torchrun])


def main(argv: list[str] | None = None) -> None:
    """Console entry point: one clear line and exit code 2 for bad input, never a traceback."""
    program = argv is None  # this process is ftrun (not a caller of main in its own process): its signals are ours
    if program:
        stop_on_signals()
    command = typer.main.get_command(app)
    SUBCOMMANDS.update(command.commands)
    try:
        args = _with_default_command(list(sys.argv[1:] if argv is None else argv),
                                     {*_option_names(command), *_HELP["help_option_names"]})
        if args[:1] == ["run"]:
            args = ["run", *_spelled_out(command.commands["run"], args[1:])]
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
    except Stopped as stopped:
        sys.exit(128 + stopped.signum)
    except (*_ABORTS, KeyboardInterrupt):
        sys.exit(130)
    finally:
        if program:
            ignore_late_signals()
    sys.exit(code or 0)
