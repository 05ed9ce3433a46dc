"""How the agent stops the workers of an attempt, as pure functions of (the stop, what happened, now).

A stop begins with a signal to ftrun (a scheduler's preemption, Ctrl-C), a failure that ends the attempt, or
the end of the training (idle spares). On a signal, the workers that use the worker API first save their last
committed state, so a preemption loses nothing: for at most half of ``--shutdown-timeout``. Then every worker
gets the stop signal; what is left when ``--shutdown-timeout`` is over gets SIGKILL; and a worker still there
:data:`KILL_WAIT` seconds after that will not die (uninterruptible sleep in a driver or a hung file system):
it is reported with its pid and state and no longer waited for, so that ftrun itself always ends.
"""

from __future__ import annotations

import enum
import signal
from dataclasses import dataclass, replace

KILL_WAIT = 10.0
"""Seconds a worker has to end after SIGKILL before ftrun reports it and stops waiting for it (a GPU worker's
teardown can take seconds; a process in uninterruptible sleep never ends)."""
SAVE_SHARE = 0.5
"""The part of ``--shutdown-timeout`` the workers may spend saving their state before they are signalled."""


class Phase(enum.Enum):
    """Where a stop is: each phase's action is taken once, as the stop enters it."""

    SAVE = "save"  # the workers that use the worker API are saving their state
    SIGNAL = "signal"  # every worker got the stop signal
    KILL = "kill"  # every worker left got SIGKILL
    ABANDON = "abandon"  # the workers left will not die: reported, no longer waited for


@dataclass(frozen=True)
class StopSchedule:
    """When a stop moves on to its next phase (monotonic seconds)."""

    sig: int  # the signal the workers get in the SIGNAL phase
    began: float
    save_until: float  # == began when nothing is to be saved
    kill_at: float
    abandon_at: float


def schedule(sig: int, now: float, grace: float, save: bool) -> StopSchedule:
    """The stop that begins at ``now``: ``sig`` to the workers, SIGKILL ``grace`` (``--shutdown-timeout``)
    seconds later; with ``save``, first up to ``grace * SAVE_SHARE`` seconds for the workers to save."""
    kill_at = now if sig == signal.SIGKILL else now + grace
    save_until = now + grace * SAVE_SHARE if save and sig != signal.SIGKILL else now
    return StopSchedule(sig, now, save_until, kill_at, kill_at + KILL_WAIT)


def phase(stop: StopSchedule, now: float, saving: bool) -> Phase:
    """The phase of ``stop`` at ``now``; ``saving``: some worker asked to save has neither answered nor ended."""
    if now >= stop.abandon_at:
        return Phase.ABANDON
    if now >= stop.kill_at:
        return Phase.KILL
    if saving and now < stop.save_until:
        return Phase.SAVE
    return Phase.SIGNAL


def kill_now(stop: StopSchedule, now: float) -> StopSchedule:
    """``stop`` escalated at ``now``: no more saving or waiting, SIGKILL (a second signal, a fenced node, an
    attempt ended at once); the wait for an unkillable worker counts from the first SIGKILL."""
    kill_at = min(stop.kill_at, now)
    return replace(stop, save_until=min(stop.save_until, now), kill_at=kill_at,
                   abandon_at=min(stop.abandon_at, kill_at + KILL_WAIT))


class OnSignal(enum.Enum):
    """What a signal to ftrun asks of the agent."""

    SAVE_THEN_STOP = "save_then_stop"  # a preemption: save the workers' state, then stop them
    STOP = "stop"  # signal the workers now (nothing to save, or a stop is under way already)
    KILL = "kill"  # a second signal: no more waiting


def on_signal(signalled_before: bool, stopping: bool, savers: int) -> tuple[OnSignal, str]:
    """What to do when ftrun receives a stop signal, and why (a line for the console).

    ``signalled_before``: ftrun already received one; ``stopping``: the attempt is being stopped for another
    reason (a failure, the end of training); ``savers``: live workers that use the worker API.
    """
    if signalled_before:
        return OnSignal.KILL, "a second signal: killing the workers now"
    if stopping:
        return OnSignal.STOP, "the workers were being stopped already"
    if savers:
        return OnSignal.SAVE_THEN_STOP, (f"asking {savers} worker{'s' if savers > 1 else ''} to save "
                                         "their last committed state first")
    return OnSignal.STOP, ("no worker uses the worker API (ftrun.init()), so ftrun has no state to save: "
                           "the script's own checkpoints are what a next launch starts from")
