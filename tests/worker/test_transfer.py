"""State transfer and rescue files: code-free manifests, bounded buckets, in-place receives, real Gloo."""

from __future__ import annotations

import io
import os
import pickle
import threading
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from ftrun.worker import backends, transfer
from ftrun.worker.state import best_rescue, load_into, save_rescue, snapshot

pytestmark = pytest.mark.fast


def make_training(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer, torch.optim.lr_scheduler.StepLR]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(200, 300), torch.nn.BatchNorm1d(300), torch.nn.Linear(300, 10))
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2)
    for _ in range(3):
        model(torch.randn(8, 200)).square().sum().backward()
        optimizer.step()
        scheduler.step()
    return model, optimizer, scheduler


def objects(seed: int) -> dict:
    model, optimizer, scheduler = make_training(seed)
    return {"model": model, "optimizer": optimizer, "scheduler": scheduler}


def assert_same_state(a: dict, b: dict) -> None:
    for name in a:
        left, right = a[name].state_dict(), b[name].state_dict()
        flat_left, flat_right = dict(transfer.leaves(left)), dict(transfer.leaves(right))
        assert flat_left.keys() == flat_right.keys(), name
        for path, tensor in flat_left.items():
            assert torch.equal(tensor, flat_right[path]), (name, path)
    assert a["scheduler"].state_dict() == b["scheduler"].state_dict()


# ------------------------------------------------------------------------------ pure parts
def test_manifest_carries_small_tensors_and_plain_values_and_references_the_large_ones():
    state = snapshot(objects(0), 7)
    data, specs, tensors = transfer.manifest(state)
    skeleton, read = transfer.read_manifest(data)
    assert read == specs and len(tensors) == len(specs)
    assert all(spec.nbytes > transfer.INLINE_BYTES for spec in specs)  # the (300, 200) weight and Adam's moments
    assert {spec.path[:2] for spec in specs} == {("state", "model"), ("state", "optimizer")}
    assert len(data) < sum(spec.nbytes for spec in specs) / 5  # the bulk is not in the manifest
    assert skeleton["step"] == 7 and skeleton["state"]["scheduler"] == state["state"]["scheduler"]
    assert hasattr(skeleton["state"]["model"], "_metadata")  # a module's state_dict versions survive


def test_a_manifest_that_would_run_code_is_refused():
    class Payload:
        def __reduce__(self):
            return (os.system, ("echo owned",))

    data = pickle.dumps({"skeleton": Payload(), "specs": []}, protocol=2)
    with pytest.raises(transfer.MalformedState, match="do not load as state .UnpicklingError: Weights only load"):
        transfer.read_manifest(data)


def saved(value) -> bytes:
    buffer = io.BytesIO()
    torch.save(value, buffer)
    return buffer.getvalue()


@pytest.mark.parametrize("data", [
    b"", b"\x80\x02garbage", saved([1, 2]), saved({"skeleton": {}}), saved({"skeleton": {}, "specs": [("w",)]}),
    saved({"skeleton": {}, "specs": [(("w",), "float32", (2,), "cpu")]}),  # a dtype's name, not a dtype
    saved({"skeleton": {}, "specs": [(("w",), torch.float32, (-1,), "cpu")]}),
    saved({"skeleton": {}, "specs": [(("w",), torch.float32, (2.0,), "cpu")]}),
])
def test_a_manifest_that_is_not_one_is_a_failed_transfer_not_an_exception_past_the_recovery(data):
    """A peer of another version, or bytes that are not ftrun's: MalformedState in one line, with which the
    receiver ends (Session: a retry would get the same bytes), never torch's KeyError or TypeError."""
    with pytest.raises(transfer.MalformedState) as refused:
        transfer.read_manifest(data)
    assert "\n" not in str(refused.value)


class MyScheduleState:
    """A type in a state_dict that torch.serialization.add_safe_globals has not allowed."""


def test_a_type_torch_does_not_load_is_named_in_the_one_line():
    with pytest.raises(transfer.MalformedState, match="WeightsUnpickler error: Unsupported global: .*MyScheduleState"):
        transfer.read_manifest(saved({"skeleton": MyScheduleState(), "specs": []}))


def test_a_reference_to_no_tensor_or_a_size_no_buffer_takes_is_a_failed_transfer():
    with pytest.raises(transfer.MalformedState, match="refers to tensor 3 of 1"):
        transfer.fill({"w": (transfer.REF, 3)}, [torch.zeros(1)])
    huge = transfer.TensorSpec(("w",), torch.float32, (2**62,), "cpu")
    with pytest.raises(transfer.MalformedState, match="cannot be allocated here"):
        transfer.targets([huge], {}, {"cpu": torch.device("cpu")})

    def announce(size: int):  # the source's side of the first exchange: how many bytes follow
        return lambda ops: ops[0][0].fill_(size)

    for size in (-1, 2**62):
        with pytest.raises(transfer.MalformedState, match=f"the source announced {size} bytes"):
            transfer.receive_bytes(announce(size), 0)


