"""Child processes and signals: children that never outlive their parent, signals as loop events, exits."""

from __future__ import annotations

import ctypes
import os
import signal
from collections.abc import Iterable
from types import TracebackType
from typing import Any

_PR_SET_PDEATHSIG = 1
_libc = ctypes.CDLL(None, use_errno=True)


def die_with_parent() -> None:
    """Runs in a child between fork and exec: SIGKILL it if its parent dies, even by SIGKILL."""
    _libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


def signal_name(number: int) -> str:
    """``SIGKILL`` for 9; ``signal 77`` for a number with no name."""
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


class Stopped(BaseException):
    """SIGTERM or SIGHUP where no event loop handles signals (start-up, ``status``, ``inject``): it ends the
    command as Ctrl-C does, running its ``finally`` blocks, and the command line exits with 128 +
    :attr:`signum`. Not a ``KeyboardInterrupt``, which the command-line library turns into exit code 130."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal_name(signum))
        self.signum = signum


def _stop(signum: int, frame: object) -> None:
    raise Stopped(signum)


def quit_on_signals() -> dict[int, Any]:
    """Make SIGINT, SIGTERM and SIGHUP end this process at once, with 128 + their number and nothing printed,
    where their disposition is the default (one ignored stays ignored): for the command's first moments, while
    it imports its command line and nothing has started (a KeyboardInterrupt traceback otherwise, or a death by
    the signal). Returns the dispositions replaced, for the caller to put back."""
    return _where_default((signal.SIGINT, signal.SIGTERM, signal.SIGHUP), _quit)


def _quit(signum: int, frame: object) -> None:
    os._exit(128 + signum)


def stop_on_signals() -> None:
    """Make SIGTERM and SIGHUP raise :class:`Stopped` in the main thread, where their disposition is the default
    (one ignored, as under ``nohup``, stays ignored): a process killed by them skips its clean-up, which the
    ``finally`` blocks an exception runs do not."""
    _where_default((signal.SIGTERM, signal.SIGHUP), _stop)


def _where_default(signals: Iterable[int], handler: Any) -> dict[int, Any]:
    """Set ``handler`` for each of ``signals`` whose disposition is the default (the system's, or Python's
    KeyboardInterrupt for SIGINT); the dispositions replaced, by signal."""
    replaced: dict[int, Any] = {}
    for sig in signals:
        current = signal.getsignal(sig)
        if current is signal.SIG_DFL or current is signal.default_int_handler:
            replaced[sig] = current
            signal.signal(sig, handler)
    return replaced


def ignore_late_signals() -> None:
    """The command is over: SIGINT, SIGTERM and SIGHUP are ignored from now on, so that one arriving while the
    interpreter shuts down (which puts the default back on the handlers Python set) does not turn the exit
    status chosen into a death by that signal."""
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)


class SignalWake:
    """While entered, the given signals are caught and written to a pipe an event loop can select on.

    The handlers do nothing themselves: the loop reads :attr:`fd` and acts on the signal numbers it finds
    (:meth:`received`), so every decision stays on the loop's thread. Leaving restores what was there.
    """

    def __init__(self, signals: Iterable[int]) -> None:
        self.signals = set(signals)
        self.fd = -1
        self._write_fd = -1
        self._previous_wakeup = -1
        self._previous: dict[int, object] = {}

    def __enter__(self) -> SignalWake:
        self.fd, self._write_fd = os.pipe()
        os.set_blocking(self.fd, False)
        os.set_blocking(self._write_fd, False)
        self._previous_wakeup = signal.set_wakeup_fd(self._write_fd)
        self._previous = {sig: signal.signal(sig, lambda *_: None) for sig in self.signals}
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 trace: TracebackType | None) -> None:
        signal.set_wakeup_fd(self._previous_wakeup)
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        os.close(self.fd)
        os.close(self._write_fd)

    def received(self) -> list[int]:
        """The signals caught since the last call, oldest first."""
        try:
            return list(os.read(self.fd, 64))
        except BlockingIOError:
            return []
