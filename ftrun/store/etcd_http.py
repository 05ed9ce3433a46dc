"""One etcd member's HTTP/JSON gateway, through urllib3: the calls ftrun makes to it and its watch streams.

Every etcd since 3.3 serves its v3 API as JSON over HTTP on its client port (the grpc-gateway), so a client
needs neither gRPC nor generated protobuf code: a call is a POST of a JSON body to ``/v3/<path>``, bytes are
base64, and a watch is a POST whose answer streams one JSON line per event. urllib3 (the HTTP library under
requests) keeps the connections open from call to call, checks a kept one is still up before it reuses it,
and carries TLS (a CA, a client certificate and key). A call costs its caller 0.36-0.50 ms of CPU here, where
etcd3gw on requests, the client ftrun used first, spent 0.74-0.83 ms (500 keep-alives each, timed in one run
against one member): a thousand simulated agents' leases on two cores ended under the difference.
"""

from __future__ import annotations

import json
import socket
import ssl
from collections.abc import Iterator
from typing import Any, NamedTuple

import urllib3

from ftrun.store.etcd_config import EtcdRefused

MAX_LINE = 16 << 20
"""Bytes of one line of a watch stream past which it is not etcd's (an answer carries values of at most etcd's
request limit, 1.5 MiB by default, base64 in JSON)."""
UNAVAILABLE = frozenset({408, 503, 504})
"""HTTP statuses with which the gateway says the member cannot serve the call now (no leader, a leader changed,
a deadline passed): as a member that cannot be reached, the call goes to the next."""
REQUIRE_LEADER = {"Grpc-Metadata-hasleader": "true"}
"""Headers with which a watch asks its member to end it once the member has been without etcd's leader for three
election timeouts (etcd's require-leader metadata, ``hasleader``, as clientv3's ``WithRequireLeader`` sets it;
the gateway passes ``Grpc-Metadata-`` headers on as gRPC metadata). A member cut off from the others keeps a
plain watch open and silent, and a waiter on it would hear of nothing until its next read; this one ends, and
the waiter opens it again on a member that hears the writes."""
FIRST_ANSWER_TIMEOUT = 10.0
"""Seconds a member that has not yet answered a call has to answer one (at most; less where the client's
timeout is shorter): a service that accepts connections and never answers held a single-node job's start-up
for its whole store timeout, 300 s, deaf to SIGTERM; it now counts as a member that cannot be reached."""
KEPT_CONNECTIONS = 4
"""Connections a member's pool keeps open for its calls (more are opened while more calls run at once)."""


class Tls(NamedTuple):
    """How to reach a member over TLS: the CA to verify it with (None: the system's), and this client's
    certificate and key (None: none)."""

    ca_cert: str | None = None
    cert: str | None = None
    key: str | None = None


