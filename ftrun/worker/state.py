"""Protected state as bytes: what a rank at the last committed step sends to a rank behind it."""

from __future__ import annotations

import ctypes
import io
from typing import Any, Protocol

import torch


class Stateful(Protocol):
    """Anything with ``state_dict()`` and ``load_state_dict()``: a model, an optimizer, a scheduler."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> Any: ...


def pack(objects: dict[str, Stateful], step: int) -> torch.Tensor:
    """Serialise every protected object's state and the committed step into one uint8 tensor."""
    buffer = io.BytesIO()
    torch.save({"step": step, "state": {name: obj.state_dict() for name, obj in objects.items()}}, buffer)
    return torch.frombuffer(bytearray(buffer.getbuffer()), dtype=torch.uint8)


def unpack(payload: torch.Tensor, objects: dict[str, Stateful]) -> int:
    """Load a peer's state into the protected objects; returns the step that state committed."""
    # The payload comes from a peer of the same job, which this worker already trusts with its gradients.
    raw = ctypes.string_at(payload.data_ptr(), payload.numel())  # no numpy: torch does not require it
    data = torch.load(io.BytesIO(raw), weights_only=False)
    missing = set(objects) - set(data["state"])
    if missing:
        raise RuntimeError(f"ftrun: a peer sent no state for {sorted(missing)}: every rank must protect the same names")
    for name, obj in objects.items():
        obj.load_state_dict(data["state"][name])
    return int(data["step"])
