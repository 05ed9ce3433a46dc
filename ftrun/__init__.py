"""ftrun: a fault-tolerant torchrun, and the worker API that lets a script recover in place.

The worker API (``ftrun.init``, ``GlobalBatches``) imports torch; the launcher does not need it to start.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"
__all__ = ["GlobalBatches", "Session", "init"]

if TYPE_CHECKING:
    from ftrun.worker.data import GlobalBatches
    from ftrun.worker.session import Session, init


def __getattr__(name: str) -> Any:
    """Import the worker API on first use, so `ftrun` the command starts without importing torch."""
    if name == "GlobalBatches":
        from ftrun.worker.data import GlobalBatches

        return GlobalBatches
    if name in ("Session", "init"):
        from ftrun.worker import session

        return getattr(session, name)
    raise AttributeError(f"module 'ftrun' has no attribute {name!r}")
