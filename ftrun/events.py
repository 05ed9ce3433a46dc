"""The run's event log: one JSON object per line for every start, fault, generation, recovery and end.

Every record carries the schema version ``v``, its wall-clock ``time`` and its ``event`` name; the README
("The event log") lists every event and its fields. A change that renames or removes a field, or changes its
meaning, raises SCHEMA_VERSION; new events and new fields do not.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

SCHEMA_VERSION = 1
"""The version of the records' layout, written as ``v`` in every record."""


class EventLog:
    """Appends structured events to ``<run dir>/events.jsonl``; each line is flushed as written."""

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self._file = open(path, "a", encoding="utf-8")
        self.listeners: list[Callable[[dict[str, Any]], None]] = []
        """Called with each record once it is written (the live status tally)."""

    def write(self, event: str, **fields: Any) -> dict[str, Any]:
        """Record one ``event`` with its fields and the wall-clock time; returns the record."""
        record = {"v": SCHEMA_VERSION, "time": round(time.time(), 6), "event": event, **fields}
        self._file.write(json.dumps(record, sort_keys=True) + "\n")
        self._file.flush()
        for listener in self.listeners:
            listener(record)
        return record

    def close(self) -> None:
        """Close the file."""
        self._file.close()


def read_events(path: Path) -> list[dict[str, Any]]:
    """All events of a run's log, oldest first."""
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]
