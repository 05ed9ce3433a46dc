"""A member's HTTP/JSON gateway as ftrun calls it: what each kind of answer becomes, against a real HTTP server."""

from __future__ import annotations

import contextlib
import http.server
import json
import socket
import subprocess
import sys
from collections.abc import Iterator

import pytest

from http_answers import answering
from ftrun.store.etcd_config import EtcdRefused
from ftrun.store.etcd_http import Member


@pytest.fixture(scope="module")
def gateway() -> Iterator[tuple[int, list[dict]]]:
    """A real HTTP server answering each POST with the status and body its path names (``/v3/<status>/<kind>``),
    and the requests it took (path, headers, body)."""
    taken: list[dict] = []
    bodies = {"json": b'{"header": {"revision": "3"}, "kvs": []}', "html": b"<html>busy</html>",
              "error": b'{"error": "etcdserver: leader changed", "code": 14}'}

    def answer(handler: http.server.BaseHTTPRequestHandler, body: bytes) -> None:
        taken.append({"path": handler.path, "auth": handler.headers.get("Authorization"), "body": json.loads(body)})
        _, _, status, kind = handler.path.split("/")
        handler.send_response(int(status))
        handler.send_header("Content-Length", str(len(bodies[kind])))
        handler.end_headers()
        handler.wfile.write(bodies[kind])

    with answering(answer) as port:
        yield port, taken


@pytest.mark.fast
@pytest.mark.parametrize("path, raised, message", [
    ("503/error", ConnectionError, "HTTP 503"),  # no leader, or a leader changed: the next member is asked
    ("504/error", ConnectionError, "HTTP 504"),
    ("408/error", ConnectionError, "HTTP 408"),
    ("400/error", EtcdRefused, "leader changed"),  # any other error is etcd's word, carried whole
    ("200/html", ValueError, None),  # not JSON: not a gateway's answer
])
def test_an_answer_is_json_a_refusal_or_a_member_that_cannot_serve_now(gateway, path, raised, message):
    # 408, 503 and 504 say the member cannot serve the call now: a client that takes them for a
    # refusal fails the job when one member of three dies (its leader changes under a call)
    port, taken = gateway
    member = Member("127.0.0.1", port, None, 5.0)
    member.headers["Authorization"] = "token-1"
    assert member.post("200/json", {"key": "a2V5"}) == {"header": {"revision": "3"}, "kvs": []}
    with pytest.raises(raised, match=message):
        member.post(path, {})
    assert taken[-2] == {"path": "/v3/200/json", "auth": "token-1", "body": {"key": "a2V5"}}


@pytest.mark.fast
def test_a_member_that_does_not_listen_is_a_connection_error():
    with socket_bound() as port:  # bound, never listening: every connection is refused
        with pytest.raises(ConnectionError, match="NewConnectionError"):
            Member("127.0.0.1", port, None, 5.0).post("kv/range", {})
        with pytest.raises(ConnectionError, match="NewConnectionError"):
            Member("127.0.0.1", port, None, 5.0).stream("watch", {})


@pytest.mark.fast
def test_a_member_that_accepts_and_never_answers_is_a_connection_error_within_the_first_answer_bound(monkeypatch):
    """A service that accepts and says nothing (not etcd, or a member stuck) is not waited on for the client's
    whole timeout: with 300 s, a single-node job's start-up sat there, deaf to SIGTERM."""
    from ftrun.store import etcd_http

    monkeypatch.setattr(etcd_http, "FIRST_ANSWER_TIMEOUT", 0.5)
    with socket.create_server(("127.0.0.1", 0)) as silent:  # the kernel accepts; nobody ever reads or writes
        with pytest.raises(ConnectionError, match="ReadTimeoutError"):
            Member("127.0.0.1", silent.getsockname()[1], None, 300.0).post("kv/range", {})


@contextlib.contextmanager
def socket_bound() -> Iterator[int]:
    """A port bound on the loopback address and never listened on, while the context lasts."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        yield sock.getsockname()[1]


@pytest.mark.fast
def test_ftrun_imports_no_http_client_until_a_job_uses_etcd():
    # urllib3 comes with the etcd extra: a job on the embedded store must start without it
    probe = ("import sys; import ftrun.cli, ftrun.agent.store_access, ftrun.launcher.multihost, ftrun.store.etcd; "
             "print('urllib3' in sys.modules)")
    found = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert found.stdout.strip() == "False", found.stderr
