"""Starting a command on another host over ssh: the command line, the forwarded environment, and errors.

The launching process starts one agent per host. Local hosts (see :func:`ftrun.launcher.hosts.is_local`) need
no ssh; for the others, :func:`ssh_argv` builds an ``ssh`` command that runs the agent in the launcher's working
directory with the environment users expect forwarded (:func:`forwarded_env`).

Environment: the variables for the remote command travel on ssh's standard input, never in a command line
(where every user of either host could read them in ``/proc/*/cmdline``): the caller writes
:func:`environment_preamble` first, and the supervisor below sets them before it starts the command.

Lifetime: ssh without a terminal does not signal the remote command when the connection drops; the remote
command only sees its standard input close. :func:`ssh_argv` therefore wraps the command in a small POSIX
shell supervisor that runs it with stdin from ``/dev/null`` and sends it SIGTERM as soon as ssh's standard
input reaches end of file: when the local ssh client exits or is killed, when the launcher closes the pipe,
or when the launcher dies. The caller must keep ssh's stdin an open pipe for as long as the remote command
should run (``subprocess.Popen(..., stdin=subprocess.PIPE)``, never ``DEVNULL`` or ``ssh -n``), write the
preamble to it, and close it to stop the command.

User settings, both read from the launcher's environment:

``FTRUN_SSH_ENV``
    More variables to forward, a comma-separated list of names (``HF_HOME``) or prefixes (``WANDB_*``).
``FTRUN_SSH_OPTS``
    Extra ssh options, split like a shell would (``-i ~/.ssh/cluster -o StrictHostKeyChecking=no``).
"""

from __future__ import annotations

import re
import shlex
import subprocess
from collections.abc import Iterable, Mapping, Sequence

from ftrun.errors import UsageError

FORWARDED = ("NCCL_*", "GLOO_*", "PYTHON*", "FTRUN_*", "CUDA_*", "TORCH_*", "OMP_NUM_THREADS")
"""Variables forwarded to remote hosts: exact names, or prefixes ending in ``*``."""

SSH_ENV = "FTRUN_SSH_ENV"
"""Environment variable naming more variables to forward (``NAME`` or ``PREFIX*``, comma-separated)."""

SSH_OPTS = "FTRUN_SSH_OPTS"
"""Environment variable holding extra ssh options, split with shell quoting rules."""

SERVER_ALIVE = ("-o", "ServerAliveInterval=5", "-o", "ServerAliveCountMax=3")
"""A connection that stops answering (a lost or partitioned host) ends the local ssh after about 15 s."""

SSH_CONNECTION_ERROR = 255
"""ssh's exit status for its own errors (connection, authentication, name resolution)."""

_PATTERN = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\*?")

# Reads the environment preamble from stdin (a line count, then that many lines of `export` script), then
# runs "$@" with stdin from /dev/null and stops it with SIGTERM when ssh's stdin (kept on fd 3 for the
# watcher) reaches end of file; exits with the command's status. The watcher uses the `read` builtin so
# that killing it leaves no process behind. One line: csh-family login shells refuse newlines in quotes.
# `read` takes one byte at a time from a pipe, so nothing after the preamble is consumed.
_SUPERVISOR = (
    "nl=$(printf '\\n_'); nl=${nl%_}; "
    'IFS= read -r n || exit 97; s=; i=0; '
    'while [ "$i" -lt "$n" ]; do IFS= read -r l || exit 97; s="$s$l$nl"; i=$((i+1)); done; '
    'eval "$s"; unset nl n s i l; '
    'exec 3<&0 0</dev/null; '
    '"$@" 3<&- & child=$!; '
    '(while read -r _; do :; done; kill -TERM "$child") 0<&3 3<&- >/dev/null 2>&1 & watcher=$!; '
    'exec 3<&-; '
    'wait "$child"; status=$?; '
    'kill "$watcher" 2>/dev/null; '
    'exit "$status"'
)


def _patterns(entries: Iterable[str], source: str) -> list[str]:
    """Validate variable names and ``PREFIX*`` patterns, dropping empty entries."""
    patterns = []
    for entry in (entry.strip() for entry in entries):
        if not entry:
            continue
        if not _PATTERN.fullmatch(entry):
            raise UsageError(f"{source}: {entry!r} is not a variable name or prefix: write NAME or PREFIX*, "
                             "comma-separated, like HF_HOME,WANDB_*")
        patterns.append(entry)
    return patterns


def _matches(name: str, pattern: str) -> bool:
    return name.startswith(pattern[:-1]) if pattern.endswith("*") else name == pattern


def forwarded_env(environ: Mapping[str, str], extra: Sequence[str] = ()) -> dict[str, str]:
    """The variables of ``environ`` that remote hosts get: :data:`FORWARDED`, the names or ``PREFIX*``
    patterns in ``extra``, and those listed in ``FTRUN_SSH_ENV`` (comma-separated).

    Raises UsageError for an entry that is neither a variable name nor a prefix followed by ``*``.
    """
    patterns = [*FORWARDED, *_patterns(extra, "forwarded variables"),
                *_patterns(environ.get(SSH_ENV, "").split(","), SSH_ENV)]
    return {name: value for name, value in environ.items() if any(_matches(name, p) for p in patterns)}


