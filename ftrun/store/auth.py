"""The run's secret, and the seal every value ftrun writes to the store carries.

A run's secret is drawn at launch (:func:`new_secret`) and handed to each agent in its hand-off (never on a
command line), or read from ``FTRUN_SECRET_FILE`` where the nodes of a job are started one by one. Every
value :class:`~ftrun.store.job.JobStore` writes is sealed: an HMAC-SHA256 of the key and the value under the
secret, as 64 hex digits, then the value. The key is part of what is signed, so a value copied to another key
(an old message to a new mailbox index, a plan to another generation) fails the check as a forged one does.

Workers never need the secret: their plans come from their own agent over their control channel.
"""

from __future__ import annotations

import hmac
import os
import secrets
import stat

from ftrun.errors import UsageError
from ftrun.paths import Unreadable, read_small_file

SECRET_FILE_VARIABLE = "FTRUN_SECRET_FILE"
"""Names the file holding a job's secret where no launcher hands one out (nodes started by a scheduler)."""
MIN_SECRET_LENGTH = 32
"""Characters a secret must have at least (``openssl rand -hex 16`` writes 32: 128 bits)."""
SECRET_FILE_LIMIT = 4096
"""Bytes a secret file may hold (a secret is a line of tens of characters)."""
MAC_LENGTH = 64
"""Hex digits of the HMAC-SHA256 in front of every sealed value."""


class MalformedValue(ValueError):
    """A value in the store that is not what ftrun wrote there: unsigned, forged, moved, or not a JSON object."""


def new_secret() -> str:
    """A fresh secret for one run: 256 random bits, as hex."""
    return secrets.token_hex(32)


def read_secret_file(path: str, what: str) -> str:
    """The secret in the file at ``path``; UsageError (naming ``what``, the flag or variable) when it is not a
    regular file (a directory; a FIFO, which is not waited on), cannot be read, is readable by other users, or
    is too short to be a secret."""
    try:
        data, mode = read_small_file(path, SECRET_FILE_LIMIT, follow=False)
    except Unreadable as exc:
        if str(exc) == "not a regular file":
            raise UsageError(f"{what} {path}: not a regular file; give the file that holds the run's secret") from None
        raise UsageError(f"{what} {path}: cannot read it ({exc})") from None
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise UsageError(f"{what} {path}: other users may read it (mode {stat.S_IMODE(mode):o}): chmod 600 it")
    try:
        secret = data.decode("ascii").strip()
    except UnicodeDecodeError:
        secret = ""
    if len(secret) < MIN_SECRET_LENGTH or not secret.isprintable():
        raise UsageError(f"{what} {path}: expected a secret of at least {MIN_SECRET_LENGTH} printable ASCII "
                         "characters, e.g. from `openssl rand -hex 32`")
    return secret


def write_secret_file(path: os.PathLike[str] | str, secret: str) -> None:
    """Write ``secret`` to a new file at ``path`` that only this user can read."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w", encoding="ascii") as file:
        os.fchmod(file.fileno(), 0o600)  # an existing file keeps its mode through O_CREAT
        file.write(secret + "\n")


class Seal:
    """Signs values for their key under a run's secret, and checks them."""

    def __init__(self, secret: str) -> None:
        if not secret:
            raise ValueError("a run's secret cannot be empty")
        self._key = secret.encode()

    def _mac(self, key: str, payload: bytes) -> bytes:
        return hmac.digest(self._key, key.encode() + b"\0" + payload, "sha256").hex().encode()  # C's one-shot

    def seal(self, key: str, payload: bytes) -> bytes:
        """``payload`` as stored under ``key``: its MAC, then itself."""
        return self._mac(key, payload) + payload

    def open(self, key: str, raw: bytes) -> bytes:
        """The payload of a value read under ``key``; MalformedValue unless this run sealed it for ``key``."""
        mac, payload = bytes(raw[:MAC_LENGTH]), bytes(raw[MAC_LENGTH:])
        if len(mac) < MAC_LENGTH or not hmac.compare_digest(mac, self._mac(key, payload)):
            raise MalformedValue(f"{key}: not signed with this run's secret")
        return payload


def secret_for_endpoint(secret_file: str | None, endpoint: str) -> str:
    """The secret of the job at ``endpoint``, named with ``--endpoint``: from ``--secret-file``, else from the
    file ``FTRUN_SECRET_FILE`` names; UsageError when neither is given."""
    path = secret_file or os.environ.get(SECRET_FILE_VARIABLE)
    if not path:
        raise UsageError(f"the job at {endpoint} signs its store with its secret: pass --secret-file FILE (the "
                         f"file `secret` in its run directory on its first node, or the {SECRET_FILE_VARIABLE} "
                         "its nodes were given)")
    return read_secret_file(path, "--secret-file" if secret_file else SECRET_FILE_VARIABLE)
