"""The run's event log: one JSON object per line for every start, fault, generation, recovery and end."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any


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
        record = {"time": round(time.time(), 6), "event": event, **fields}
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
