"""Sharded (FSDP2) state: where each byte lives, which step a recovery returns to, and what moves where."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from ftrun.worker import redundancy
from ftrun.worker.shards import (BUDDY, INVALID, LIVE, OWN, Choice, Holding, Layout, Leaf, Source, buddy_stride,
                                 choose, choose_saved, chunk_rows, moves)

pytestmark = pytest.mark.fast

LAYOUT = Layout((Leaf(("model", "w"), torch.float32, (10, 3), True),
                 Leaf(("model", "b"), torch.float32, (3,), True),
                 Leaf(("optimizer", "state", 0, "step"), torch.float32, (), False),
                 Leaf(("optimizer", "state", 0, "exp_avg"), torch.float64, (7, 2), True)))


@pytest.mark.parametrize("rows", [0, 1, 3, 7, 10, 12])
@pytest.mark.parametrize("world", [1, 2, 3, 4, 5])
def test_rows_follow_torch_chunk_as_fsdp2_and_dtensor_shard(rows, world):
    chunks = torch.arange(rows).chunk(world) if rows else []
    for index in range(world):
        start, stop = chunk_rows(rows, index, world)
        expected = chunks[index].tolist() if index < len(chunks) else []
        assert list(range(start, stop)) == expected


def survivor(index: int, committed: int, own=(INVALID, INVALID), buddy=(INVALID, INVALID), world: int = 4,
             stride: int = 1) -> Holding:
    return Holding(committed, index, world, own, buddy, 0, stride)


@pytest.mark.parametrize("nodes, stride", [
    ([0, 0, 0, 0], 1),  # one node: the next rank
    ([0, 0, 1, 1], 2),  # two nodes of two: the same local rank on the other node
    ([0, 0, 0, 1, 1, 1], 3),
    ([0, 1, 2, 3], 1),  # one rank per node: the next rank is on the next node
    ([0, 0, 1, 1, 2, 2], 2),
    ([0, 0, 1, 2], 2),  # uneven nodes: 0->2, 1->3, 2->0, 3->1, each on another node
    ([0, 0, 0, 1], 1),  # a node with more than half of the ranks: no stride leaves it, the next rank it is
    ([0], 1), ([], 1),
])
def test_the_buddy_stride_puts_every_copy_on_another_node_where_the_nodes_allow(nodes, stride):
    assert buddy_stride(nodes) == stride
    if stride > 1 or len(set(nodes)) == len(nodes) > 1:
        assert all(nodes[(r + stride) % len(nodes)] != nodes[r] for r in range(len(nodes)))


def test_a_lost_node_takes_its_shards_from_the_copies_on_the_other_node():
    # two nodes of two, stride 2: node 1 (shards 2 and 3) is lost; shard 2's copy is on rank 0, shard 3's on 1
    held = [survivor(0, 7, (6, 7), (6, 7), stride=2), survivor(1, 7, (6, 7), (7, 6), stride=2)]
    choice = choose(held)
    assert choice.step == 7 and choice.sources == {0: Source(0, LIVE), 1: Source(1, LIVE), 2: Source(0, BUDDY, 1),
                                                   3: Source(1, BUDDY, 0)}
    assert choose([survivor(0, 7, (6, 7), (6, 7)), survivor(1, 7, (6, 7), (6, 7))]) is None  # with stride 1


def test_survivors_whose_copies_went_by_different_strides_are_not_mixed():
    held = [survivor(0, 7, (6, 7), (6, 7), stride=2), survivor(1, 7, (6, 7), (6, 7)), survivor(2, 7, (6, 7), (6, 7))]
    assert choose(held) is None


JOINER = Holding(INVALID, -1, 0, (INVALID, INVALID), (INVALID, INVALID), -1)


def test_a_holding_survives_the_trip_through_an_all_gather():
    holding = Holding(7, 2, 4, (6, 7), (INVALID, 7), 3, 2)
    assert Holding.from_list(holding.to_list()) == holding


def test_every_shard_live_needs_no_copy():
    choice = choose([survivor(i, 7, (6, 7), (6, 7)) for i in range(4)])
    assert choice.step == 7 and choice.sources == {i: Source(i, LIVE) for i in range(4)}


def test_a_lost_middle_shard_comes_from_its_buddys_copy():
    # shard 2 lost: rank (2 + 1) % 4 = old 3, now rank 2 of the survivors, holds its copy
    held = [survivor(0, 7, (6, 7), (6, 7)), survivor(1, 7, (6, 7), (6, 7)), survivor(3, 7, (6, 7), (7, 6))]
    choice = choose(held)
    assert choice.step == 7 and choice.world == 4
    assert choice.sources[2] == Source(2, BUDDY, 0) and choice.sources[3] == Source(2, LIVE)


def test_a_lost_rank_0_comes_from_rank_1s_copy_and_a_joiner_holds_nothing():
    choice = choose([survivor(1, 7, (6, 7), (6, 7)), survivor(2, 7, (6, 7), (6, 7)), survivor(3, 7, (6, 7), (6, 7)),
                     JOINER])
    assert choice.step == 7 and choice.sources[0] == Source(0, BUDDY, 1)
    assert all(source.rank != 3 for source in choice.sources.values())


def test_a_refresh_broken_off_by_the_fault_returns_everyone_to_the_previous_complete_copy():
    # shard 1 died while sending step 7: its buddy holds 6 only (7's slot never completed)
    held = [survivor(0, 7, (6, 7), (6, 7)), survivor(2, 7, (6, 7), (6, INVALID)), survivor(3, 7, (6, 7), (6, 7))]
    choice = choose(held)
    assert choice.step == 6
    assert choice.sources[1] == Source(1, BUDDY, 0) and choice.sources[0] == Source(0, OWN, 0)


def test_copies_every_k_steps_return_to_the_last_refresh():
    held = [survivor(0, 13, (4, 9), (4, 9)), survivor(1, 13, (4, 9), (4, 9)), survivor(2, 13, (4, 9), (4, 9))]
    assert choose(held).step == 9


def test_a_rank_lost_with_its_buddy_cannot_be_recovered_from_memory():
    assert choose([survivor(0, 7, (6, 7), (6, 7)), survivor(3, 7, (6, 7), (6, 7))]) is None  # shards 1 and 2
    assert choose([JOINER]) is None


def test_survivors_whose_states_are_in_different_layouts_are_not_mixed():
    # a fault cut the last re-sharding short: rank 0 loaded generation 3's layout, the others did not
    held = [Holding(7, 0, 3, (INVALID, INVALID), (INVALID, INVALID), 3), survivor(1, 7, (6, 7), (6, 7)),
            survivor(2, 7, (6, 7), (6, 7)), survivor(3, 7, (6, 7), (6, 7))]
    assert choose(held) is None


INVALID_PAIR = (INVALID, INVALID)


def saved(index: int, own: tuple[int, int], buddy: tuple[int, int], world: int = 4, layout_gen: int = 0) -> Holding:
    """What a rank read back from shard ``index``'s file: copies only, no live state."""
    return Holding(INVALID, index, world, own, buddy, layout_gen)


