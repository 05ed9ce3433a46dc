"""`ftrun --hostfile FILE script.py`: host the store here and start one agent per host.

Each host's agent is `ftrun` itself in scheduler mode (`--nnodes N --node-rank I --rdzv-endpoint ...`),
started directly on this machine or over ssh elsewhere. Their output comes back through pipes and is
passed on line by line (each line already carries its host and rank). When an agent other than node
0's ends badly, the leader is told at once, without waiting for the node's lease to expire. On Ctrl-C or
when node 0's agent ends, every agent is stopped; no process outlives the launch on any host.
"""

from __future__ import annotations

import os
import selectors
import signal
import subprocess
import sys
import time
import uuid
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from ftrun import control, registry
from ftrun.agent import remote
from ftrun.agent.cluster import LEADER_BOX, evicted_key
from ftrun.agent.output import Console2
from ftrun.agent.workers import die_with_parent
from ftrun.config import LaunchConfig
from ftrun.errors import EXIT_SIGNAL_BASE, EXIT_WORKERS_FAILED, UsageError
from ftrun.hostfile import Host
from ftrun.store import StoreHost

# flags the launcher sets per agent itself (with how many values each takes)
_OWN_FLAGS = {"--hostfile": 1, "-H": 1, "--hosts": 1, "--nproc-per-node": 1, "--nproc_per_node": 1,
              "--nnodes": 1, "--node-rank": 1, "--node_rank": 1, "--rdzv-endpoint": 1, "--rdzv_endpoint": 1,
              "--master-addr": 1, "--master_addr": 1, "--master-port": 1, "--master_port": 1,
              "--rdzv-id": 1, "--rdzv_id": 1, "--standalone": 0}


def agent_flags(launcher_args: list[str]) -> list[str]:
    """The user's flags to pass on to every agent: all but those the launcher sets per agent."""
    kept: list[str] = []
    skip = 0
    for arg in launcher_args:
        if skip:
            skip -= 1
            continue
        name = arg.split("=", 1)[0]
        if name in _OWN_FLAGS:
            skip = 0 if "=" in arg else _OWN_FLAGS[name]
            continue
        kept.append(arg)
    return kept


@dataclass
class AgentProcess:
    """One host's agent, as seen from the launcher."""

    node: int
    host: Host
    local: bool
    proc: subprocess.Popen
    stderr_tail: deque[str] = field(default_factory=lambda: deque(maxlen=20))
    buffers: dict[int, bytes] = field(default_factory=dict)  # partial last line, per pipe still open
    exitcode: int | None = None
    ended_at: float = 0.0  # wall clock, when the launcher saw it end


