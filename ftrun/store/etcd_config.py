"""Where a job's etcd cluster is and how to reach it: the endpoints, TLS and authentication options that
``--rdzv-endpoint`` and ``--rdzv-conf`` give, and the ``etcd://`` URL that names a job's store in it.

Nothing here talks to etcd (:mod:`ftrun.store.etcd` does), so the command line checks these options without
importing the client library.
"""

from __future__ import annotations

import contextlib
import importlib.util
import ipaddress
import urllib.parse
from collections.abc import Iterator
from dataclasses import dataclass

from ftrun.errors import UsageError
from ftrun.paths import Unreadable, read_small_file
from ftrun.protocol import is_host_name

DEFAULT_PORT = 2379
"""etcd's client port, when an endpoint names none."""
KEY_ROOT = "/ftrun/"
"""Every job's keys are under ``/ftrun/<run id>/``."""


class EtcdUnavailable(RuntimeError):
    """No endpoint of the etcd cluster answered (or it refused the call)."""


class EtcdRefused(EtcdUnavailable):
    """A member answered a call with an error; the message is its answer (the first 1,000 bytes)."""


class EtcdUnreachable(EtcdUnavailable):
    """No endpoint of the etcd cluster could be reached at all: for a moment (a member lost, the others electing
    a leader, a loaded machine) or for good; a wait with time left tries again."""


@dataclass(frozen=True)
class EtcdOptions:
    """Where the cluster is and how to reach it: from ``--rdzv-endpoint`` and the ``--etcd-*`` options."""

    endpoints: tuple[tuple[str, int], ...]
    run_id: str
    ca_cert: str | None = None
    cert: str | None = None
    key: str | None = None
    user: str | None = None
    password_file: str | None = None
    https: bool = False

    @property
    def prefix(self) -> str:
        """The key prefix of this job."""
        return f"{KEY_ROOT}{self.run_id}/"

    def describe(self) -> str:
        """The endpoints as given, for messages."""
        return ",".join(f"[{host}]:{port}" if ":" in host else f"{host}:{port}" for host, port in self.endpoints)

    def url(self) -> str:
        """This job's store as ``ftrun status --endpoint`` and ``ftrun inject --endpoint`` take it:
        ``etcd://h1:2379,h2:2379/<run id>``, with ``?cacert=...&cert=...`` (paths, never a password)."""
        conf = {"protocol": "https" if self.https else None, "cacert": self.ca_cert, "cert": self.cert,
                "key": self.key, "user": self.user, "password_file": self.password_file}
        query = urllib.parse.urlencode({name: value for name, value in conf.items() if value})
        return f"{SCHEME}{self.describe()}/{self.run_id}" + (f"?{query}" if query else "")


def parse_endpoints(text: str) -> tuple[tuple[str, int], ...]:
    """``h1:2379,h2:2379,[::1]:2379`` (a missing port is 2379; an ``http://`` or ``https://`` scheme is
    allowed and dropped); UsageError when it is not such a list (another scheme, a user, a path, a host name that
    is none)."""
    endpoints = []
    for item in text.split(","):
        item = item.strip()
        for scheme in ("http://", "https://"):
            item = item.removeprefix(scheme)
        host, sep, port = item.rpartition(":")
        if not sep or host.endswith(":") or (host.count(":") and not host.startswith("[")):
            host, port = item, str(DEFAULT_PORT)
        if host.startswith("[") and host.endswith("]"):
            host = host[1:-1]
        if not _is_host(host) or not port.isascii() or not port.isdigit() or len(port) > 5 or not 0 < int(port) < 65536:
            raise UsageError(f"--rdzv-endpoint {text[:80]!r}: expected etcd endpoints HOST:PORT[,HOST:PORT...], "
                             "e.g. h1:2379,h2:2379,h3:2379")
        endpoints.append((host, int(port)))
    return tuple(endpoints)