def test_ranks_saved_a_step_apart_resume_at_the_step_they_all_hold_and_a_rank_with_its_snapshot_sends_the_layout():
    # ranks 0 and 2 were stopped after committing 7, ranks 1 and 3 before: each kept the step before its last too
    read = [[saved(0, (7, 6), (7, 6))], [saved(1, (6, 5), (7, 6))], [saved(2, (7, 6), (6, 5))],
            [saved(3, (6, 5), (7, 6))]]
    choice, sender = choose_saved(read)
    assert choice.step == 6 and choice.sources == {i: Source(i, OWN, 1 if i % 2 == 0 else 0) for i in range(4)}
    assert sender == 0


def test_a_shard_whose_rank_died_comes_from_its_buddys_saved_copy_and_the_new_ranks_beyond_hold_nothing():
    read = [[saved(0, (4, 3), (4, 3))], [saved(1, (4, 3), (4, 3))], [], [saved(3, (4, 3), (4, 3))], [], []]
    choice, sender = choose_saved(read)
    assert (choice.step, choice.world, sender) == (4, 4, 0) and choice.sources[2] == Source(3, BUDDY, 0)
    assert choice.sources[0] == Source(0, OWN, 0)


def test_a_smaller_world_reads_several_files_a_rank_and_a_sources_slot_counts_two_per_file():
    # a save of 4 resumed by 2: rank 0 read shards 0 and 2, rank 1 shards 1 and 3
    read = [[saved(0, (7, 6), (7, 6)), saved(2, (6, 7), (7, 6))], [saved(1, (7, 6), (7, 6)), saved(3, (7, 6), (6, 7))]]
    choice, sender = choose_saved(read)
    assert (choice.step, choice.world, sender) == (7, 4, 0)
    assert choice.sources == {0: Source(0, OWN, 0), 1: Source(1, OWN, 0), 2: Source(0, OWN, 3), 3: Source(1, OWN, 2)}


