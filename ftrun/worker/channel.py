"""The worker's end of its control channel to the node agent (a socket inherited as FTRUN_CHANNEL_FD)."""

from __future__ import annotations

import json
import socket
import threading
from collections.abc import Callable
from typing import Any

from ftrun.lines import LineBuffer
from ftrun.protocol import encode


class AgentChannel:
    """Sends control messages to the agent and hands every message it sends back to ``on_message``.

    Reading happens on a daemon thread that blocks on the socket, so a worker learns of a new generation
    the moment the agent writes it -- no polling of the store on the step path.
    """

    def __init__(self, fd: int, on_message: Callable[[dict[str, Any]], None]) -> None:
        self.sock = socket.socket(fileno=fd)
        self.sock.setblocking(True)
        self._send_lock = threading.Lock()
        self._on_message = on_message
        self._reader = threading.Thread(target=self._read_forever, name="ftrun-channel", daemon=True)
        self._reader.start()

    def send(self, kind: str, **fields: Any) -> None:
        """Send one message; a vanished agent is ignored (the worker is about to be stopped anyway)."""
        data = encode(kind, **fields)
        with self._send_lock:
            try:
                self.sock.sendall(data)
            except OSError:
                pass

    def _read_forever(self) -> None:
        lines = LineBuffer()
        while True:
            try:
                data = self.sock.recv(65536)
            except OSError:
                return
            if not data:
                return
            for line in lines.feed(data):
                if line:
                    self._on_message(json.loads(line))
