"""Worker output: each line prefixed with its worker's rank on the console, and kept in torchrun's log layout."""

from __future__ import annotations

import socket
import sys
from collections import deque
from pathlib import Path
from string import Template
from typing import IO

from rich.console import Console
from rich.text import Text

from ftrun.config import STDERR, STDOUT

_COLOURS = ["cyan", "magenta", "green", "yellow", "blue", "red", "bright_cyan", "bright_magenta"]
TAIL_LINES = 200


class Console2:
    """The agent's two console streams; rich colours on a terminal, plain bytes otherwise."""

    def __init__(self) -> None:
        self.out = Console(file=sys.stdout, highlight=False, soft_wrap=True)
        self.err = Console(file=sys.stderr, highlight=False, soft_wrap=True)

    def line(self, stream: int, prefix: str, colour: str, text: str) -> None:
        """Print one worker line with its prefix."""
        console = self.out if stream == STDOUT else self.err
        if console.is_terminal:
            console.print(Text(prefix, style=colour) + Text(" " + text))
        else:
            console.file.write(f"{prefix} {text}\n")
            console.file.flush()

    def notice(self, text: str, style: str = "bold") -> None:
        """Print one line of ftrun's own on stderr (bold when a terminal)."""
        if self.err.is_terminal:
            self.err.print(Text(text, style=style))
        else:
            self.err.file.write(text + "\n")
            self.err.file.flush()


def render_prefix(template: str, role: str, rank: int, local_rank: int, hostname: str | None = None) -> str:
    """Expand torchrun's prefix macros: ${role_name}, ${rank}, ${local_rank}, ${hostname}."""
    return Template(template).safe_substitute(
        role_name=role, rank=rank, local_rank=local_rank, hostname=hostname or socket.gethostname()
    )


class WorkerOutput:
    """Splits one worker's two streams into lines and routes each line to the console and its log file."""

    def __init__(
        self,
        console: Console2,
        prefix: str,
        rank: int,
        to_console: int,
        log_dir: Path | None,
    ) -> None:
        self.console = console
        self.prefix = prefix
        self.colour = _COLOURS[rank % len(_COLOURS)]
        self.to_console = to_console
        self.partial = {STDOUT: b"", STDERR: b""}
        self.stderr_tail: deque[str] = deque(maxlen=TAIL_LINES)
        self.files: dict[int, IO[bytes]] = {}
        if log_dir is not None:
            log_dir.mkdir(parents=True, exist_ok=True)
            self.files = {STDOUT: open(log_dir / "stdout.log", "ab"), STDERR: open(log_dir / "stderr.log", "ab")}

    def feed(self, stream: int, data: bytes) -> None:
        """Take a chunk read from a pipe; emit every complete line in it; empty ``data`` means EOF."""
        if stream in self.files and data:
            self.files[stream].write(data)
            self.files[stream].flush()
        if not data:
            rest, self.partial[stream] = self.partial[stream], b""
            if rest:
                self._emit(stream, rest)
            return
        *lines, self.partial[stream] = (self.partial[stream] + data).split(b"\n")
        for line in lines:
            self._emit(stream, line)

    def _emit(self, stream: int, raw: bytes) -> None:
        text = raw.decode("utf-8", "replace").rstrip("\r")
        if stream == STDERR:
            self.stderr_tail.append(text)
        if self.to_console & stream:
            self.console.line(stream, self.prefix, self.colour, text)

    def close(self) -> None:
        """Flush partial lines and close the log files."""
        for stream in (STDOUT, STDERR):
            self.feed(stream, b"")
        for f in self.files.values():
            f.close()