def _is_host(host: str) -> bool:
    """Whether an endpoint's host (its brackets gone) is a host name, an IPv4 or an IPv6 address: a scheme other
    than http(s), a user or a path cannot reach a member."""
    if ":" not in host:
        return is_host_name(host)
    try:
        ipaddress.IPv6Address(host)
    except ValueError:
        return False
    return True


BACKENDS = ("etcd", "etcd-v2")
"""``--rdzv-backend`` values that select this backend (torchrun's two spellings)."""
CONF_KEYS = ("protocol", "cacert", "cert", "key", "user", "password_file")
"""The ``--rdzv-conf`` keys it reads: torchrun's etcd keys, and a user name with a file holding its password."""


CONF_FILE_LIMIT = 1 << 20
"""Bytes a certificate, key or password file may hold (a chain of certificates is a few kilobytes)."""


SCHEME = "etcd://"
"""How an etcd job's store is named where a TCPStore's is HOST:PORT (see :meth:`EtcdOptions.url`)."""


def parse_url(url: str) -> EtcdOptions:
    """The options of an ``etcd://`` store URL; UsageError when it is not one."""
    parsed = urllib.parse.urlsplit(url)
    run_id = parsed.path.strip("/")
    if not url.startswith(SCHEME) or not parsed.netloc or not run_id or "/" in run_id:
        raise UsageError(f"--endpoint {url[:80]!r}: expected etcd://HOST:PORT[,HOST:PORT...]/RUN_ID")
    conf = dict(urllib.parse.parse_qsl(parsed.query))
    unknown = set(conf) - set(CONF_KEYS)
    if unknown:
        raise UsageError(f"--endpoint {url[:80]!r}: unknown option {sorted(unknown)[0][:20]!r}")
    return etcd_options(parsed.netloc, run_id, conf)


def etcd_options(endpoints: str, run_id: str, conf: dict[str, str]) -> EtcdOptions:
    """The etcd backend's options from ``--rdzv-endpoint`` and ``--rdzv-conf``; UsageError for what cannot work
    (no client library, a file that cannot be read, a protocol that is neither http nor https)."""
    if importlib.util.find_spec("urllib3") is None:
        raise UsageError("--rdzv-backend etcd needs an HTTP client: pip install 'ftrun[etcd]' (urllib3)")
    protocol = conf.get("protocol", "http")
    if protocol not in ("http", "https"):
        raise UsageError(f"--rdzv-conf protocol={protocol[:20]!r}: use http or https")
    files = {name: conf.get(name) for name in ("cacert", "cert", "key", "password_file")}
    for name, path in files.items():
        if path is not None:
            try:  # read once here: a FIFO or a device there would hang or flood the TLS setup or the login later
                data = read_small_file(path, CONF_FILE_LIMIT)[0]
                if name == "password_file":
                    data.decode("utf-8")
            except (Unreadable, UnicodeDecodeError) as exc:
                why = "not UTF-8 text" if isinstance(exc, UnicodeDecodeError) else exc
                raise UsageError(f"--rdzv-conf {name}={path[:200]}: not a readable file ({why})") from None
    if bool(files["cert"]) != bool(files["key"]):
        raise UsageError("--rdzv-conf: a client certificate needs both cert= and key=")
    if files["password_file"] and not conf.get("user"):
        raise UsageError("--rdzv-conf password_file= needs user=")
    return EtcdOptions(parse_endpoints(endpoints), run_id, files["cacert"], files["cert"], files["key"],
                       conf.get("user"), files["password_file"], https=protocol == "https")


@contextlib.contextmanager
def answering(options: EtcdOptions | None) -> Iterator[None]:
    """Around a job's first calls to its store: an etcd cluster that does not answer is one line (UsageError)."""
    try:
        yield
    except EtcdUnavailable as exc:
        where = options.describe() if options is not None else "?"
        raise UsageError(f"the job's etcd at {where} (--rdzv-endpoint) does not answer: {exc}") from None
