"""Where every byte of a sharded (FSDP2) state lives, and the decisions of its recovery: pure functions.

A rank's *local state* is every protected object's ``state_dict()`` with each DTensor leaf replaced by its
local shard, packed into one flat byte buffer in a fixed leaf order (:class:`Layout`). FSDP2
(``fully_shard``) shards every parameter, and AdamW's moments with it, along dim 0 with ``torch.chunk``'s
rule over a 1-D mesh of all ranks: rank ``i`` of ``w`` holds rows ``[i*c, (i+1)*c)`` of ``n`` (clamped), with
``c = ceil(n / w)``. Plain tensor leaves (AdamW's ``step``) are the same on every rank and stored whole.

Shard ``i`` of a world ``w`` is copied into the host memory of its buddy, rank ``(i + s) % w``, where the
stride ``s`` (:func:`buddy_stride`) is the smallest that puts every rank's buddy on another node. After a
fault :func:`choose` picks the newest step at which every shard is held somewhere (live, in its owner's
snapshot, or in its buddy's copy) and :func:`moves` says which byte ranges go from which holder to which
rank of the new generation, whatever its size.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch

INVALID = -2  # a slot that holds no complete copy (empty, or a refresh that broke off)
LIVE, OWN, BUDDY = "live", "own", "buddy"


def chunk_rows(rows: int, index: int, world: int) -> tuple[int, int]:
    """The rows ``[start, stop)`` that shard ``index`` of ``world`` holds (``torch.chunk`` along dim 0)."""
    size = math.ceil(rows / world) if rows else 0
    start = min(index * size, rows)
    return start, min(start + size, rows)


@dataclass(frozen=True)
class Leaf:
    """One tensor of the state: where it is, its global shape, and whether it is sharded along dim 0."""

    path: tuple
    dtype: torch.dtype
    shape: tuple[int, ...]
    sharded: bool

    @property
    def row_bytes(self) -> int:
        """Bytes of one row (dim 0) of the global tensor, or of the whole of a 0-d tensor."""
        return math.prod(self.shape[1:]) * torch.empty((), dtype=self.dtype).element_size()

    def rows(self, index: int, world: int) -> tuple[int, int]:
        """The global rows shard ``index`` of ``world`` holds (all of them for a plain tensor)."""
        if not self.shape:
            return 0, 1
        return chunk_rows(self.shape[0], index, world) if self.sharded else (0, self.shape[0])

    def local_shape(self, index: int, world: int) -> tuple[int, ...]:
        """The shape of shard ``index``'s piece of this tensor."""
        if not self.shape:
            return ()
        start, stop = self.rows(index, world)
        return (stop - start, *self.shape[1:])

    def nbytes(self, index: int, world: int) -> int:
        """Bytes of shard ``index``'s piece."""
        start, stop = self.rows(index, world)
        return (stop - start) * self.row_bytes


@dataclass(frozen=True)
class Layout:
    """The leaves of a sharded state in packing order: the same on every rank of a generation."""

    leaves: tuple[Leaf, ...]

    def offsets(self, index: int, world: int) -> list[int]:
        """Byte offset of each leaf in shard ``index``'s flat buffer."""
        result, offset = [], 0
        for leaf in self.leaves:
            result.append(offset)
            offset += leaf.nbytes(index, world)
        return result

    def nbytes(self, index: int, world: int) -> int:
        """Size of shard ``index``'s flat buffer."""
        return sum(leaf.nbytes(index, world) for leaf in self.leaves)

    def to_list(self) -> list[tuple]:
        """Plain values, for a peer that has no such state yet (a joiner)."""
        return [(leaf.path, leaf.dtype, leaf.shape, leaf.sharded) for leaf in self.leaves]

    @staticmethod
    def from_list(items: list) -> Layout:
        """The inverse of :meth:`to_list`."""
        return Layout(tuple(Leaf(tuple(p), d, tuple(s), bool(h)) for p, d, s, h in items))


def buddy_stride(nodes: Sequence[int]) -> int:
    """The stride ``s`` that puts the buddy of every rank ``r``, rank ``(r + s) % world``, on another node
    than ``r`` (``nodes[r]`` is rank ``r``'s node): the smallest that does, so a node's loss never takes a
    shard with its copy; 1 when none does (one node, or a node with more than half of the ranks)."""
    world = len(nodes)
    for stride in range(1, world):
        if all(nodes[(rank + stride) % world] != nodes[rank] for rank in range(world)):
            return stride
    return 1


# ------------------------------------------------------------------------------ holdings and choice
@dataclass(frozen=True)
class Holding:
    """What one rank of a new generation holds, as it tells its peers at recovery.

    ``index``/``world``: its shard in the layout its state and copies are in (-1/0 for a joiner), which
    the generation ``layout_gen`` made; ``committed``: the step of its live state; ``own``: the steps of its
    two snapshots; ``buddy``: the steps of its two copies of shard ``index - stride``'s state.
    """

    committed: int
    index: int
    world: int
    own: tuple[int, int]
    buddy: tuple[int, int]
    layout_gen: int = 0
    stride: int = 1

    def to_list(self) -> list[int]:
        """Nine integers, for an all-gather."""
        return [self.committed, self.index, self.world, *self.own, *self.buddy, self.layout_gen, self.stride]

    @staticmethod
    def from_list(values: list[int]) -> Holding:
        """The inverse of :meth:`to_list`."""
        return Holding(values[0], values[1], values[2], (values[3], values[4]), (values[5], values[6]), values[7],
                       values[8])