def test_buckets_group_consecutive_tensors_of_one_device_up_to_the_bound():
    spec = lambda n, device="cpu": transfer.TensorSpec((), torch.float32, (n,), device)  # noqa: E731
    specs = [spec(5), spec(5), spec(30), spec(4, "cuda"), spec(4, "cuda"), spec(2), spec(100), spec(1), spec(24)]
    assert transfer.buckets(specs, bucket_bytes=100) == [[0, 1], [2], [3, 4], [5], [6], [7], [8]]
    # sizes are in float32 elements: 5 -> 20 bytes, a quarter bucket is 25 bytes
    assert transfer.buckets([], 100) == []


def test_targets_receive_in_place_where_the_receiver_has_a_matching_tensor():
    own = snapshot(objects(1), -2)
    _, specs, _ = transfer.manifest(snapshot(objects(0), 3))
    into = transfer.targets(specs, own, {"cpu": torch.device("cpu")})
    mine = dict(transfer.leaves(own))
    assert all(t.data_ptr() == mine[s.path].data_ptr() for t, s in zip(into, specs))
    fresh = transfer.targets(specs, snapshot({"model": objects(1)["model"]}, -2), {"cpu": torch.device("cpu")})
    assert not any(s.path[1] == "optimizer" and t.data_ptr() in {m.data_ptr() for m in mine.values()}
                   for t, s in zip(fresh, specs))


def test_gloo_moves_only_cpu_tensors_point_to_point():
    # ProcessGroupGloo::send hands the tensor's pointer to TCP as host memory: CUDA tensors must be staged
    assert backends.moves_point_to_point("gloo") == {"cpu"}
    assert backends.moves_point_to_point("cuda:gloo") == set()
    assert backends.moves_point_to_point("nccl") == {"cuda"}
    assert backends.moves_point_to_point("cpu:gloo,cuda:nccl") == {"cpu", "cuda"}


# ------------------------------------------------------------------------------ over real Gloo
@pytest.mark.parametrize(("bucket_bytes", "staged"), [(transfer.BUCKET_BYTES, False), (150_000, False),
                                                     (150_000, True)])
