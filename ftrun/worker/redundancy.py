"""FSDP2 state kept redundant in host memory, and recovered from it: no disk, no rank holding the whole state.

After every ``every``-th committed step each rank packs its local shards (model and optimizer: see
:mod:`ftrun.worker.shards`) into one of its two own snapshot slots and sends that slot to its buddy,
rank ``(r + s) % world``, on the control plane, from a thread of its own; it receives its giver's (rank
``r - s``) into one of two buddy slots. The stride ``s`` puts the buddy on another node wherever the
generation's nodes allow (:func:`~ftrun.worker.shards.buddy_stride`). A slot is written only while it is not the newest complete one,
and marked with its step only once complete, so a fault during a refresh leaves the previous copy usable.

At recovery the ranks of the new generation all-gather what they hold (:class:`~ftrun.worker.shards.Holding`),
all pick the same step (:func:`~ftrun.worker.shards.choose`), move byte ranges point to point to their new
shards (:func:`~ftrun.worker.shards.moves`), rebuild the model and optimizer over the new group with the
user's ``rebuild`` (``fully_shard`` over the current world) and load them. Only FSDP2 over a 1-D mesh of
every rank (``Shard(0)``) is accepted: :func:`refusal` says why any other layout is not.
"""

from __future__ import annotations

import io
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from ftrun.protocol import node_of
from ftrun.worker import shards, transfer
from ftrun.worker.shards import INVALID, NOTHING, Choice, Holding, Layout, Leaf
from ftrun.worker.state import Stateful

Rebuild = Callable[[], dict[str, Stateful]]
"""Builds the protected objects anew over the current default group (``fully_shard`` and its optimizer)."""

UNSUPPORTED = ("ftrun: sharded state must be FSDP2 (fully_shard) over a 1-D mesh of all ranks, sharded along "
               "dim 0; {what} is not supported (HSDP's 2-D mesh, tensor or sequence parallel layouts are refused)")


def _dtensor_type() -> type | None:
    """torch's DTensor class, where this torch has one."""
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:
        return None
    return DTensor


def is_sharded(tensor: Any) -> bool:
    """Whether ``tensor`` is a DTensor (a shard of a larger tensor, or a replica over a mesh)."""
    dtensor = _dtensor_type()
    return dtensor is not None and isinstance(tensor, dtensor)


def refusal(tensor: Any, world: int) -> str | None:
    """Why the DTensor ``tensor`` cannot be kept redundant, or None when it can (FSDP2 over all ranks)."""
    mesh, placements = tensor.device_mesh, tuple(tensor.placements)
    if mesh.ndim != 1:
        return UNSUPPORTED.format(what=f"a {mesh.ndim}-D device mesh")
    if mesh.size() != world:
        return UNSUPPORTED.format(what=f"a mesh of {mesh.size()} of the {world} ranks")
    if len(placements) != 1 or not placements[0].is_shard() or getattr(placements[0], "dim", None) != 0 \
            or type(placements[0]).__name__ != "Shard":
        return UNSUPPORTED.format(what=f"placement {placements}")
    return None


def local_state(objects: dict[str, Stateful], world: int) -> tuple[Any, Layout, list[torch.Tensor]]:
    """Every object's state: its skeleton (tensors replaced by None), its layout, and the local tensors.

    Raises ValueError with one line for a layout that cannot be kept redundant.
    """
    nest = {name: obj.state_dict() for name, obj in objects.items()}
    leaves: list[Leaf] = []
    tensors: list[torch.Tensor] = []
    for path, tensor in transfer.leaves(nest):
        sharded = is_sharded(tensor)
        if sharded:
            reason = refusal(tensor, world)
            if reason:
                raise ValueError(reason)
        leaves.append(Leaf(path, tensor.dtype, tuple(tensor.shape), sharded))
        tensors.append(tensor.to_local() if sharded else tensor)
    skeleton = transfer.replace_leaves(nest, lambda _, leaf: None if isinstance(leaf, torch.Tensor) else leaf)
    return skeleton, Layout(tuple(leaves)), tensors


