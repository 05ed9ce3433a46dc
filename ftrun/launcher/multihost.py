"""`ftrun --hostfile FILE script.py`: host the store here and start one agent per host.

Each host's agent is ``python -m ftrun _agent``, given its part of the job as a hand-off
(:mod:`ftrun.launcher.handoff`), started directly on this machine or over ssh elsewhere. Their output comes
back through pipes and is passed on line by line (each line already carries its host and rank). When an agent other than node
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

from ftrun import open_files, protocol, registry
from ftrun.config import Endpoint, LaunchConfig
from ftrun.console import Console
from ftrun.errors import EXIT_SIGNAL_BASE, EXIT_WORKERS_FAILED, UsageError
from ftrun.launcher import handoff, ssh
from ftrun.launcher.hosts import Host, is_local
from ftrun.lines import LineBuffer
from ftrun.processes import SignalWake, die_with_parent, signal_name
from ftrun.store import keys
from ftrun.store.auth import Seal
from ftrun.store.etcd import EtcdKeyValue
from ftrun.store.host import StoreHost
from ftrun.store.job import JobStore
from ftrun.store.mailbox import Outbox


SETTLE_TIMEOUT = 10.0
"""Seconds the other agents have to end by themselves once node 0's ended well (it told them how the job
ended before it did): stopping them at once cut their last words short, and printed each as killed."""


@dataclass
class AgentProcess:
    """One host's agent, as seen from the launcher."""

    node: int
    host: Host
    local: bool
    proc: subprocess.Popen
    stderr_tail: deque[str] = field(default_factory=lambda: deque(maxlen=20))
    lines: dict[int, LineBuffer] = field(default_factory=dict)  # per pipe still open
    exitcode: int | None = None
    ended_at: float = 0.0  # wall clock, when the launcher saw it end
    dropped: bool = False  # its ssh session was ended by this launcher: the leader had declared the node lost


