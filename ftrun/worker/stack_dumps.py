"""How a worker answers the hang watchdog's request for its Python stacks."""

from __future__ import annotations

import faulthandler
import signal
import threading

from ftrun import protocol


def answer_stack_dump_requests() -> None:
    """Dump every thread's Python stack to stderr at the hang watchdog's request (``STACK_DUMP_SIGNAL``).

    faulthandler lets go of the signal near the end of Python's finalization, restoring the disposition it
    found. That one is "ignore", not the default (which ends the process): a request that lands in a worker's
    last moments, while it is slow to exit, is then lost rather than the worker's death by signal. (Python
    sets a disposition only from the main thread: a session begun in another keeps the default.)
    """
    if threading.current_thread() is threading.main_thread():
        signal.signal(protocol.STACK_DUMP_SIGNAL, signal.SIG_IGN)
    faulthandler.register(protocol.STACK_DUMP_SIGNAL, all_threads=True)
