"""Protected state as bytes: what a rank at the last committed step sends to a rank behind it."""

from __future__ import annotations

import ctypes
import io
import os
from pathlib import Path
from typing import Any, BinaryIO, Protocol

import torch


class Stateful(Protocol):
    """Anything with ``state_dict()`` and ``load_state_dict()``: a model, an optimizer, a scheduler."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> Any: ...


def _snapshot(objects: dict[str, Stateful], step: int) -> dict[str, Any]:
    return {"step": step, "state": {name: obj.state_dict() for name, obj in objects.items()}}


def pack(objects: dict[str, Stateful], step: int) -> torch.Tensor:
    """Serialise every protected object's state and the committed step into one uint8 tensor."""
    buffer = io.BytesIO()
    torch.save(_snapshot(objects, step), buffer)
    return torch.frombuffer(bytearray(buffer.getbuffer()), dtype=torch.uint8)


def unpack(payload: torch.Tensor, objects: dict[str, Stateful]) -> int:
    """Load a peer's state into the protected objects; returns the step that state committed."""
    raw = ctypes.string_at(payload.data_ptr(), payload.numel())  # no numpy: torch does not require it
    return _load(torch.load(io.BytesIO(raw), weights_only=False), objects)  # from a peer of this job


def save_rescue(objects: dict[str, Stateful], step: int, path: Path) -> None:
    """Write the state of ``step`` to ``path`` atomically: kept for a group restart or a next launch.

    OSError when it cannot be written (a full disk), and no partial file is left behind.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(".partial")
    try:
        with open(partial, "wb") as f:
            target = _KeepsWriteError(f)
            try:
                torch.save(_snapshot(objects, step), target)
            except RuntimeError:
                if target.error is not None:  # torch reports a failed write as an opaque "enforce fail"
                    raise target.error from None
                raise
        os.replace(partial, path)
    except BaseException:
        partial.unlink(missing_ok=True)
        raise


class _KeepsWriteError:
    """A binary file that keeps the first error its writes raised."""

    def __init__(self, file: BinaryIO) -> None:
        self.file = file
        self.error: OSError | None = None

    def write(self, data: bytes) -> int:
        try:
            return self.file.write(data)
        except OSError as exc:
            self.error = self.error or exc
            raise

    def flush(self) -> None:
        self.file.flush()


def load_rescue(directory: Path, objects: dict[str, Stateful]) -> int | None:
    """Load the rescued state with the highest committed step in ``directory``; its step, or None."""
    best: tuple[int, dict[str, Any]] | None = None
    for path in directory.glob("*.pt"):
        data = torch.load(path, weights_only=False)  # written by this run's own workers
        if best is None or data["step"] > best[0]:
            best = (data["step"], data)
    return None if best is None or best[0] < 0 else _load(best[1], objects)


def _load(data: dict[str, Any], objects: dict[str, Stateful]) -> int:
    missing = set(objects) - set(data["state"])
    if missing:
        raise RuntimeError(f"ftrun: a peer sent no state for {sorted(missing)}: every rank must protect the same names")
    for name, obj in objects.items():
        obj.load_state_dict(data["state"][name])
    return int(data["step"])