def _pack(tensors: list[torch.Tensor], offsets: list[int], into: torch.Tensor) -> None:
    """Copy the local tensors into a flat byte buffer at their offsets."""
    for tensor, offset in zip(tensors, offsets):
        data = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
        into[offset:offset + data.numel()].copy_(data)


def _encode(value: Any) -> torch.Tensor:
    buffer = io.BytesIO()
    torch.save(value, buffer)
    return torch.frombuffer(bytearray(buffer.getvalue()), dtype=torch.uint8)


@dataclass
class Slot:
    """One copy of a shard's state: its flat bytes, the step it is of (INVALID while incomplete), its skeleton."""

    buffer: torch.Tensor
    step: int = INVALID
    skeleton: Any = None


def _stride(members: list[int]) -> int:
    """The buddy stride of a generation of these worker uids (rank order), from the node each started on."""
    return shards.buddy_stride([node_of(uid) for uid in members])


def refresh_interval(script: int, launcher: str | None) -> int:
    """Every how many committed steps the copies are refreshed: ftrun's ``--refresh-every`` (FTRUN_REFRESH_EVERY,
    ``launcher``) when it was given, else the script's ``refresh_every``."""
    if launcher is None:
        return script
    if not launcher.isdigit():
        raise ValueError(f"ftrun: FTRUN_REFRESH_EVERY={launcher[:20]!r} is not a number of steps")
    return int(launcher)


