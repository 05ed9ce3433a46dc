"""Moving protected state from a rank at the last committed step to the ranks behind it, device to device.

The source sends each rank behind a manifest over the control plane: the state's structure with every
large tensor replaced by a reference, the small tensors (at most ``INLINE_BYTES`` each) and everything
that is not a tensor (the step, scheduler counters...). The referenced tensors follow in manifest order,
point to point from the source to each rank behind and to no one else, each on the plane that carries
its device (CUDA tensors on the data plane, CPU tensors on the plane that takes them: see
:class:`Route`). A tensor of a quarter bucket or more goes alone, straight from and into its own memory;
smaller ones travel grouped into buckets of at most ``bucket_bytes``. A receiver receives into its own tensor where it has one at the same place
with the same dtype and shape (a model's parameters, an optimizer's moments): neither side holds more than
one bucket beyond the state itself, and nothing is serialised whole.

The manifest is read with ``torch.load(weights_only=True)``: a peer's bytes build tensors, containers and
plain values, never run code. State that holds other types must allow them by name with
``torch.serialization.add_safe_globals`` (README, "Protected state"). Bytes that do not load, or that do not
describe tensors (a peer of another ftrun version), are :class:`MalformedState`, whatever torch or the check
found, in one line: the receiver cannot take part, and ends with that line (a retry would get the same bytes).
"""

from __future__ import annotations

import ctypes
import io
import math
import re
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from ftrun.worker.steps import CollectiveFailed

INLINE_BYTES = 64 << 10
BUCKET_BYTES = 16 << 20
REF = "__ftrun_tensor__"  # marks a referenced tensor in the skeleton: (REF, index)

Exchange = Callable[[list[tuple[torch.Tensor, int, bool]]], None]
"""Runs point-to-point operations ``(tensor, peer, is_send)`` on one plane together and waits for them."""


class MalformedState(RuntimeError):
    """What a peer sent is not state this worker can load (bytes that do not load, or do not describe tensors)."""


class UnsendableState(TypeError):
    """Protected state that cannot be sent: pickle refuses part of it (a function, a lock, an open file)."""


@dataclass(frozen=True)
class TensorSpec:
    """A referenced tensor: where it is in the state, and its layout."""

    path: tuple
    dtype: torch.dtype
    shape: tuple[int, ...]
    device_type: str

    @property
    def nbytes(self) -> int:
        """Its size in bytes."""
        return math.prod(self.shape) * torch.empty((), dtype=self.dtype).element_size()


@dataclass(frozen=True)
class Route:
    """Which plane carries the tensors of each device type, and where a receiver allocates them."""

    exchanges: dict[str, Exchange]
    devices: dict[str, torch.device]
    control: Exchange

    def __call__(self, device_type: str) -> Exchange:
        if device_type not in self.exchanges:
            raise RuntimeError(f"ftrun: no process group carries {device_type} tensors: protect state on "
                               f"{' or '.join(sorted(self.exchanges))}")
        return self.exchanges[device_type]


# ------------------------------------------------------------------------------ structure
def leaves(value: Any, path: tuple = ()) -> Iterator[tuple[tuple, torch.Tensor]]:
    """Every tensor in a nest of dicts, lists and tuples, with its path, in a fixed order."""
    if isinstance(value, torch.Tensor):
        yield path, value
    elif isinstance(value, dict):
        for key, item in value.items():
            yield from leaves(item, (*path, key))
    elif isinstance(value, (list, tuple)) and not _is_ref(value):
        for index, item in enumerate(value):
            yield from leaves(item, (*path, index))


def replace_leaves(value: Any, swap: Callable[[tuple, Any], Any], path: tuple = ()) -> Any:
    """A copy of the nest with each leaf passed through ``swap(path, leaf)``; an OrderedDict keeps its
    ``_metadata`` (a module's state_dict versions)."""
    if isinstance(value, dict):
        copy = OrderedDict() if isinstance(value, OrderedDict) else {}
        for key, item in value.items():
            copy[key] = replace_leaves(item, swap, (*path, key))
        if isinstance(value, OrderedDict) and hasattr(value, "_metadata"):
            copy._metadata = value._metadata
        return copy
    if isinstance(value, (list, tuple)) and not _is_ref(value):
        items = [replace_leaves(item, swap, (*path, index)) for index, item in enumerate(value)]
        return items if isinstance(value, list) else tuple(items)
    return swap(path, value)