def test_an_older_saves_shards_of_another_world_are_passed_over_and_a_missing_shard_leaves_no_whole_step():
    # shards 0-2 of a save of 3 ranks at step 9, and shard 3 left by an earlier save of 4 ranks at step 4
    read = [[saved(0, (9, 8), (9, 8), 3, 2)], [saved(1, (9, 8), (9, 8), 3, 2)], [saved(2, (9, 8), (9, 8), 3, 2)],
            [saved(3, (4, 3), (4, 3))]]
    assert choose_saved(read)[0] == Choice(9, 3, {i: Source(i, OWN, 0) for i in range(3)})
    assert choose_saved([[saved(0, (7, 6), INVALID_PAIR)], [saved(1, (7, 6), INVALID_PAIR)], []]) is None  # no 2
    assert choose_saved([[], []]) is None  # nothing saved



def test_a_step_held_only_in_buddies_copies_has_no_rank_to_send_its_layout():
    # every rank's own snapshots are older than the copies it holds of its giver's: no skeleton of step 8
    read = [[saved(i, (6, 5), (8, 7))] for i in range(4)]
    assert choose_saved(read)[0].step == 6


def flat_shards(layout: Layout, world: int, tensors: dict) -> list[torch.Tensor]:
    """Each shard's flat buffer, cut from the global tensors as FSDP2 would shard them."""
    result = []
    for index in range(world):
        parts = []
        for leaf in layout.leaves:
            start, stop = leaf.rows(index, world)
            piece = tensors[leaf.path] if not leaf.shape else tensors[leaf.path][start:stop]
            parts.append(piece.contiguous().reshape(-1).view(torch.uint8))
        result.append(torch.cat(parts) if parts else torch.empty(0, dtype=torch.uint8))
    return result


@pytest.mark.parametrize("old_world, new_world", [(4, 3), (4, 4), (3, 4), (4, 1), (2, 5)])
def test_moves_rebuild_every_new_shard_from_the_old_ones_and_nothing_more(old_world, new_world):
    generator = torch.Generator().manual_seed(0)
    tensors = {leaf.path: torch.randn(leaf.shape, generator=generator).to(leaf.dtype) for leaf in LAYOUT.leaves}
    old = flat_shards(LAYOUT, old_world, tensors)
    # shards held by ranks in reverse order, as after a loss and a re-ordering
    holders = {i: Source(new_world - 1 - i % new_world, LIVE) for i in range(old_world)}
    choice = Choice(5, old_world, holders)
    new = [torch.zeros(LAYOUT.nbytes(j, new_world), dtype=torch.uint8) for j in range(new_world)]
    received = [0] * new_world
    for move in moves(LAYOUT, choice, new_world):
        assert holders[move.shard].rank == move.source
        new[move.target][move.target_offset:move.target_offset + move.nbytes] = \
            old[move.shard][move.source_offset:move.source_offset + move.nbytes]
        received[move.target] += move.nbytes
    expected = flat_shards(LAYOUT, new_world, tensors)
    for j in range(new_world):
        assert torch.equal(new[j], expected[j]), j
        assert received[j] == LAYOUT.nbytes(j, new_world)  # every byte once: no rank holds more than its shard


def test_a_layout_survives_the_trip_to_a_joiner():
    assert Layout.from_list(LAYOUT.to_list()) == LAYOUT


@pytest.fixture
def world_of_one(free_port):
    """A default group of this process alone (the meshes below need one)."""
    store = dist.TCPStore("127.0.0.1", free_port(), 1, True)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_only_fsdp2s_one_dimensional_dim_0_sharding_is_accepted(world_of_one):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    flat = init_device_mesh("cpu", (1,))
    assert redundancy.refusal(distribute_tensor(torch.ones(4, 2), flat, [Shard(0)]), 1) is None
    tensor_parallel = redundancy.refusal(distribute_tensor(torch.ones(4, 2), flat, [Shard(1)]), 1)
    replicated = redundancy.refusal(distribute_tensor(torch.ones(4, 2), flat, [Replicate()]), 1)
    hsdp = redundancy.refusal(distribute_tensor(torch.ones(4, 2), init_device_mesh("cpu", (1, 1)),
                                                [Replicate(), Shard(0)]), 1)
    for reason in (tensor_parallel, replicated, hsdp):
        assert reason.startswith("ftrun: sharded state must be FSDP2") and "\n" not in reason
    assert "2-D device mesh" in hsdp and "Shard(dim=1)" in tensor_parallel
    assert "a mesh of 1 of the 2 ranks" in redundancy.refusal(distribute_tensor(torch.ones(2), flat, [Shard(0)]), 2)


def test_ftruns_refresh_every_overrides_the_scripts_and_a_bad_value_is_one_line():
    refresh_interval = redundancy.refresh_interval
    assert refresh_interval(1, None) == 1 and refresh_interval(5, None) == 5  # no flag: the script's
    assert refresh_interval(1, "10") == 10 and refresh_interval(5, "0") == 0  # the flag wins
    with pytest.raises(ValueError, match="FTRUN_REFRESH_EVERY='-3' is not a number of steps"):
        refresh_interval(1, "-3")
