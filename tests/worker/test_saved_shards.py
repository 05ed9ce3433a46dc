"""Sharded state on disk: what a rank writes of its copies, and what it reads back (or why it reads nothing)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from ftrun.worker import saved_shards
from ftrun.worker.redundancy import Slot
from ftrun.worker.shards import INVALID, Holding, Layout, Leaf

pytestmark = pytest.mark.fast

LAYOUT = Layout((Leaf(("model", "w"), torch.float32, (10, 3), True),
                 Leaf(("optimizer", "state", 0, "step"), torch.float32, (), False)))
SKELETON = {"model": {"w": None}, "optimizer": {"state": {0: {"step": None}}, "param_groups": [{"lr": 0.1}]}}


def holder(index: int = 1, world: int = 4, stride: int = 1, own: tuple = (7, 6), buddy: tuple = (7, INVALID)):
    """What a rank's redundancy holds: copies of shard ``index`` (steps ``own``) and of its giver's (``buddy``)."""
    def slots(steps: tuple, shard: int, skeleton: object) -> list[Slot]:
        return [Slot(torch.full((LAYOUT.nbytes(shard, world),), step % 256, dtype=torch.uint8), step, skeleton)
                for step in steps]
    return SimpleNamespace(index=index, world=world, stride=stride, layout_gen=3, layout=LAYOUT,
                           own=slots(own, index, SKELETON), buddy=slots(buddy, (index - stride) % world, None))


def test_a_rank_writes_its_complete_copies_and_reads_back_what_it_tells_its_peers(tmp_path):
    assert saved_shards.write(holder(), tmp_path, copies=True) == 7
    back = saved_shards.read(tmp_path, 1)
    assert back.holding == Holding(INVALID, 1, 4, (7, 6), (7, INVALID), 3, 1)
    assert back.layout == LAYOUT and [s.step for s in back.own] == [7, 6] and [s.step for s in back.buddy] == [7]
    assert back.own[0].skeleton == SKELETON and torch.equal(back.own[1].buffer, holder().own[1].buffer)
    assert saved_shards.read(tmp_path, 2) is None  # nothing saved for shard 2: no line either


def test_a_rank_reads_the_shards_its_place_in_a_smaller_world_gives_it(tmp_path):
    for index in range(4):
        saved_shards.write(holder(index=index), tmp_path, copies=False)
    (tmp_path / "shards" / "x.pt").write_bytes(b"")  # not a shard's name: not read
    assert [s.holding.index for s in saved_shards.read_for(tmp_path, 1, 2)] == [1, 3]
    assert [s.holding.index for s in saved_shards.read_for(tmp_path, 2, 6)] == [2]
    assert saved_shards.read_for(tmp_path, 5, 6) == [] and saved_shards.read_for(tmp_path / "none", 0, 1) == []
    own, buddy = saved_shards.slots_of(saved_shards.read_for(tmp_path, 0, 2))
    assert [s.step for s in own] == [7, 6, 7, 6] and [s.step for s in buddy] == [INVALID] * 4


def test_a_rank_with_no_copy_of_a_committed_step_writes_nothing(tmp_path):
    assert saved_shards.write(holder(own=(-1, INVALID)), tmp_path, copies=True) == -1  # only the initial state
    assert not (tmp_path / "shards").exists()


def test_without_copies_a_rank_writes_its_own_shards_snapshots_only(tmp_path):
    assert saved_shards.write(holder(), tmp_path, copies=False) == 7
    assert saved_shards.read(tmp_path, 1).holding == Holding(INVALID, 1, 4, (7, 6), (INVALID, INVALID), 3, 1)


def bad_files():
    data = lambda **change: {"index": 1, "world": 4, "layout_gen": 0, "stride": 1, "layout": LAYOUT.to_list(),  # noqa: E731
                             "own": [{"step": 7, "skeleton": SKELETON,
                                      "data": torch.zeros(LAYOUT.nbytes(1, 4), dtype=torch.uint8)}],
                             "buddy": [], **change}
    return {
        "a list": ([1, 2], "not a saved shard (a list, not a dict)"),
        "a float world": (data(world=4.0), "its index, world, generation and stride are not all whole numbers"),
        "an index past its world": (data(index=4), "shard 4 of a world of 4 with buddy stride 1 is no shard"),
        "a huge world": (data(world=1 << 40), "is no shard of a world"),
        "a layout of strings": (data(layout=["w"]), "its layout is not a list of tensors' paths, types and shapes"),
        "three copies": (data(own=[{}, {}, {}]), "its own copies are not a list of at most 2"),
        "a copy without step": (data(buddy=[{"data": torch.zeros(3)}]), "a copy in buddy has no committed step"),
        "a short copy": (data(own=[{"step": 7, "skeleton": None, "data": torch.zeros(3, dtype=torch.uint8)}]),
                         "a copy in own is not the 40 bytes its layout says"),
        "another shard": (data(index=2, own=[]), "it holds shard 2, not shard 1"),
    }


@pytest.mark.parametrize("name", list(bad_files()))
def test_a_file_that_is_not_a_saved_shard_is_skipped_in_one_line(tmp_path, capsys, name):
    value, why = bad_files()[name]
    path = saved_shards.path_of(tmp_path, 1)
    path.parent.mkdir()
    torch.save(value, path)
    assert saved_shards.read(tmp_path, 1) is None
    err = capsys.readouterr().err
    assert err.startswith(f"ftrun: skipping rescue file {path}: ") and why in err and err.count("\n") == 1, err


def test_a_pickle_that_would_run_code_is_refused_not_run(tmp_path, capsys):
    path = saved_shards.path_of(tmp_path, 0)
    path.parent.mkdir()
    torch.save(SimpleNamespace(), path)  # a class the weights-only unpickler does not allow
    assert saved_shards.read(tmp_path, 0) is None
    err = capsys.readouterr().err
    assert err.startswith(f"ftrun: skipping rescue file {path}: UnpicklingError") and err.count("\n") == 1, err