def _is_ref(value: Any) -> bool:
    return isinstance(value, tuple) and len(value) == 2 and value[0] == REF


def manifest(state: Any) -> tuple[bytes, list[TensorSpec], list[torch.Tensor]]:
    """The bytes a receiver reads first, the specs of the tensors that follow them, and those tensors."""
    specs: list[TensorSpec] = []
    tensors: list[torch.Tensor] = []

    def swap(path: tuple, leaf: Any) -> Any:
        if not isinstance(leaf, torch.Tensor):
            return leaf
        if leaf.numel() * leaf.element_size() <= INLINE_BYTES or leaf.device.type == "meta":
            return leaf.detach().cpu()
        specs.append(TensorSpec(path, leaf.dtype, tuple(leaf.shape), leaf.device.type))
        tensors.append(leaf.detach())
        return (REF, len(tensors) - 1)

    skeleton = replace_leaves(state, swap)
    buffer = io.BytesIO()
    try:
        torch.save({"skeleton": skeleton, "specs": [(s.path, s.dtype, s.shape, s.device_type) for s in specs]}, buffer)
    except Exception as exc:  # what pickle refuses in the state: PicklingError, TypeError, AttributeError
        raise UnsendableState(f"{type(exc).__name__}: {_reason(exc)}") from None
    return buffer.getvalue(), specs, tensors


def unsendable(state: Any) -> str | None:
    """Why no peer could take ``state`` (None when one could): pickle refuses part of it, or torch loads it back
    only by running code (a type not allowed by name)."""
    try:
        data = manifest(state)[0]
    except UnsendableState as exc:
        return str(exc)
    try:
        torch.load(io.BytesIO(data), weights_only=True)
    except Exception as exc:  # what the weights-only unpickler refuses
        return f"{_reason(exc)}; allow its types by name with torch.serialization.add_safe_globals first"
    return None


def read_manifest(data: bytes) -> tuple[Any, list[TensorSpec]]:
    """A peer's manifest, loaded without running code: the skeleton and the specs of the tensors to come;
    MalformedState when it is not one."""
    loaded = load_peer_bytes(data)
    specs = described_tensors(loaded, "specs")
    if specs is None or not all(isinstance(device_type, str) for *_, device_type in specs):
        raise MalformedState("the state's manifest from the source is not one this worker reads")
    return loaded["skeleton"], [TensorSpec(tuple(p), d, tuple(s), t) for p, d, s, t in specs]


def described_tensors(loaded: Any, field: str) -> list | None:
    """``loaded[field]`` where ``loaded`` (from a peer) is a dict with a ``skeleton`` and that field is a list of
    4-item entries, each starting with a tensor's path, dtype and shape (sizes >= 0); else None."""
    return tensor_entries(loaded.get(field) if isinstance(loaded, dict) and "skeleton" in loaded else None)


def tensor_entries(items: Any) -> list | None:
    """``items`` when it is a list of 4-item entries, each starting with a tensor's path, dtype and shape (sizes
    >= 0); else None."""
    if not isinstance(items, list) or not all(isinstance(item, (list, tuple)) and len(item) == 4 for item in items):
        return None
    ok = all(isinstance(path, (list, tuple)) and isinstance(dtype, torch.dtype) and isinstance(shape, (list, tuple))
             and all(type(size) is int and size >= 0 for size in shape) for path, dtype, shape, _ in items)
    return items if ok else None


def load_peer_bytes(data: bytes) -> Any:
    """What a peer saved with ``torch.save``, loaded without running code; MalformedState when it does not load."""
    try:
        return torch.load(io.BytesIO(data), weights_only=True)
    except Exception as exc:  # a peer's bytes: whatever the unpickler raises on them
        raise MalformedState(f"a peer's bytes do not load as state ({type(exc).__name__}: {_reason(exc)})") from None