class Redundancy:
    """The protected sharded state of this rank, its snapshots and its buddy's copy; refresh and recovery.

    ``issue`` starts a control-plane operation unless the generation was abandoned (it raises then);
    ``members`` are the worker uids of the current generation, in rank order.
    """

    def __init__(self, objects: dict[str, Stateful], rebuild: Rebuild, every: int,
                 issue: Callable[[Callable[[], dist.Work]], dist.Work], members: list[int]) -> None:
        if every < 0:
            raise ValueError(f"ftrun: refresh_every must be 0 (no copies) or more, not {every}")
        self.objects = objects
        self.rebuild = rebuild
        self.every = every
        self._issue = issue
        _, self.layout, _ = local_state(objects, dist.get_world_size())
        self.index, self.world = dist.get_rank(), dist.get_world_size()
        self.layout_gen = 0  # the generation whose re-sharding made the current layout
        self.stride = _stride(members)  # the buddy is rank index + stride
        self.own: list[Slot] = []
        self.buddy: list[Slot] = []
        self._thread: threading.Thread | None = None

    @property
    def extra_bytes(self) -> int:
        """Host memory this rank holds for redundancy: its two snapshots and its two copies of the giver's."""
        return sum(slot.buffer.numel() for slot in (*self.own, *self.buddy))

    # ------------------------------------------------------------------ refresh
    def due(self, step: int) -> bool:
        """Whether committed ``step`` is refreshed (every ``every``-th step; step -1 is the initial state;
        never with ``every`` 0: then a lost shard is in no memory, and a fault restarts the group)."""
        return self.every > 0 and (step < 0 or (step + 1) % self.every == 0)

    def refresh(self, step: int, control: dist.ProcessGroup) -> None:
        """Snapshot the live state as of ``step`` and start sending it to the buddy (the previous refresh
        is waited for first: its slot must not be overwritten while it is in flight)."""
        self.wait()
        if self.world < 2:
            return
        skeleton, layout, tensors = local_state(self.objects, self.world)
        if layout != self.layout or not self.own:  # the first optimizer step creates its state: copies restart
            self.layout = layout
            self._allocate(report=step >= 0)
        own = min(self.own, key=lambda slot: slot.step)
        own.step = INVALID
        _pack(tensors, self.layout.offsets(self.index, self.world), own.buffer)
        own.step, own.skeleton = step, skeleton
        buddy = min(self.buddy, key=lambda slot: slot.step)
        buddy.step = INVALID  # being overwritten: the other slot is the complete one
        right, left = (self.index + self.stride) % self.world, (self.index - self.stride) % self.world
        try:  # issued here, not on the thread: a thread late to start would issue on a generation since aborted
            works = [self._issue(lambda: control.recv([buddy.buffer], left, 0)),
                     self._issue(lambda: control.send([own.buffer], right, 0))]
        except Exception:  # noqa: BLE001 -- a newer plan came or a peer is gone: no copy; recovery follows
            return
        self._thread = threading.Thread(target=self._exchange, args=(step, buddy, works), name="ftrun-refresh",
                                        daemon=True)
        self._thread.start()

    def copied(self, step: int) -> bool:
        """Whether the giver's state of ``step`` is complete here (always, in a world of one)."""
        return self.world < 2 or any(slot.step == step for slot in self.buddy)

    def wait(self, timeout: float | None = None) -> None:
        """Wait for the refresh in flight, if any (an aborted generation makes it end at once)."""
        if self._thread is not None:
            self._thread.join(timeout)
            if not self._thread.is_alive():
                self._thread = None

    def _exchange(self, step: int, buddy: Slot, works: list[dist.Work]) -> None:
        """On the refresh thread: wait for our snapshot's send to the buddy and the giver's into ``buddy``;
        mark it complete (an aborted generation fails both at once)."""
        try:
            for work in works:
                work.wait()
        except Exception:  # noqa: BLE001 -- any failure leaves the slot incomplete; recovery follows
            return
        buddy.step = step

    def _allocate(self, report: bool) -> None:
        """Two snapshot slots of this rank's shard, two buddy slots of the giver's; rank 0 says how large
        once the state is complete (the optimizer's state appears at its first step)."""
        giver = (self.index - self.stride) % self.world
        self.own = [Slot(torch.empty(self.layout.nbytes(self.index, self.world), dtype=torch.uint8))
                    for _ in range(2)]
        self.buddy = [Slot(torch.empty(self.layout.nbytes(giver, self.world), dtype=torch.uint8))
                      for _ in range(2)]
        if report and self.index == 0:
            print(f"ftrun: sharded state kept redundant in host memory every {self.every} step(s): "
                  f"{self.extra_bytes} extra bytes on rank 0 (2 snapshots of its shard, 2 copies of its "
                  f"buddy's)", file=sys.stderr, flush=True)

    # ------------------------------------------------------------------ recovery
    def holding(self, committed: int, joiner: bool) -> Holding:
        """What this rank holds, for the agreement (a joiner holds nothing)."""
        if joiner:
            return NOTHING
        steps = lambda slots: tuple(s.step for s in slots) if slots else (INVALID, INVALID)  # noqa: E731
        return Holding(committed, self.index, self.world, steps(self.own), steps(self.buddy), self.layout_gen,
                       self.stride)

    def adopt(self, layout: Layout, own: list[Slot], buddy: list[Slot]) -> None:
        """Hold the copies read back from disk (:mod:`ftrun.worker.saved_shards`) as this rank's, for
        :meth:`restore` to send from: two slots of each kind per file read, and the layout of the files it
        sends from."""
        self.layout, self.own, self.buddy = layout, own, buddy

    def restore(self, choice: Choice, control: dist.ProcessGroup, gen: int, members: list[int],
                sender: int = 0) -> None:
        """Move the chosen copies to the new shards over ``control``, rebuild the objects (in the protected
        mapping, by name) and load them; the copies from now on go to buddies placed over the nodes of
        ``members`` (generation ``gen``'s worker uids, in rank order). Rank ``sender`` sends the layout and the
        state's other values (a survivor: rank 0 at a recovery).

        Peak memory beyond the redundancy slots: this rank's new shard twice (received, then loaded).
        """
        rank, world = dist.get_rank(), dist.get_world_size()
        layout, skeleton = self._agree_layout(choice, control, rank, sender)
        plan = shards.moves(layout, choice, world)
        sources = self._sources(choice, rank)
        received = torch.empty(layout.nbytes(rank, world), dtype=torch.uint8)
        ops: list[tuple[torch.Tensor, int, bool]] = []
        for move in plan:
            if move.source == rank:
                data = sources[move.shard][move.source_offset:move.source_offset + move.nbytes]
                if move.target == rank:
                    received[move.target_offset:move.target_offset + move.nbytes].copy_(data)
                else:
                    ops.append((data, move.target, True))
            elif move.target == rank:
                ops.append((received[move.target_offset:move.target_offset + move.nbytes], move.source, False))
        transfer.p2p_on_backend(control)(ops)
        del sources
        self.objects.update(self.rebuild())
        self._load(layout, skeleton, received, rank, world)
        self.layout, self.index, self.world, self.layout_gen = layout, rank, world, gen
        self.stride = _stride(members)
        self.own, self.buddy = [], []

    def _sources(self, choice: Choice, rank: int) -> dict[int, torch.Tensor]:
        """The flat copies of old shards this rank sends from (its live state is packed for the occasion)."""
        result = {}
        for shard, source in choice.sources.items():
            if source.rank != rank:
                continue
            if source.kind == shards.LIVE:
                _, _, tensors = local_state(self.objects, self.world)
                flat = torch.empty(self.layout.nbytes(self.index, self.world), dtype=torch.uint8)
                _pack(tensors, self.layout.offsets(self.index, self.world), flat)
                result[shard] = flat
            else:
                result[shard] = (self.own if source.kind == shards.OWN else self.buddy)[source.slot].buffer
        return result

    def _agree_layout(self, choice: Choice, control: dist.ProcessGroup, rank: int, sender: int) -> tuple[Layout, Any]:
        """Rank ``sender`` sends the layout and the skeleton of the chosen step to every other rank."""
        world = dist.get_world_size()
        if rank == sender:
            skeleton = self._skeleton(choice.step)
            payload = _encode({"layout": self.layout.to_list(), "skeleton": skeleton})
            transfer.send_bytes(transfer.p2p_on_backend(control), payload, [r for r in range(world) if r != sender])
            return self.layout, skeleton
        loaded = transfer.load_peer_bytes(transfer.receive_bytes(transfer.p2p_on_backend(control), sender))
        items = transfer.described_tensors(loaded, "layout")
        if items is None:
            raise transfer.MalformedState(f"the layout of the sharded state from rank {sender} is not one this worker "
                                          "reads")
        return Layout.from_list(items), loaded["skeleton"]

    def _skeleton(self, step: int) -> Any:
        """The skeleton (every non-tensor value) of this rank's state at ``step``: live or a snapshot."""
        for slot in self.own:
            if slot.step == step:
                return slot.skeleton
        return local_state(self.objects, self.world)[0]

    def _load(self, layout: Layout, skeleton: Any, received: torch.Tensor, rank: int, world: int) -> None:
        """Load the received shard into the rebuilt objects: sharded leaves as DTensors on their new mesh."""
        from torch.distributed.tensor import DTensor, Shard

        nest = {name: obj.state_dict() for name, obj in self.objects.items()}
        mesh, device = next(((t.device_mesh, t.to_local().device) for _, t in transfer.leaves(nest) if is_sharded(t)),
                            (None, torch.device("cpu")))
        offsets = layout.offsets(rank, world)
        by_path = {}
        for leaf, offset in zip(layout.leaves, offsets):
            local_shape = leaf.local_shape(rank, world)
            data = received[offset:offset + leaf.nbytes(rank, world)].view(leaf.dtype).reshape(local_shape).clone()
            if leaf.sharded:
                stride = torch.empty(leaf.shape, device="meta").stride()
                data = DTensor.from_local(data.to(device), mesh, [Shard(0)], run_check=False,
                                          shape=torch.Size(leaf.shape), stride=stride)
            by_path[leaf.path] = data
        state = transfer.replace_leaves(skeleton, lambda path, leaf: by_path.get(path, leaf))
        for name, obj in self.objects.items():
            obj.load_state_dict(state[name])
