"""A real HTTP server whose answers a test writes: what an etcd client meets when something else answers."""

from __future__ import annotations

import contextlib
import http.server
import threading
from collections.abc import Callable, Iterator

Answer = Callable[[http.server.BaseHTTPRequestHandler, bytes], None]
"""Writes the answer to one POST (status, headers, body) on the handler, given the request's body."""


@contextlib.contextmanager
def answering(answer: Answer) -> Iterator[int]:
    """Serve HTTP/1.1 on a loopback port, each POST answered by ``answer``, while the context lasts; the port."""
    class Handler(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_POST(self) -> None:  # noqa: N802 -- http.server's name
            answer(self, self.rfile.read(int(self.headers.get("Content-Length", 0))))

        def log_message(self, *args) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield server.server_address[1]
    finally:
        server.shutdown()
