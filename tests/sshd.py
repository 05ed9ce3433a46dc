"""A real OpenSSH server for tests: host and client keys made for the test, one sshd per address.

``Keys.make(directory)`` creates an ed25519 host key, a client key and the authorized_keys file;
``Sshd.start(keys, address, port)`` runs ``sshd -D -e`` on that address (inside a network namespace when
given a command prefix such as ``ip netns exec NAME``) and returns once sshd says it is listening.
"""

from __future__ import annotations

import shutil
import subprocess
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

SSHD = "/usr/sbin/sshd"
PRIVSEP_DIR = Path("/run/sshd")
"""sshd refuses to start without its privilege separation directory (the Debian package creates it at boot)."""


def missing_tools() -> str | None:
    """Why a real sshd cannot run here, or None when it can."""
    for tool in (SSHD, "ssh", "ssh-keygen"):
        if not shutil.which(tool):
            return f"{tool} is not installed (openssh-server provides it; .ci/run installs it)"
    return None


@dataclass(frozen=True)
class Keys:
    """Key files for one test session: the server's host key and a client key it accepts."""

    directory: Path

    @property
    def host_key(self) -> Path:
        return self.directory / "host_ed25519"

    @property
    def client_key(self) -> Path:
        return self.directory / "client_ed25519"

    @property
    def authorized_keys(self) -> Path:
        return self.directory / "authorized_keys"

    @classmethod
    def make(cls, directory: Path) -> Keys:
        """Generate both keys in ``directory`` and authorize the client key."""
        keys = cls(directory)
        for key in (keys.host_key, keys.client_key):
            subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "ftrun-test", "-f", str(key)],
                           check=True, stdin=subprocess.DEVNULL)
        shutil.copyfile(keys.client_key.with_suffix(".pub"), keys.authorized_keys)
        return keys

    def client_options(self, identity: Path | None = None) -> list[str]:
        """ssh client options that log in with the client key (or ``identity``) and ignore the user's ssh
        config and known hosts."""
        return ["-F", "/dev/null", "-i", str(identity or self.client_key), "-o", "IdentitiesOnly=yes",
                "-o", "StrictHostKeyChecking=no", "-o", "UserKnownHostsFile=/dev/null", "-o", "LogLevel=ERROR"]


@dataclass
class Sshd:
    """A running ``sshd -D -e``; ``stop()`` ends it. Its log lines are kept in ``log`` for failure messages."""

    address: str
    port: int
    keys: Keys
    process: subprocess.Popen
    log: list[str] = field(default_factory=list)

    @property
    def ssh_options(self) -> list[str]:
        """Client options for this server, its port included."""
        return [*self.keys.client_options(), "-p", str(self.port)]

    @classmethod
    def start(cls, keys: Keys, address: str, port: int, prefix: Sequence[str] = (), timeout: float = 10) -> Sshd:
        """Start sshd on ``address:port`` (run through ``prefix``, e.g. ``ip netns exec NAME``) and return once
        it logs "Server listening"; raise RuntimeError with its log if it exits or stays silent instead."""
        PRIVSEP_DIR.mkdir(mode=0o755, exist_ok=True)
        config = keys.directory / f"sshd_{address}_{port}.conf"
        config.write_text(_CONFIG.format(address=address, port=port, host_key=keys.host_key,
                                         authorized_keys=keys.authorized_keys))
        process = subprocess.Popen([*prefix, SSHD, "-D", "-e", "-f", str(config)], stdin=subprocess.DEVNULL,
                                   stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        sshd = cls(address, port, keys, process)
        listening = threading.Event()
        threading.Thread(target=sshd._read_log, args=(listening,), daemon=True).start()
        if not listening.wait(timeout) or process.poll() is not None:
            sshd.stop()
            raise RuntimeError(f"sshd on {address}:{port} did not start: " + " | ".join(sshd.log))
        return sshd

    def _read_log(self, listening: threading.Event) -> None:
        """Collect sshd's stderr; set ``listening`` at its "Server listening" line or when it ends."""
        for line in self.process.stderr:
            self.log.append(line.rstrip())
            if line.startswith("Server listening on"):
                listening.set()
        listening.set()

    def stop(self) -> None:
        """Stop the listener. Sessions already open end with their connections."""
        if self.process.poll() is None:
            self.process.terminate()
        self.process.wait(timeout=10)


_CONFIG = """\
ListenAddress {address}
Port {port}
HostKey {host_key}
AuthorizedKeysFile {authorized_keys}
PermitRootLogin prohibit-password
PasswordAuthentication no
KbdInteractiveAuthentication no
StrictModes no
UsePAM no
PidFile none
PrintMotd no
X11Forwarding no
"""
