"""Protected state: what it is, how it is loaded, and the rescue files a group restart resumes from."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any, Protocol

import torch


class Stateful(Protocol):
    """Anything with ``state_dict()`` and ``load_state_dict()``: a model, an optimizer, a scheduler."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> Any: ...


def snapshot(objects: dict[str, Stateful], step: int) -> dict[str, Any]:
    """The committed step and every protected object's state (its live tensors, not copies)."""
    return {"step": step, "state": {name: obj.state_dict() for name, obj in objects.items()}}


def load_into(data: dict[str, Any], objects: dict[str, Stateful]) -> int:
    """Load a snapshot into the protected objects; returns the step it committed."""
    missing = set(objects) - set(data["state"])
    if missing:
        raise RuntimeError(f"ftrun: a peer sent no state for {sorted(missing)}: every rank must protect the same names")
    for name, obj in objects.items():
        obj.load_state_dict(data["state"][name])
    return int(data["step"])


def save_rescue(objects: dict[str, Stateful], step: int, path: Path) -> None:
    """Write the state of ``step`` to ``path`` atomically: kept for a group restart after a failed recovery."""
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(".partial")
    torch.save(snapshot(objects, step), partial)
    os.replace(partial, path)


def best_rescue(directory: Path) -> dict[str, Any] | None:
    """The readable rescue file with the highest committed step, loaded without running code; one line
    on stderr for each file that cannot be read (a worker killed mid-write leaves only a .partial)."""
    best: dict[str, Any] | None = None
    for path in sorted(directory.glob("*.pt")):
        try:
            data = torch.load(path, map_location="cpu", weights_only=True)
            step = int(data["step"])
        except Exception as exc:  # noqa: BLE001 -- any unreadable file is skipped the same way
            print(f"ftrun: skipping rescue file {path}: {type(exc).__name__}: {str(exc).splitlines()[0][:200]}",
                  file=sys.stderr, flush=True)
            continue
        if step >= 0 and (best is None or step > best["step"]):
            best = data
    return best
