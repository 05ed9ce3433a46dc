"""ftrun's console: worker lines with their prefixes, and ftrun's own notices; rich colours on a terminal."""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import ParamSpec

from rich.console import Console as RichConsole
from rich.text import Text

STDOUT, STDERR = 1, 2
"""The two streams, as torchrun's --redirects / --tee masks number them."""

_P = ParamSpec("_P")


def _losing_lines(method: Callable[_P, None]) -> Callable[_P, None]:
    """A console that cannot be written (a scheduler's output file on a full disk, a closed pipe) loses the
    line: the job goes on, and its event log keeps the record."""

    @functools.wraps(method)
    def write(*args: _P.args, **kwargs: _P.kwargs) -> None:
        try:
            method(*args, **kwargs)
        except OSError:
            pass

    return write


class Console:
    """The two console streams of a launcher or agent; rich colours on a terminal, plain text otherwise.

    A worker's unfinished line that ends in a carriage return (a progress bar) is drawn in place at once; the
    next output of the same worker goes over it, another worker's output goes on the next line. A progress
    line (what the job waits for) stays at the bottom of a terminal, redrawn below each line printed; without
    a terminal each new kind of wait is printed once, as a notice.
    """

    def __init__(self) -> None:
        self.out = RichConsole(file=sys.stdout, highlight=False, soft_wrap=True)
        self.err = RichConsole(file=sys.stderr, highlight=False, soft_wrap=True)
        self._drawn: dict[int, object] = {}  # stream -> the owner of the line drawn in place there, not ended
        self._progress: str | None = None
        self._progress_said: str | None = None  # the kind of wait last printed without a terminal

    @_losing_lines
    def line(self, stream: int, prefix: str, colour: str, text: str, owner: object = None) -> None:
        """Print one worker line after its prefix (the prefix as is: it ends with a space if one is wanted)."""
        self._write(stream, prefix, colour, text, owner, "\n")
        self._drawn.pop(stream, None)

    @_losing_lines
    def update(self, stream: int, prefix: str, colour: str, text: str, owner: object) -> None:
        """Draw ``owner``'s unfinished line in place: no newline, overwritten by its next update or line."""
        self._write(stream, prefix, colour, text, owner, "")
        self._drawn[stream] = owner

    @_losing_lines
    def notice(self, text: str, style: str = "bold") -> None:
        """Print one line of ftrun's own on stderr (bold when a terminal)."""
        if self._drawn.pop(STDERR, None) is not None:
            self.err.file.write("\n")
        if self.err.is_terminal:
            with self._below():
                self.err.print(Text(text, style=style))
        else:
            self.err.file.write(text + "\n")
            self.err.file.flush()

    @_losing_lines
    def progress(self, text: str | None) -> None:
        """Show what the job waits for (None: nothing); the same wait is not printed twice without a terminal."""
        if self.err.is_terminal:
            if text != self._progress:
                with self._below():
                    self._progress = text
            return
        kind = text.split(":", 1)[0] if text else None
        if kind is not None and kind != self._progress_said:
            self.notice(f"ftrun: {text}")
        self._progress_said = kind

    def _write(self, stream: int, prefix: str, colour: str, text: str, owner: object, end: str) -> None:
        console = self.out if stream == STDOUT else self.err
        drawn = self._drawn.get(stream)
        if drawn is not None:  # back over the owner's own line (erasing it on a terminal), else below another's
            console.file.write(("\r\x1b[K" if console.is_terminal else "\r") if drawn is owner else "\n")
        if console.is_terminal:
            with self._below():
                console.print(Text(prefix, style=colour) + Text(text), end=end)
        else:
            console.file.write(f"{prefix}{text}{end}")
        console.file.flush()

    @contextmanager
    def _below(self) -> Iterator[None]:
        """Clear the progress line, let the caller print, then draw the progress line again."""
        if self._progress:
            self.err.file.write("\r\x1b[2K")
        yield
        if self._progress:
            self.err.file.write(f"\r\x1b[2m{self._progress[: max(10, self.err.width - 1)]}\x1b[0m")
            self.err.file.flush()