class HostLauncher:
    """Runs a multi-host job from this machine: the store, one agent per host, their output, their end."""

    def __init__(self, config: LaunchConfig, console: Console) -> None:
        self.config = config
        self.console = console
        self.hosts = config.hosts or []
        self.run_name = f"{config.run_id}_{uuid.uuid4().hex[:8]}"
        self.run_dir = (config.log_dir or registry.default_runs_root()) / self.run_name
        self.selector = selectors.DefaultSelector()
        self.agents: list[AgentProcess] = []
        self.store: JobStore | None = None
        self.outbox: Outbox | None = None  # the launcher's messages to the leader (a node's agent ended)

    def run(self) -> int:
        """Launch, relay output until node 0's agent ends (with etcd: every agent), stop the rest; the job's
        exit code."""
        open_files.allow(len(self.hosts), open_files.PER_HOST, f"{len(self.hosts)} hosts")
        self._probe()
        config = self.config
        etcd = config.etcd
        store_host = StoreHost(config.store, config.store_listen) if etcd is None else None
        # with etcd, node 0's agent serves the process groups' store (the others learn its port in etcd)
        store = config.store if store_host is None else Endpoint(config.master_addr, store_host.port)
        for node, host in enumerate(self.hosts):
            self._start_agent(node, host, store)
        entry = registry.register(registry.new_entry(self.run_name, config.run_id, config.master_addr, store.port,
                                                     self.run_dir, config.secret, etcd.url() if etcd else None))
        try:
            with SignalWake((signal.SIGINT, signal.SIGTERM, signal.SIGHUP)) as wake:
                self.selector.register(wake.fd, selectors.EVENT_READ, None)
                kv = store_host.start() if store_host is not None else EtcdKeyValue(etcd)
                self.store = JobStore(kv, Seal(config.secret))
                self.outbox = Outbox(self.store, keys.LAUNCHER)
                return self._relay(wake)
        finally:
            registry.unregister(entry)

    def _probe(self) -> None:
        """Fail fast, naming the host and ssh's own words, when a remote host cannot be reached."""
        remote_hosts = [h.name for h in self.hosts if not is_local(h.name)]
        with ThreadPoolExecutor(max_workers=max(1, min(16, len(remote_hosts)))) as pool:
            for error in pool.map(_probe_error, remote_hosts):
                if error:
                    raise UsageError(error)

    def _start_agent(self, node: int, host: Host, store: Endpoint) -> None:
        """Start ``host``'s agent, handing it its part of the job (over ssh: with the forwarded variables)."""
        config = handoff.agent_config(self.config, node_rank=node, node_name=host.name, store=store,
                                      run_name=self.run_name)
        line = handoff.encode(config)
        argv = [sys.executable, "-m", "ftrun", "_agent"]
        local = is_local(host.name)
        if local:
            proc = subprocess.Popen(argv, env={**os.environ, handoff.VARIABLE: line}, stdin=subprocess.DEVNULL,
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True,
                                    preexec_fn=die_with_parent)
        else:
            command = ssh.ssh_argv(host.name, argv, os.getcwd(), options=ssh.ssh_options(os.environ))
            # the remote agent lives as long as ssh's stdin stays open: closing it stops the agent (SIGTERM)
            proc = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                    start_new_session=True, preexec_fn=die_with_parent)
            proc.stdin.write(ssh.environment_preamble({**ssh.forwarded_env(os.environ), handoff.VARIABLE: line}))
            proc.stdin.flush()
        agent = AgentProcess(node, host, local, proc)
        self.agents.append(agent)
        for pipe, out in ((proc.stdout, sys.stdout.buffer), (proc.stderr, sys.stderr.buffer)):
            os.set_blocking(pipe.fileno(), False)
            agent.lines[pipe.fileno()] = LineBuffer()
            self.selector.register(pipe, selectors.EVENT_READ, (agent, out))

    def _relay(self, wake: SignalWake) -> int:
        stopping: float | None = None  # the agents were told to stop: they are killed at this monotonic time
        settling: float | None = None  # node 0 ended well: the others, told so, end by themselves until then
        interrupted: int | None = None
        while any(a.exitcode is None for a in self.agents):
            for key, _ in self.selector.select(0.5):
                if key.data is None:
                    interrupted = interrupted or self._signalled(wake)
                    stopping = stopping or self._stop_agents(interrupted or signal.SIGTERM)
                else:
                    self._pass_on(key.fileobj, *key.data)
            for agent in self.agents:
                if agent.exitcode is None and agent.proc.poll() is not None and not agent.lines:
                    agent.exitcode, agent.ended_at = agent.proc.returncode, time.time()
                    if not self._agent_ended(agent, stopping is not None or agent.dropped):
                        continue
                    if agent.exitcode == 0 and stopping is None:
                        settling = settling or time.monotonic() + SETTLE_TIMEOUT
                        self._drop_lost_nodes()
                    else:
                        stopping = stopping or self._stop_agents()
            if settling is not None and stopping is None and time.monotonic() > settling:
                stopping = self._stop_agents()
            if stopping is not None and time.monotonic() > stopping:
                for agent in self.agents:
                    if agent.exitcode is None:
                        agent.proc.kill()
                stopping = time.monotonic() + 3600
        if interrupted is not None:
            return EXIT_SIGNAL_BASE + interrupted
        return job_exit_code([a.exitcode for a in self.agents], self.config.etcd is not None)

    def _pass_on(self, pipe, agent: AgentProcess, out) -> None:
        """Copy complete lines of an agent's output; keep its last stderr lines for a failure report."""
        fd = pipe.fileno()
        try:
            data = os.read(fd, 65536)
        except BlockingIOError:
            return
        if not data:
            self.selector.unregister(pipe)
            rest = agent.lines.pop(fd).rest()
            data = rest + b"\n" if rest else b""
        else:
            data = b"".join(line + b"\n" for line in agent.lines[fd].feed(data))
        if data:
            out.write(data)
            out.flush()
            if out is sys.stderr.buffer:
                agent.stderr_tail.extend(data.decode(errors="replace").splitlines())

    def _agent_ended(self, agent: AgentProcess, stopped: bool) -> bool:
        """Record an agent's end; True when the whole job must stop: node 0's agent ended, but with etcd,
        where another node is elected leader when node 0 is lost, only once it ended well (the others follow).
        An agent that ends badly is news for the leader (said here too, unless ``stopped``: this launcher
        stopped it), which then need not wait for its lease to run out."""
        if agent.node == 0 and (self.config.etcd is None or agent.exitcode == 0):
            return True
        if agent.exitcode != 0:
            why = f"the agent on {agent.host.name} ended: {self._why(agent)}"
            if not stopped:
                self.console.notice(f"ftrun: node {agent.node}: {why}", style="bold yellow")
            self.outbox.send(keys.LEADER_BOX, {"t": protocol.NODE_GONE, "node": agent.node, "reason": why,
                                               "since": agent.ended_at})
        return False

    def _why(self, agent: AgentProcess) -> str:
        code = agent.exitcode
        if not agent.local and code == 255:
            return ssh.describe_ssh_failure(agent.host.name, code, "\n".join(agent.stderr_tail))
        if code is not None and code < 0:
            return f"killed by {signal_name(-code)}"
        last = agent.stderr_tail[-1] if agent.stderr_tail else ""
        return f"exit code {code}" + (f" ({last.strip()})" if last.strip() else "")

    def _signalled(self, wake: SignalWake) -> int | None:
        received = wake.received()
        if received:
            self.console.notice(f"ftrun: received {signal_name(received[0])}, stopping every agent")
            return received[0]
        return None

    def _drop_lost_nodes(self) -> None:
        """End the ssh sessions of the nodes the leader declared lost, at once: such a session may hang on a dead
        link until ssh gives up (the node fenced itself, or is gone). Done as node 0 ends well too, not once
        the others' settling time is over."""
        for agent in self.agents:
            if agent.exitcode is None and not agent.local and not agent.dropped and self._declared_lost(agent.node):
                agent.dropped = True
                agent.proc.kill()

    def _declared_lost(self, node: int) -> bool:
        """Whether the leader declared ``node`` lost; not where the store does not answer (etcd down at the
        end of a job, say): that node's session is then ended as any other's."""
        try:
            return self.store.is_evicted(node)
        except RuntimeError:
            return False

    def _stop_agents(self, sig: int = signal.SIGTERM) -> float:
        """Send ``sig`` (the one this launcher received, else SIGTERM) to every agent still running on this
        machine; over ssh, close ssh's stdin, and the remote side sends SIGTERM (a lost node's session ends
        at once: :meth:`_drop_lost_nodes`)."""
        self._drop_lost_nodes()
        for agent in self.agents:
            if agent.exitcode is not None or agent.dropped:
                continue
            if agent.local:
                try:
                    os.killpg(agent.proc.pid, sig)
                except ProcessLookupError:
                    pass
            elif not agent.proc.stdin.closed:
                agent.proc.stdin.close()
        return time.monotonic() + self.config.shutdown_timeout + 5


def job_exit_code(codes: list[int | None], failover: bool) -> int:
    """The launch's exit code from its agents' (by node): node 0's, the leader's; with leader failover
    (etcd), 0 when any agent succeeded (each ends with the leader's verdict: 0 only when the job succeeded),
    else node 0's. A signal's death is EXIT_WORKERS_FAILED."""
    code = 0 if failover and 0 in codes else codes[0]
    return code if code is not None and code >= 0 else EXIT_WORKERS_FAILED


def _probe_error(host: str) -> str | None:
    try:
        ssh.probe(host, options=ssh.ssh_options(os.environ))
    except UsageError as error:
        return str(error)
    return None
