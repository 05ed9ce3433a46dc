"""Sharded (FSDP2) state kept on disk as ftrun is stopped or restarts the group, and read back at the next start.

One shard is no state to restart from, but every rank's together is. When asked to save, each rank writes
what it holds of the sharded state, its own shard's complete snapshots and its copies of its giver's
(:class:`~ftrun.worker.redundancy.Redundancy`), to ``<rescue dir>/shards/<index>.pt``, named by the index of
its shard. The live state is never read for it: the request is answered on a thread of its own, and FSDP2
swaps the unsharded parameters in during a step. At the next start rank ``r`` reads ``shards/<r>.pt`` in its
own node's directory, and the ranks agree, as at an in-place recovery, on the newest step at which every
shard of the saved world is held (:func:`~ftrun.worker.shards.choose_saved`). Ranks stopped a step apart
resume at the step they all hold: each keeps the step before its last as well.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ftrun.protocol import MAX_INT
from ftrun.worker import transfer
from ftrun.worker.redundancy import Redundancy, Slot
from ftrun.worker.shards import INVALID, Holding, Layout
from ftrun.worker.state import BadRescue, load_checked, save_atomically, skipped_line

MAX_WORLD = 1 << 20
"""The most ranks a saved shard may say its world had: a bound on what a file may make a worker allocate."""


@dataclass
class Saved:
    """The copies one rank read back: what it tells its peers, their layout, and the copies themselves."""

    holding: Holding
    layout: Layout
    own: list[Slot]
    buddy: list[Slot]


def path_of(directory: Path, index: int) -> Path:
    """Where shard ``index``'s holder writes what it holds."""
    return directory / "shards" / f"{index}.pt"


def write(redundancy: Redundancy, directory: Path, copies: bool) -> int:
    """Write the complete snapshots of committed steps ``redundancy`` holds of its own shard (with ``copies``, also
    its copies of its giver's: a rank may be lost, its shard in those only) to ``directory``; the newest step of
    its own shard written, or -1 when it holds none (no step copied yet, or ``refresh_every`` 0): nothing is
    written then. The caller holds the state lock (no refresh overwrites a copy meanwhile); OSError when the
    file cannot be written (a full disk)."""
    own = [slot for slot in redundancy.own if slot.step >= 0]
    if not own:
        return -1
    buddy = [slot for slot in redundancy.buddy if slot.step >= 0] if copies else []
    save_atomically({"index": redundancy.index, "world": redundancy.world, "layout_gen": redundancy.layout_gen,
                     "stride": redundancy.stride, "layout": redundancy.layout.to_list(),
                     "own": [{"step": s.step, "skeleton": s.skeleton, "data": s.buffer} for s in own],
                     "buddy": [{"step": s.step, "data": s.buffer} for s in buddy]},
                    path_of(directory, redundancy.index))
    return max(slot.step for slot in own)


def read_for(directory: Path, rank: int, world: int) -> list[Saved]:
    """What rank ``rank`` of a world of ``world`` reads in ``directory``: the files of shards ``rank``,
    ``rank + world``, ... there (a save by more ranks than the world resuming it spreads over them)."""
    names = (path.stem for path in (directory / "shards").glob("*.pt"))
    indices = sorted(int(name) for name in names if name.isascii() and name.isdigit() and len(name) < 8)
    found = (read(directory, index) for index in indices if index % world == rank and index < MAX_WORLD)
    return [saved for saved in found if saved is not None]


def slots_of(saved: list[Saved]) -> tuple[list[Slot], list[Slot]]:
    """The own and buddy slots of every file read, two of each per file (an absent one empty), in the order
    :func:`~ftrun.worker.shards.choose_saved` counts them."""
    def two(slots: list[Slot]) -> list[Slot]:
        return slots + [Slot(torch.empty(0, dtype=torch.uint8)) for _ in range(2 - len(slots))]
    return [s for one in saved for s in two(one.own)], [s for one in saved for s in two(one.buddy)]


def read(directory: Path, index: int) -> Saved | None:
    """What the holder of shard ``index`` saved in ``directory``, or None: no such file, or one line on stderr
    says why the file there is not one to start from."""
    path = path_of(directory, index)
    if not path.exists():
        return None
    try:
        data = load_checked(path, problem)
        if data["index"] != index:
            raise BadRescue(f"it holds shard {data['index']}, not shard {index}")
    except Exception as exc:  # noqa: BLE001 -- any unusable file is skipped the same way
        print(skipped_line(path, exc), file=sys.stderr, flush=True)
        return None
    layout = Layout.from_list(data["layout"])
    own = [Slot(copy["data"], copy["step"], copy["skeleton"]) for copy in data["own"]]
    buddy = [Slot(copy["data"], copy["step"]) for copy in data["buddy"]]
    steps = lambda slots: tuple(s.step for s in slots) + (INVALID,) * (2 - len(slots))  # noqa: E731
    holding = Holding(INVALID, data["index"], data["world"], steps(own), steps(buddy), data["layout_gen"],
                      data["stride"])
    return Saved(holding, layout, own, buddy)


def problem(data: Any) -> str | None:
    """Why ``data``, loaded from a saved shard's file, is not what :func:`write` wrote (None when it is)."""
    if not isinstance(data, dict):
        return f"not a saved shard (a {type(data).__name__}, not a dict)"
    ints = {key: data.get(key) for key in ("index", "world", "layout_gen", "stride")}
    if not all(type(value) is int for value in ints.values()):
        return "its index, world, generation and stride are not all whole numbers"
    index, world, stride = ints["index"], ints["world"], ints["stride"]
    if not (0 < world <= MAX_WORLD and 0 <= index < world and 0 < stride <= max(1, world - 1)
            and -MAX_INT <= ints["layout_gen"] <= MAX_INT):
        return f"shard {index} of a world of {world} with buddy stride {stride} is no shard of a world"
    items = transfer.tensor_entries(data.get("layout"))
    if items is None:
        return "its layout is not a list of tensors' paths, types and shapes"
    layout = Layout.from_list(items)
    for field, shard in (("own", index), ("buddy", (index - stride) % world)):
        copies = data.get(field)
        if not isinstance(copies, list) or len(copies) > 2:
            return f"its {field} copies are not a list of at most 2"
        for copy in copies:
            if not isinstance(copy, dict) or type(copy.get("step")) is not int or not 0 <= copy["step"] <= MAX_INT:
                return f"a copy in {field} has no committed step"
            tensor = copy.get("data")
            if not isinstance(tensor, torch.Tensor) or tensor.dtype != torch.uint8 or tensor.dim() != 1 \
                    or tensor.numel() != layout.nbytes(shard, world):
                return f"a copy in {field} is not the {layout.nbytes(shard, world)} bytes its layout says"
    return None