class Member:
    """One member's gateway at ``host:port`` (over TLS when ``tls`` is given); ``timeout`` bounds connecting
    and each read of a call (:data:`FIRST_ANSWER_TIMEOUT` until the member first answers). :attr:`headers` go
    with every call and stream (the auth token)."""

    def __init__(self, host: str, port: int, tls: Tls | None, timeout: float) -> None:
        self.host, self.port, self.tls = host, port, tls
        self.headers: dict[str, str] = {"Content-Type": "application/json"}
        self._pool = self._new_pool(KEPT_CONNECTIONS)
        first = min(timeout, FIRST_ANSWER_TIMEOUT)
        self._call_timeout = urllib3.Timeout(connect=first, read=first)  # until it first answers
        self._answered_timeout = urllib3.Timeout(connect=timeout, read=timeout)
        self._stream_timeout = urllib3.Timeout(connect=timeout, read=None)

    def _new_pool(self, size: int) -> urllib3.HTTPConnectionPool:
        if self.tls is None:
            return urllib3.HTTPConnectionPool(self.host, self.port, maxsize=size)
        return urllib3.HTTPSConnectionPool(self.host, self.port, maxsize=size, cert_reqs="CERT_REQUIRED",
                                           ca_certs=self.tls.ca_cert, cert_file=self.tls.cert,
                                           key_file=self.tls.key)

    def post(self, path: str, body: dict[str, Any]) -> Any:
        """POST ``body`` to ``/v3/<path>``: the answer's JSON. ConnectionError (naming what failed) when the
        member cannot be reached, its answer did not all come in time, or it cannot serve the call now
        (:data:`UNAVAILABLE`); EtcdRefused when it answered with another error; ValueError for an answer that is
        not JSON."""
        try:
            answer = self._pool.urlopen("POST", f"/v3/{path}", body=json.dumps(body).encode(), headers=self.headers,
                                        retries=False, redirect=False, decode_content=False,
                                        timeout=self._call_timeout)
        except (urllib3.exceptions.HTTPError, OSError) as exc:
            raise _unreached(exc) from None
        self._call_timeout = self._answered_timeout
        if answer.status in UNAVAILABLE:
            raise ConnectionError(f"HTTP {answer.status}")
        if answer.status != 200:
            raise EtcdRefused(answer.data[:1000].decode(errors="replace"))
        return json.loads(answer.data)

    def stream(self, path: str, body: dict[str, Any]) -> Stream:
        """POST ``body`` to ``/v3/<path>`` on a connection of its own and stream the answer (a watch, which ends
        when the member loses etcd's leader: :data:`REQUIRE_LEADER`); connecting is bounded by the member's
        timeout, reading is not. ConnectionError as :meth:`post`."""
        pool = self._new_pool(1)
        try:
            answer = pool.urlopen("POST", f"/v3/{path}", body=json.dumps(body).encode(),
                                  headers={**self.headers, **REQUIRE_LEADER}, retries=False, redirect=False,
                                  preload_content=False, decode_content=False,
                                  timeout=self._stream_timeout)
        except (urllib3.exceptions.HTTPError, OSError) as exc:
            pool.close()
            raise _unreached(exc) from None
        if answer.status != 200:
            answer.close()
            pool.close()
            raise ConnectionError(f"HTTP {answer.status}")
        return Stream(pool, answer)


def _unreached(exc: Exception) -> ConnectionError:
    """What a call that did not reach its member raises: the kind of failure, and a TLS failure's reason too (a
    key that is not the certificate's, a certificate the member's CA did not sign), since that is the fix."""
    if isinstance(exc, (urllib3.exceptions.SSLError, ssl.SSLError)):
        return ConnectionError(f"TLS: {str(exc)[:200]}")
    return ConnectionError(type(exc).__name__)


class Stream:
    """A streamed answer, read by one thread (:meth:`lines`) and closed by any (:meth:`close`)."""

    def __init__(self, pool: urllib3.HTTPConnectionPool, answer: urllib3.BaseHTTPResponse) -> None:
        self._pool, self._answer = pool, answer

    def lines(self) -> Iterator[bytes]:
        """The answer's non-empty lines, each as soon as the chunk that ends it comes (etcd's gateway sends each
        of a watch's answers as a line); ValueError for a line longer than :data:`MAX_LINE`."""
        pending: list[bytes] = []  # the start of a line whose end has not come yet
        size = 0
        for chunk in self._answer.read_chunked(decode_content=False):
            if b"\n" not in chunk:
                pending.append(chunk)
                size += len(chunk)
                if size > MAX_LINE:
                    raise ValueError(f"a watch's answer longer than {MAX_LINE} bytes is not etcd's")
                continue
            *lines, rest = b"".join([*pending, chunk]).split(b"\n")
            pending, size = [rest], len(rest)
            yield from (line for line in lines if line.strip())

    def close(self) -> None:
        """End the stream, unblocking its reader: shut down the stream's own socket under it, then close.

        The socket is the connection object's, never one made from the stream's file descriptor number: the
        reader thread may have closed that descriptor already, and its number may by now be another socket of
        this process's (a worker's, a store's), which a shutdown would cut.
        """
        sock = getattr(getattr(self._answer, "connection", None), "sock", None)
        if sock is not None:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:  # closed meanwhile
                pass
        try:
            self._answer.close()
        except (OSError, AttributeError, ValueError):  # the reader thread closed it under us (http.client is not
            pass  # thread-safe): it is closed either way, and the closing thread must not die of it
        self._pool.close()
