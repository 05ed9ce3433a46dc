"""Splitting a byte stream into lines as chunks of it arrive (pipes, sockets, a file being appended to)."""

from __future__ import annotations


class LineBuffer:
    """Collects chunks and hands back each complete line once; the unfinished tail waits for the next chunk."""

    def __init__(self) -> None:
        self.partial = b""

    def feed(self, data: bytes) -> list[bytes]:
        """The lines completed by ``data``, without their newlines."""
        *lines, self.partial = (self.partial + data).split(b"\n")
        return lines

    def rest(self) -> bytes:
        """At the end of the stream: the unfinished last line (empty when the stream ended with a newline)."""
        rest, self.partial = self.partial, b""
        return rest