def _reason(exc: Exception) -> str:
    """The line of a load's error that says what is wrong: torch's weights-only refusal names the type to allow
    on a later line (``WeightsUnpickler error: Unsupported global: ...``), after lines of advice."""
    lines = [re.sub(r"\x1b\[[0-9;]*m", "", line).strip() for line in str(exc).splitlines()]
    lines = [line for line in lines if line]
    return next((line for line in lines if line.startswith("WeightsUnpickler error")), lines[0] if lines else "")[:300]


def send_bytes(exchange: Exchange, data: torch.Tensor, peers: list[int]) -> None:
    """Send ``data`` (uint8, on CPU) to each of ``peers``, its length first (:func:`receive_bytes`)."""
    size = torch.tensor([data.numel()], dtype=torch.int64)
    exchange([(size, peer, True) for peer in peers])
    exchange([(data, peer, True) for peer in peers])


def receive_bytes(exchange: Exchange, source: int) -> bytes:
    """What ``source`` sent with :func:`send_bytes`; MalformedState for a length no buffer can take."""
    size = torch.zeros(1, dtype=torch.int64)
    exchange([(size, source, False)])
    try:
        payload = torch.empty(int(size.item()), dtype=torch.uint8)
    except RuntimeError:  # negative, or more than this host can allocate
        raise MalformedState(f"the source announced {int(size.item())} bytes of state") from None
    exchange([(payload, source, False)])
    return payload_bytes(payload)


def buckets(specs: list[TensorSpec], bucket_bytes: int) -> list[list[int]]:
    """Tensors of a quarter bucket or more alone; consecutive smaller ones of one device type grouped up
    to ``bucket_bytes``."""
    groups: list[list[int]] = []
    size = bucket_bytes  # the open group is full: the next tensor starts one
    for index, spec in enumerate(specs):
        if spec.nbytes >= bucket_bytes // 4:
            groups.append([index])
            size = bucket_bytes
        elif size + spec.nbytes <= bucket_bytes and specs[groups[-1][0]].device_type == spec.device_type:
            groups[-1].append(index)
            size += spec.nbytes
        else:
            groups.append([index])
            size = spec.nbytes
    return groups


def targets(specs: list[TensorSpec], own: Any, devices: dict[str, torch.device]) -> list[torch.Tensor]:
    """Where each referenced tensor is received: this rank's own tensor at that path if it matches
    (received in place), else a new one on this rank's device of that type."""
    mine = dict(leaves(own))
    result = []
    for spec in specs:
        tensor = mine.get(spec.path)
        if (tensor is None or tensor.dtype != spec.dtype or tuple(tensor.shape) != spec.shape
                or tensor.device.type != spec.device_type or not tensor.is_contiguous()):
            try:
                tensor = torch.empty(spec.shape, dtype=spec.dtype, device=devices.get(spec.device_type, "cpu"))
            except RuntimeError:  # more than this rank can hold
                raise MalformedState(f"the source's tensor at {spec.path} ({spec.nbytes} bytes) cannot be "
                                     "allocated here") from None
        result.append(tensor)
    return result


def fill(skeleton: Any, tensors: list[torch.Tensor]) -> Any:
    """The skeleton with each reference replaced by its received tensor (MalformedState for one to none)."""

    def swap(_path: tuple, leaf: Any) -> Any:
        if not _is_ref(leaf):
            return leaf
        if type(leaf[1]) is not int or not 0 <= leaf[1] < len(tensors):
            raise MalformedState(f"the source's state refers to tensor {str(leaf[1])[:20]} of {len(tensors)}")
        return tensors[leaf[1]]

    return replace_leaves(skeleton, swap)


def payload_bytes(payload: torch.Tensor) -> bytes:
    """The bytes of a contiguous CPU uint8 tensor, without NumPy (torch does not depend on it)."""
    return ctypes.string_at(payload.data_ptr(), payload.numel())


