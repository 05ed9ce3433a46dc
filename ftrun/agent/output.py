"""Worker output: each line prefixed with its worker's rank on the console, and kept in torchrun's log layout."""

from __future__ import annotations

import os
import socket
from collections import deque
from pathlib import Path
from string import Template

from ftrun import events
from ftrun.console import STDERR, STDOUT, Console
from ftrun.dropped import DroppedWrites, append
from ftrun.events import EventSink
from ftrun.lines import LineBuffer

_COLOURS = ["cyan", "magenta", "green", "yellow", "blue", "red", "bright_cyan", "bright_magenta"]
TAIL_LINES = 200


def render_prefix(template: str, role: str, rank: int, local_rank: int, hostname: str | None = None) -> str:
    """Expand torchrun's prefix macros: ${role_name}, ${rank}, ${local_rank}, ${hostname}."""
    return Template(template).safe_substitute(
        role_name=role, rank=rank, local_rank=local_rank, hostname=hostname or socket.gethostname()
    )


class LogFiles:
    """Where every worker's log files go, and what a full disk made them drop (one account for all workers)."""

    def __init__(self, console: Console, log: EventSink, where: Path) -> None:
        self.log = log
        self.dropped = DroppedWrites(f"the worker logs under {where}", console.notice)

    def open(self, log_dir: Path) -> dict[int, int]:
        """One worker's ``stdout.log`` and ``stderr.log`` in ``log_dir``, by stream: descriptors open for
        appending; none when they cannot be made (the lines still reach the console)."""
        files: dict[int, int] = {}
        try:
            log_dir.mkdir(parents=True, exist_ok=True)
            for stream, name in ((STDOUT, "stdout.log"), (STDERR, "stderr.log")):
                files[stream] = os.open(log_dir / name, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o644)
        except OSError as exc:
            self.dropped.failed(exc)
        return files

    def write(self, fd: int, data: bytes) -> None:
        """Append ``data`` to one worker's log, or drop it (counted) when the disk refuses."""
        try:
            append(fd, data)
        except OSError as exc:
            self.dropped.failed(exc)
            return
        lost = self.dropped.lost()
        if lost is not None:
            self.log.write(events.WRITES_DROPPED, **lost)
            self.dropped.recorded()


class WorkerOutput:
    """Splits one worker's two streams into lines and routes each line to the console and its log file."""

    def __init__(
        self,
        console: Console,
        prefix: str,
        rank: int,
        to_console: int,
        log_dir: Path | None,
        files: LogFiles,
    ) -> None:
        self.console = console
        self.prefix = prefix
        self.colour = _COLOURS[rank % len(_COLOURS)]
        self.to_console = to_console
        self.lines = {STDOUT: LineBuffer(), STDERR: LineBuffer()}
        self.stderr_tail: deque[str] = deque(maxlen=TAIL_LINES)
        self.log_files = files
        self.files: dict[int, int] = files.open(log_dir) if log_dir is not None else {}

    def feed(self, stream: int, data: bytes) -> None:
        """Take a chunk read from a pipe; emit every complete line in it; empty ``data`` means EOF.

        What follows the last newline is kept for the next chunk; if it holds a carriage return, the text
        after it is a progress bar's update, drawn in place at once.
        """
        if stream in self.files and data:
            self.log_files.write(self.files[stream], data)
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
        for fd in self.files.values():
            os.close(fd)
        self.files = {}


def _last_segment(raw: bytes) -> str:
    """The text a terminal shows of a line with carriage returns in it: its last non-empty segment."""
    segments = [segment for segment in raw.split(b"\r") if segment]
    return segments[-1].decode("utf-8", "replace") if segments else ""