class HostLauncher:
    """Runs a multi-host job from this machine: the store, one agent per host, their output, their end."""

    def __init__(self, config: LaunchConfig, console: Console2) -> None:
        self.config = config
        self.console = console
        self.hosts = config.hosts or []
        self.run_name = f"{config.run_id}_{uuid.uuid4().hex[:8]}"
        self.run_dir = (config.log_dir or registry.default_runs_root()) / self.run_name
        self.selector = selectors.DefaultSelector()
        self.agents: list[AgentProcess] = []
        self.store = None

    def run(self) -> int:
        """Launch, relay output until node 0's agent ends, stop the rest; node 0's exit code."""
        self._probe()
        store_host = StoreHost(self.config.store)
        for node, host in enumerate(self.hosts):
            self._start_agent(node, host, store_host.port)
        wake_r, wake_w = os.pipe()
        os.set_blocking(wake_r, False)
        os.set_blocking(wake_w, False)
        previous_wakeup = signal.set_wakeup_fd(wake_w)
        previous = {sig: signal.signal(sig, lambda *_: None) for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
        self.selector.register(wake_r, selectors.EVENT_READ, None)
        entry = registry.register(registry.new_entry(self.run_name, self.config.run_id, self.config.master_addr,
                                                     store_host.port, self.run_dir))
        try:
            self.store = store_host.start()
            return self._relay(wake_r)
        finally:
            registry.unregister(entry)
            signal.set_wakeup_fd(previous_wakeup)
            for sig, handler in previous.items():
                signal.signal(sig, handler)
            os.close(wake_r)
            os.close(wake_w)

    def _probe(self) -> None:
        """Fail fast, naming the host and ssh's own words, when a remote host cannot be reached."""
        remote_hosts = [h.name for h in self.hosts if not remote.is_local(h.name)]
        with ThreadPoolExecutor(max_workers=max(1, min(16, len(remote_hosts)))) as pool:
            for error in pool.map(_probe_error, remote_hosts):
                if error:
                    raise UsageError(error)

    def _start_agent(self, node: int, host: Host, port: int) -> None:
        config = self.config
        argv = [sys.executable, "-m", "ftrun", *agent_flags(config.launcher_args),
                "--nnodes", str(len(self.hosts)), "--node-rank", str(node),
                "--rdzv-endpoint", f"{config.master_addr}:{port}", "--rdzv-id", config.run_id,
                "--nproc-per-node", str(config.sizes[node]), config.script, *config.script_args]
        ours = {"FTRUN_NODE_SIZES": ",".join(map(str, config.sizes)), "FTRUN_NODE_NAME": host.name,
                "FTRUN_UNDER_LAUNCHER": "1", "FTRUN_RUN_NAME": self.run_name}
        local = remote.is_local(host.name)
        if local:
            proc = subprocess.Popen(argv, env={**os.environ, **ours}, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, start_new_session=True, preexec_fn=die_with_parent)
        else:
            command = remote.ssh_argv(host.name, argv, {**remote.forwarded_env(os.environ), **ours}, os.getcwd(),
                                      options=remote.ssh_options(os.environ))
            # the remote agent lives as long as ssh's stdin stays open: closing it stops the agent (SIGTERM)
            proc = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                    start_new_session=True, preexec_fn=die_with_parent)
        agent = AgentProcess(node, host, local, proc)
        self.agents.append(agent)
        for pipe, out in ((proc.stdout, sys.stdout.buffer), (proc.stderr, sys.stderr.buffer)):
            os.set_blocking(pipe.fileno(), False)
            agent.buffers[pipe.fileno()] = b""
            self.selector.register(pipe, selectors.EVENT_READ, (agent, out))

    def _relay(self, wake_r: int) -> int:
        stopping: float | None = None
        interrupted: int | None = None
        while any(a.exitcode is None for a in self.agents):
            for key, _ in self.selector.select(0.5):
                if key.data is None:
                    interrupted = interrupted or self._signalled(wake_r)
                    stopping = stopping or self._stop_agents()
                else:
                    self._pass_on(key.fileobj, *key.data)
            for agent in self.agents:
                if agent.exitcode is None and agent.proc.poll() is not None and not agent.buffers:
                    agent.exitcode, agent.ended_at = agent.proc.returncode, time.time()
                    if self._agent_ended(agent):
                        stopping = stopping or self._stop_agents()
            if stopping is not None and time.monotonic() > stopping:
                for agent in self.agents:
                    if agent.exitcode is None:
                        agent.proc.kill()
                stopping = time.monotonic() + 3600
        if interrupted is not None:
            return EXIT_SIGNAL_BASE + interrupted
        leader = self.agents[0].exitcode
        return leader if leader is not None and leader >= 0 else EXIT_WORKERS_FAILED

    def _pass_on(self, pipe, agent: AgentProcess, out) -> None:
        """Copy complete lines of an agent's output; keep its last stderr lines for a failure report."""
        fd = pipe.fileno()
        try:
            data = os.read(fd, 65536)
        except BlockingIOError:
            return
        if not data:
            self.selector.unregister(pipe)
            rest = agent.buffers.pop(fd)
            data = rest + b"\n" if rest else b""
        else:
            *lines, agent.buffers[fd] = (agent.buffers[fd] + data).split(b"\n")
            data = b"".join(line + b"\n" for line in lines)
        if data:
            out.write(data)
            out.flush()
            if out is sys.stderr.buffer:
                agent.stderr_tail.extend(data.decode(errors="replace").splitlines())

    def _agent_ended(self, agent: AgentProcess) -> bool:
        """Record an agent's end; True when the whole job must stop (node 0's agent ended)."""
        if agent.node == 0:
            return True
        if agent.exitcode != 0:
            why = f"the agent on {agent.host.name} ended: {self._why(agent)}"
            self.console.notice(f"ftrun: node {agent.node}: {why}", style="bold yellow")
            control.post(self.store, LEADER_BOX, {"t": "node_gone", "node": agent.node, "reason": why,
                                                  "since": agent.ended_at})
        return False

    def _why(self, agent: AgentProcess) -> str:
        code = agent.exitcode
        if not agent.local and code == 255:
            return remote.describe_ssh_failure(agent.host.name, code, "\n".join(agent.stderr_tail))
        if code is not None and code < 0:
            return f"killed by {signal.Signals(-code).name}"
        last = agent.stderr_tail[-1] if agent.stderr_tail else ""
        return f"exit code {code}" + (f" ({last.strip()})" if last.strip() else "")

    def _signalled(self, wake_r: int) -> int | None:
        try:
            received = os.read(wake_r, 64)
        except BlockingIOError:
            return None
        if received:
            self.console.notice(f"ftrun: received {signal.Signals(received[0]).name}, stopping every agent")
            return received[0]
        return None

    def _stop_agents(self) -> float:
        """SIGTERM every agent still running (over ssh: close ssh's stdin, and the remote side sends it).

        The ssh session of a node the leader declared lost may hang on a dead link until ssh gives up: it
        is ended at once (that node has fenced itself, or is gone).
        """
        for agent in self.agents:
            if agent.exitcode is not None:
                continue
            if agent.local:
                try:
                    os.killpg(agent.proc.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
            elif self.store.check([evicted_key(agent.node)]):
                agent.proc.kill()
            elif not agent.proc.stdin.closed:
                agent.proc.stdin.close()
        return time.monotonic() + self.config.shutdown_timeout + 5


def _probe_error(host: str) -> str | None:
    try:
        remote.probe(host, options=remote.ssh_options(os.environ))
    except UsageError as error:
        return str(error)
    return None
