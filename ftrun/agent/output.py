"""Worker output: each line prefixed with its worker's rank on the console, and kept in torchrun's log layout."""

from __future__ import annotations

import socket
from collections import deque
from pathlib import Path
from string import Template
from typing import IO

from ftrun.console import STDERR, STDOUT, Console
from ftrun.lines import LineBuffer

_COLOURS = ["cyan", "magenta", "green", "yellow", "blue", "red", "bright_cyan", "bright_magenta"]
TAIL_LINES = 200


def render_prefix(template: str, role: str, rank: int, local_rank: int, hostname: str | None = None) -> str:
    """Expand torchrun's prefix macros: ${role_name}, ${rank}, ${local_rank}, ${hostname}."""
    return Template(template).safe_substitute(
        role_name=role, rank=rank, local_rank=local_rank, hostname=hostname or socket.gethostname()
    )


class WorkerOutput:
    """Splits one worker's two streams into lines and routes each line to the console and its log file."""

    def __init__(
        self,
        console: Console,
        prefix: str,
        rank: int,
        to_console: int,
        log_dir: Path | None,
    ) -> None:
        self.console = console
        self.prefix = prefix
        self.colour = _COLOURS[rank % len(_COLOURS)]
        self.to_console = to_console
        self.lines = {STDOUT: LineBuffer(), STDERR: LineBuffer()}
        self.stderr_tail: deque[str] = deque(maxlen=TAIL_LINES)
        self.files: dict[int, IO[bytes]] = {}
        if log_dir is not None:
            log_dir.mkdir(parents=True, exist_ok=True)
            self.files = {STDOUT: open(log_dir / "stdout.log", "ab"), STDERR: open(log_dir / "stderr.log", "ab")}

    def feed(self, stream: int, data: bytes) -> None:
        """Take a chunk read from a pipe; emit every complete line in it; empty ``data`` means EOF.

        What follows the last newline is kept for the next chunk; if it holds a carriage return, the text
        after it is a progress bar's update, drawn in place at once.
        """
        if stream in self.files and data:
            self.files[stream].write(data)
            self.files[stream].flush()
        if not data:
            rest = self.lines[stream].rest()
            if rest:
                self._emit(stream, rest)
            return
        lines = self.lines[stream]
        for line in lines.feed(data):
            self._emit(stream, line)
        if b"\r" in lines.partial:
            lines.partial = lines.partial[lines.partial.rindex(b"\r"):]  # what came before is overwritten on screen
            shown = _last_segment(lines.partial)
            if shown and self.to_console & stream:
                self.console.update(stream, self.prefix, self.colour, shown, owner=self)

    def _emit(self, stream: int, raw: bytes) -> None:
        text = _last_segment(raw)
        if stream == STDERR:
            self.stderr_tail.append(text)
        if self.to_console & stream:
            self.console.line(stream, self.prefix, self.colour, text, owner=self)

    def close(self) -> None:
        """Flush partial lines and close the log files."""
        for stream in (STDOUT, STDERR):
            self.feed(stream, b"")
        for f in self.files.values():
            f.close()


def _last_segment(raw: bytes) -> str:
    """The text a terminal shows of a line with carriage returns in it: its last non-empty segment."""
    segments = [segment for segment in raw.split(b"\r") if segment]
    return segments[-1].decode("utf-8", "replace") if segments else ""
