"""ftrun's console: worker lines with their prefixes, and ftrun's own notices; rich colours on a terminal."""

from __future__ import annotations

import sys

from rich.console import Console as RichConsole
from rich.text import Text

STDOUT, STDERR = 1, 2
"""The two streams, as torchrun's --redirects / --tee masks number them."""


class Console:
    """The two console streams of a launcher or agent; rich colours on a terminal, plain text otherwise."""

    def __init__(self) -> None:
        self.out = RichConsole(file=sys.stdout, highlight=False, soft_wrap=True)
        self.err = RichConsole(file=sys.stderr, highlight=False, soft_wrap=True)

    def line(self, stream: int, prefix: str, colour: str, text: str) -> None:
        """Print one worker line with its prefix."""
        console = self.out if stream == STDOUT else self.err
        if console.is_terminal:
            _print(console, Text(prefix, style=colour) + Text(" " + text))
        else:
            _write(console, f"{prefix} {text}\n")

    def notice(self, text: str, style: str = "bold") -> None:
        """Print one line of ftrun's own on stderr (bold when a terminal)."""
        if self.err.is_terminal:
            _print(self.err, Text(text, style=style))
        else:
            _write(self.err, text + "\n")


# A console that cannot be written (a scheduler's output file on a full disk, a closed pipe) loses the line:
# the job goes on, and its event log keeps the record.
def _print(console: RichConsole, text: Text) -> None:
    try:
        console.print(text)
    except OSError:
        pass


def _write(console: RichConsole, text: str) -> None:
    try:
        console.file.write(text)
        console.file.flush()
    except OSError:
        pass