def _bytes(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach().reshape(-1).view(torch.uint8)


class _Staging:
    """One reusable bucket per device type, made at its first use: the only memory beyond the state."""

    def __init__(self, bucket_bytes: int) -> None:
        self.bucket_bytes = bucket_bytes
        self._buffers: dict[torch.device, torch.Tensor] = {}

    def get(self, device: torch.device, nbytes: int) -> torch.Tensor:
        if device not in self._buffers:
            self._buffers[device] = torch.empty(self.bucket_bytes, dtype=torch.uint8, device=device)
        return self._buffers[device][:nbytes]


# ------------------------------------------------------------------------------ the two sides
def send(state: Any, behind: list[int], route: Route, bucket_bytes: int = BUCKET_BYTES) -> None:
    """Send ``state`` from this rank to each rank of ``behind``."""
    data, specs, tensors = manifest(state)
    send_bytes(route.control, torch.frombuffer(bytearray(data), dtype=torch.uint8), behind)
    staging = _Staging(bucket_bytes)
    for group in buckets(specs, bucket_bytes):
        first = tensors[group[0]]
        if len(group) == 1 and first.is_contiguous():
            out = _bytes(first)
        else:
            out = staging.get(first.device, sum(specs[i].nbytes for i in group))
            offset = 0
            for i in group:
                chunk = _bytes(tensors[i].contiguous())
                out[offset:offset + chunk.numel()].copy_(chunk)
                offset += chunk.numel()
        route(specs[group[0]].device_type)([(out, peer, True) for peer in behind])


def receive(source: int, own: Any, route: Route, bucket_bytes: int = BUCKET_BYTES) -> Any:
    """The source's state, each large tensor received into ``own``'s at its place where it matches."""
    skeleton, specs = read_manifest(receive_bytes(route.control, source))
    into = targets(specs, own, route.devices)
    staging = _Staging(bucket_bytes)
    for group in buckets(specs, bucket_bytes):
        exchange = route(specs[group[0]].device_type)
        if len(group) == 1:
            exchange([(_bytes(into[group[0]]), source, False)])
            continue
        out = staging.get(into[group[0]].device, sum(specs[i].nbytes for i in group))
        exchange([(out, source, False)])
        offset = 0
        for i in group:
            chunk = _bytes(into[i])
            chunk.copy_(out[offset:offset + chunk.numel()])
            offset += chunk.numel()
    return fill(skeleton, into)


# ------------------------------------------------------------------------------ planes
def p2p_on_group(group: dist.ProcessGroup | None) -> Exchange:
    """Point-to-point on a registered group (the data plane), batched: on NCCL one group call on the
    generation's own communicator (ProcessGroupNCCL::pointToPoint under ncclGroupStart), no pair one."""

    def run(ops: list[tuple[torch.Tensor, int, bool]]) -> None:
        if ops:
            _wait_all(dist.batch_isend_irecv([dist.P2POp(dist.isend if is_send else dist.irecv, tensor, peer, group)
                                              for tensor, peer, is_send in ops]))

    return run


def p2p_on_backend(backend: Any) -> Exchange:
    """Point-to-point on a standalone Gloo group (the control plane); tag 0 keeps each pair's order."""

    def run(ops: list[tuple[torch.Tensor, int, bool]]) -> None:
        _wait_all([backend.send([tensor], peer, 0) if is_send else backend.recv([tensor], peer, 0)
                   for tensor, peer, is_send in ops])

    return run


def via_host(exchange: Exchange) -> Exchange:
    """Point-to-point of device tensors through host memory, over ``exchange`` of CPU tensors: for a data
    plane that moves the device's tensors in collectives but not point to point (Gloo with CUDA tensors).
    Each operation's tensor (one bucket, or one large tensor) is staged in host memory on both sides."""

    def run(ops: list[tuple[torch.Tensor, int, bool]]) -> None:
        hosted = [(tensor.cpu() if is_send else torch.empty(tensor.shape, dtype=tensor.dtype), peer, is_send)
                  for tensor, peer, is_send in ops]
        exchange(hosted)
        for (tensor, _, is_send), (host, _, _) in zip(ops, hosted):
            if not is_send:
                tensor.copy_(host)

    return run


def _wait_all(works: list[dist.Work]) -> None:
    """Wait for point-to-point works (they have no future on Gloo): a peer's death or the abort of the
    generation (its connections shut down) makes them fail at once."""
    try:
        for work in works:
            work.wait()
    except RuntimeError as exc:
        raise CollectiveFailed(str(exc)) from exc
