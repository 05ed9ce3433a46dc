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
    """The agent's two console streams; rich colours on a terminal, plain bytes otherwise.

    A worker's unfinished line that ends in a carriage return (a progress bar) is drawn in place at once; the
    next output of the same worker goes over it, another worker's output goes on the next line.
    """

    def __init__(self) -> None:
        self.out = Console(file=sys.stdout, highlight=False, soft_wrap=True)
        self.err = Console(file=sys.stderr, highlight=False, soft_wrap=True)
        self._drawn: dict[int, object] = {}  # stream -> the owner of the line drawn in place there, not ended

    def line(self, stream: int, prefix: str, colour: str, text: str, owner: object = None) -> None:
        """Print one worker line after its prefix (the prefix as is: it ends with a space if one is wanted)."""
        self._write(stream, prefix, colour, text, owner, "\n")
        self._drawn.pop(stream, None)

    def update(self, stream: int, prefix: str, colour: str, text: str, owner: object) -> None:
        """Draw ``owner``'s unfinished line in place: no newline, overwritten by its next update or line."""
        self._write(stream, prefix, colour, text, owner, "")
        self._drawn[stream] = owner

    def _write(self, stream: int, prefix: str, colour: str, text: str, owner: object, end: str) -> None:
        console = self.out if stream == STDOUT else self.err
        drawn = self._drawn.get(stream)
        if drawn is not None:  # back over the owner's own line (erasing it on a terminal), else below another's
            console.file.write(("\r\x1b[K" if console.is_terminal else "\r") if drawn is owner else "\n")
        if console.is_terminal:
            console.print(Text(prefix, style=colour) + Text(text), end=end)
        else:
            console.file.write(f"{prefix}{text}{end}")
        console.file.flush()

    def notice(self, text: str, style: str = "bold") -> None:
        """Print one line of ftrun's own on stderr (bold when a terminal)."""
        if self._drawn.pop(STDERR, None) is not None:
            self.err.file.write("\n")
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
        """Take a chunk read from a pipe; emit every complete line in it; empty ``data`` means EOF.

        What follows the last newline is kept for the next chunk; if it holds a carriage return, the text
        after it is a progress bar's update, drawn in place at once.
        """
        if stream in self.files and data:
            self.files[stream].write(data)
            self.files[stream].flush()
        if not data:
            rest, self.partial[stream] = self.partial[stream], b""
            if rest:
                self._emit(stream, rest)
            return
        *lines, rest = (self.partial[stream] + data).split(b"\n")
        for line in lines:
            self._emit(stream, line)
        if b"\r" in rest:
            rest = rest[rest.rindex(b"\r"):]  # what came before it is overwritten on the screen
            shown = _last_segment(rest)
            if shown and self.to_console & stream:
                self.console.update(stream, self.prefix, self.colour, shown, owner=self)
        self.partial[stream] = rest

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