def ssh_options(environ: Mapping[str, str]) -> list[str]:
    """The extra ssh options in ``FTRUN_SSH_OPTS``, split with shell quoting rules (UsageError if unbalanced)."""
    try:
        return shlex.split(environ.get(SSH_OPTS, ""))
    except ValueError as error:
        raise UsageError(f"{SSH_OPTS}: {error}: quote options like a shell command line") from None


def _ssh_base(port: int | None, options: Sequence[str], connect_timeout: float) -> list[str]:
    """``ssh`` and its options. ssh keeps the first value it sees for a setting, so the port and the
    caller's options come before ftrun's defaults and override them."""
    port_args = [] if port is None else ["-p", str(port)]
    timeout = max(1, round(connect_timeout))
    return ["ssh", *port_args, *options, "-o", "BatchMode=yes", "-o", f"ConnectTimeout={timeout}", *SERVER_ALIVE]


def remote_command(remote_argv: Sequence[str], cwd: str) -> str:
    """The shell command line run on the remote host: change to ``cwd`` and run ``remote_argv`` under the
    supervisor that sets the preamble's variables and stops it with SIGTERM when ssh's standard input closes."""
    if not remote_argv:
        raise ValueError("remote_argv is empty")
    words = ["/bin/sh", "-c", _SUPERVISOR, "ftrun-remote", *remote_argv]
    return f"cd {shlex.quote(cwd)} && exec {shlex.join(words)}"


def environment_preamble(env: Mapping[str, str]) -> bytes:
    """What to write to ssh's standard input first: the variables ``env`` for the remote command.

    Names must be variable names (UsageError otherwise); values may hold any character but NUL.
    """
    bad = [name for name in env if not _PATTERN.fullmatch(name) or name.endswith("*")]
    if bad:
        raise UsageError(f"cannot forward {bad[0]!r}: not an environment variable name")
    script = "".join(f"export {name}={shlex.quote(value)}\n" for name, value in env.items())
    return f"{script.count(chr(10))}\n{script}".encode()


def ssh_argv(host: str, remote_argv: Sequence[str], cwd: str, *, port: int | None = None,
             options: Sequence[str] = (), connect_timeout: float = 10) -> list[str]:
    """The local command that runs ``remote_argv`` on ``host`` in directory ``cwd``.

    ssh runs in batch mode (no password prompt), gives up connecting after ``connect_timeout`` seconds, and
    exits with 255 when the connection fails or stops answering (see :data:`SERVER_ALIVE`). ``options``
    (for example :func:`ssh_options`) and ``port`` override these defaults. Run it with stdin an open pipe and
    write :func:`environment_preamble` to it first; closing that pipe, or the ssh client ending for any reason,
    stops the remote command with SIGTERM.
    """
    return [*_ssh_base(port, options, connect_timeout), "--", host, remote_command(remote_argv, cwd)]


def _ssh_message(stderr: str) -> str:
    """ssh's own error: the last non-empty line of its stderr."""
    lines = [line.strip() for line in stderr.replace("\r", "\n").splitlines() if line.strip()]
    return lines[-1] if lines else "ssh printed no message"


def describe_ssh_failure(host: str, returncode: int, stderr: str) -> str:
    """One line naming ``host`` and what went wrong, with ssh's own message (or the remote command's last
    stderr line when the command itself failed)."""
    message = _ssh_message(stderr)
    if returncode == SSH_CONNECTION_ERROR:
        return f"cannot reach host {host} over ssh: {message}"
    if returncode < 0:
        return f"ssh to host {host} was killed by signal {-returncode}: {message}"
    return f"command on host {host} exited with status {returncode}: {message}"


def probe(host: str, *, port: int | None = None, options: Sequence[str] = (), connect_timeout: float = 10) -> None:
    """Check that ``host`` accepts a non-interactive ssh login by running ``true`` there.

    Raises UsageError with one line naming the host and ssh's message if it does not (or ssh is missing).
    """
    argv = [*_ssh_base(port, options, connect_timeout), "--", host, "true"]
    try:
        done = subprocess.run(argv, stdin=subprocess.DEVNULL, capture_output=True, text=True,
                              timeout=connect_timeout + 30)
    except FileNotFoundError:
        raise UsageError(f"cannot reach host {host}: ssh is not installed here (install openssh-client)") from None
    except subprocess.TimeoutExpired:
        raise UsageError(f"cannot reach host {host} over ssh: no answer after {connect_timeout + 30:g} s") from None
    if done.returncode != 0:
        raise UsageError(describe_ssh_failure(host, done.returncode, done.stderr))