NOTHING = Holding(INVALID, -1, 0, (INVALID, INVALID), (INVALID, INVALID), -1)
"""What a rank that holds no shard tells its peers (a joiner; a rank that found no saved shard to start from)."""


@dataclass(frozen=True)
class Source:
    """Where the new generation takes one old shard from: the rank holding it, and which copy."""

    rank: int
    kind: str  # LIVE, OWN or BUDDY
    slot: int = 0


@dataclass(frozen=True)
class Choice:
    """The step every rank returns to, the world its copies were made in, and each old shard's source."""

    step: int
    world: int
    sources: dict[int, Source]


def _copy_at(holding: Holding, step: int) -> tuple[str, int] | None:
    """Where ``holding``'s own shard of ``step`` is: live, or one of its snapshots."""
    if holding.committed == step:
        return LIVE, 0
    if step in holding.own:
        return OWN, holding.own.index(step)
    return None


def choose(holdings: list[Holding]) -> Choice | None:
    """The newest step at which every shard of the old world is held by a rank of the new generation.

    Each shard comes from its owner if it survived (live state first: no copy to make), else from its
    buddy's copy. None when some shard has no copy at any common step: its owner and its buddy were
    lost together (or nothing was ever copied); or when the survivors' states are in different layouts
    (a fault cut a recovery's re-sharding short on some ranks only).
    """
    survivors = [(rank, h) for rank, h in enumerate(holdings) if h.index >= 0]
    if not survivors or len({(h.layout_gen, h.world, h.stride) for _, h in survivors}) > 1:
        return None
    world, stride = survivors[0][1].world, survivors[0][1].stride
    by_index = {h.index: (rank, h) for rank, h in survivors}
    steps = {s for _, h in survivors for s in (h.committed, *h.own, *h.buddy) if s > INVALID}
    for step in sorted(steps, reverse=True):
        sources: dict[int, Source] = {}
        for index in range(world):
            owner = by_index.get(index)
            found = _copy_at(owner[1], step) if owner else None
            if found:
                sources[index] = Source(owner[0], *found)
                continue
            buddy = by_index.get((index + stride) % world)
            if buddy is None or step not in buddy[1].buddy:
                break
            sources[index] = Source(buddy[0], BUDDY, buddy[1].buddy.index(step))
        else:
            return Choice(step, world, sources)
    return None


def choose_saved(read: list[list[Holding]]) -> tuple[Choice, int] | None:
    """:func:`choose` over what the ranks read from saved shards, ``read[r]`` rank ``r``'s: one holding per file
    (a shard's snapshots and the copies of its giver's, no live state; a rank of a smaller world than the one
    that saved reads several), and the rank that sends the layout and the state's other values: the first
    holding a shard's own snapshot of the chosen step. A source's ``slot`` counts two per file read, in order.
    Only the save with the newest step counts: a directory may keep an older save's shards, of another world.
    None when no step is whole."""
    files = [(rank, k, holding) for rank, holdings in enumerate(read) for k, holding in enumerate(holdings)]
    saved = [h for _, _, h in files if h.index >= 0]
    if not saved:
        return None
    newest = max(saved, key=lambda h: max(*h.own, *h.buddy))
    key = (newest.layout_gen, newest.world, newest.stride)
    held = [h if (h.layout_gen, h.world, h.stride) == key else NOTHING for _, _, h in files]
    while (choice := choose(held)) is not None:  # over the files, each as if a rank
        owners = [source.rank for source in choice.sources.values() if source.kind == OWN]
        if owners:
            sources = {shard: Source(files[s.rank][0], s.kind, files[s.rank][1] * 2 + s.slot)
                       for shard, s in choice.sources.items()}
            return Choice(choice.step, choice.world, sources), files[min(owners)][0]
        held = [_without(h, choice.step) for h in held]  # no skeleton of that step: an older one
    return None


def _without(holding: Holding, step: int) -> Holding:
    """``holding`` with its copies of ``step`` left out."""
    drop = lambda steps: tuple(INVALID if s == step else s for s in steps)  # noqa: E731
    return replace(holding, own=drop(holding.own), buddy=drop(holding.buddy))


# ------------------------------------------------------------------------------ redistribution
@dataclass(frozen=True)
class Move:
    """Bytes of old shard ``shard`` that rank ``source`` sends to rank ``target`` of the new generation."""

    source: int
    target: int
    shard: int
    source_offset: int
    target_offset: int
    nbytes: int


def moves(layout: Layout, choice: Choice, new_world: int) -> list[Move]:
    """Every byte range each rank of ``new_world`` needs, in one order all ranks agree on.

    A sharded leaf's rows come from every old shard that overlaps the new rank's rows; a plain leaf comes
    whole from old shard 0's holder. No rank ever receives more than its own new shard.
    """
    old = [layout.offsets(i, choice.world) for i in range(choice.world)]
    result: list[Move] = []
    for target in range(new_world):
        new = layout.offsets(target, new_world)
        for position, leaf in enumerate(layout.leaves):
            start, stop = leaf.rows(target, new_world)
            shards = range(choice.world) if leaf.sharded else [0]
            for shard in shards:
                first, last = leaf.rows(shard, choice.world)
                low, high = max(start, first), min(stop, last)
                if high <= low or leaf.row_bytes == 0:
                    continue
                result.append(Move(choice.sources[shard].rank, target, shard,
                                   old[shard][position] + (low - first) * leaf.row_bytes,
                                   new[position] + (low - start) * leaf.row_bytes, (high - low) * leaf.row_bytes))
    return result