def test_a_rank_behind_receives_the_sources_state_over_gloo(free_port, bucket_bytes, staged):
    # two ranks in two threads, each with a data and a control Gloo group; the receiver is a fresh
    # joiner (no optimizer state yet): its model is received in place, its moments into new tensors.
    # Staged: through host buffers, as CUDA tensors travel on a Gloo data plane
    store = dist.TCPStore("127.0.0.1", free_port(), is_master=True, wait_for_workers=False)
    source, receiver = objects(0), objects(1)
    receiver["optimizer"] = torch.optim.Adam(receiver["model"].parameters(), lr=0.01)
    receiver["scheduler"] = torch.optim.lr_scheduler.StepLR(receiver["optimizer"], step_size=2)
    weight_before = receiver["model"][0].weight.data_ptr()
    result: dict = {}

    def rank(r: int) -> None:
        client = dist.TCPStore("127.0.0.1", store.port, is_master=False)  # one client per rank, as in a process
        groups = {plane: dist.ProcessGroupGloo(dist.PrefixStore(plane, client), r, 2, timedelta(seconds=30))
                  for plane in ("data", "control")}
        data = transfer.p2p_on_backend(groups["data"])
        route = transfer.Route({"cpu": transfer.via_host(data) if staged else data}, {"cpu": torch.device("cpu")},
                               transfer.p2p_on_backend(groups["control"]))
        if r == 0:
            transfer.send(snapshot(source, 5), [1], route, bucket_bytes)
        else:
            result["step"] = load_into(transfer.receive(0, snapshot(receiver, -2), route, bucket_bytes), receiver)

    threads = [threading.Thread(target=rank, args=(r,)) for r in (0, 1)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert result.get("step") == 5
    assert_same_state(source, receiver)
    assert receiver["model"][0].weight.data_ptr() == weight_before  # received in place


# ------------------------------------------------------------------------------ rescue files
class MakesAFolder:
    """Unpickled, it would make the folder ``path``: a rescue file that runs code when it is loaded."""

    def __init__(self, path) -> None:
        self.path = str(path)

    def __reduce__(self):
        return (os.mkdir, (self.path,))


def test_best_rescue_skips_unreadable_files_with_one_line_each(tmp_path, capsys):
    save_rescue(objects(0), 4, tmp_path / "0.pt")
    save_rescue(objects(0), 6, tmp_path / "1.pt")
    (tmp_path / "2.pt").write_bytes(b"truncated by a kill mid-write")
    (tmp_path / "3.pt").write_bytes(pickle.dumps({"step": 99, "state": os.system}, protocol=2))  # code, never run
    torch.save({"step": 99, "state": {"model": MakesAFolder(tmp_path / "owned")}}, tmp_path / "4.pt")
    best = best_rescue(tmp_path)
    assert best is not None and best["step"] == 6
    assert not (tmp_path / "owned").exists()  # loaded with weights_only: the pickle's call was refused, not run
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 3 and all(line.startswith("ftrun: skipping rescue file ") for line in lines), lines
    restored = objects(1)
    assert load_into(best, restored) == 6


def test_best_rescue_of_no_committed_state_is_none_and_says_the_worker_starts_from_scratch(tmp_path, capsys):
    """Every file skipped, or none holding a committed step (-1: saved before the first commit), made the run
    start from step 0 and succeed without a word: one line says so."""
    save_rescue(objects(0), -1, tmp_path / "0.pt")
    (tmp_path / "1.pt").write_bytes(b"")
    assert best_rescue(tmp_path) is None
    lines = capsys.readouterr().err.splitlines()
    assert lines == [f"ftrun: skipping rescue file {tmp_path / '1.pt'}: EOFError",
                     (f"ftrun: no rescue file in {tmp_path} holds a committed state to resume from: this worker "
                      "starts from scratch (step 0) unless another rank resumes one")], lines


@pytest.mark.timeout(30)
def test_a_rescue_file_that_is_not_a_regular_file_is_skipped_not_waited_on_nor_read_without_end(tmp_path, capsys):
    """A FIFO named like a rescue file held every worker of a --resume-from launch in open() for ever; a link to
    /dev/zero or a directory is no saved state either. Each is one line, and the regular file is used."""
    save_rescue(objects(0), 4, tmp_path / "0.pt")
    os.mkfifo(tmp_path / "1.pt")
    (tmp_path / "2.pt").symlink_to("/dev/zero")
    (tmp_path / "3.pt").mkdir()
    best = best_rescue(tmp_path)
    assert best is not None and best["step"] == 4
    assert capsys.readouterr().err.splitlines() == [
        f"ftrun: skipping rescue file {tmp_path / name}: not a regular file" for name in ("1.pt", "2.pt", "3.pt")]


@pytest.mark.parametrize("content, reason", [
    ({"step": "9", "state": {}}, "its step is a str, not an int"),
    ({"step": 9.5, "state": {}}, "its step is a float, not an int"),
    ({"step": True, "state": {}}, "its step is a bool, not an int"),
    ({"step": torch.tensor(9), "state": {}}, "its step is a Tensor, not an int"),
    ({"step": 2**70, "state": {}}, "its step is out of range"),
    ({"step": 1e300, "state": {}}, "its step is a float, not an int"),
    ({"step": 9}, "its state is not a dict of state dicts by name"),
    ({"step": 9, "state": [1, 2]}, "its state is not a dict of state dicts by name"),
    ({"step": 9, "state": {"model": None}}, "its state is not a dict of state dicts by name"),
    ([1, 2, 3], "not a saved state (a list, not a dict of step and state)"),
    (torch.zeros(3), "not a saved state (a Tensor, not a dict of step and state)"),
])
def test_a_rescue_file_that_loads_but_is_no_saved_state_is_skipped_with_one_line(tmp_path, capsys, content, reason):
    """Files torch loads whose content ftrun did not write: each crashed every worker (a step compared with an
    int, a missing state, a step an int64 cannot hold) or was taken as another step (9.5, '9'): now skipped."""
    save_rescue(objects(0), 4, tmp_path / "0.pt")
    torch.save(content, tmp_path / "1.pt")
    best = best_rescue(tmp_path)
    assert best is not None and best["step"] == 4
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"ftrun: skipping rescue file {tmp_path / '1.pt'}: {reason}"), lines


def test_a_saved_state_without_a_protected_name_says_so_in_the_error(tmp_path):
    save_rescue({"model": objects(0)["model"]}, 4, tmp_path / "0.pt")
    with pytest.raises(RuntimeError, match=r"a rescue file's\) holds none for \['optimizer', 'scheduler'\]"):
        load_into(best_rescue(tmp_path), objects(1))
