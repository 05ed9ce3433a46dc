"""One GPU, NCCL: ftrun's two planes, its step path and its state manifest on CUDA, each timed and checked.

Run by scripts/gpu_check.sh on a machine with a GPU. World size 1 (NCCL allows one rank per GPU):

1. the planes: generation 0 formed through ftrun's ``Planes`` (NCCL data group with eager init, Gloo control
   group), a collective on each, the abort of both, generation 1 formed while generation 0's communicator
   is still being torn down, collectives again, the stale one released once its abort is done;
2. the step path on CUDA tensors: stock DDP with ftrun's comm hook (1 MB buckets) and the loss summed on the
   first bucket's all-reduce (read in ``finish``), against the gradients and loss of the same model without
   DDP;
3. the stream order of the step's results: a collective that writes its result late on a stream of its own
   and marks its future done at once (as NCCL does), read through the comm hook's future as DDP reads a bucket
   and as ``finish`` reads the loss, on its own or carried by the bucket: each must see the result, not what
   was there;
4. the transfer's manifest of a CUDA model and Adam state: which tensors travel on the data plane, the
   receiver's in-place targets on the GPU;
5. the comm hook's cost per bucket call on CUDA tensors and NCCL, against a minimal Python hook
   (scripts/bench_recovery.py's measurement): what stands between DDP and each all-reduce's launch.

Prints one line per check, the torch and NCCL versions and the backend class "nccl" resolved to.

``--planes fresh|native``: only the planes (1), in that mode of ``--data-reconfigure`` (native: the data group
made once and re-formed by torch's in-place reconfigure at each generation; where the backend cannot, it says
so and the generations form fresh groups). With ``--backend gloo`` on the CPU: what the test suite runs of
this script (tests/test_scripts.py), the planes and the step path (2) on CPU tensors, so that the check's own
code is run where no GPU is.
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from types import SimpleNamespace

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from ftrun.protocol import Plan
from ftrun.worker import backends, transfer
from ftrun.worker.planes import Planes
from ftrun.worker.state import snapshot
from ftrun.worker.steps import StepCollectives

from bench_recovery import hook_costs  # noqa: I001 -- beside this script


def timed(label: str, action: Callable[[], object]) -> None:
    start = time.perf_counter()
    action()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    print(f"{label:<52} {1000 * (time.perf_counter() - start):8.1f} ms", flush=True)


def collectives_on_both_planes(planes: Planes, device: str = "cuda") -> None:
    data = torch.ones(1 << 20, device=device)
    dist.all_reduce(data)
    gathered = [torch.zeros(1, dtype=torch.int64)]
    planes.control.allgather([gathered], [torch.tensor([7])]).wait()
    assert float(data[0]) == 1.0 and int(gathered[0]) == 7, "a world of one must leave the tensors as they were"


def check_planes(store: dist.TCPStore, in_place: bool = False, backend: str = "nccl") -> Planes:
    device = "cuda" if backend == "nccl" else "cpu"
    planes = Planes(store, attempt=0, uid=0, backend=backend, timeout=timedelta(seconds=60), in_place=in_place)
    timed(f"form generation 0 ({backend} data, Gloo control)", lambda: planes.form(Plan(0, [0]), lambda: False))
    impl = type(dist.group.WORLD._get_backend(torch.device(device))).__name__
    print(f"data plane: {dist.get_backend()} ({impl}), eager init: {backends.init_options(backend)}; "
          f"control plane: {type(planes.control).__name__}; TORCH_NCCL_ASYNC_ERROR_HANDLING="
          f"{backends.NCCL_ENV['TORCH_NCCL_ASYNC_ERROR_HANDLING']}", flush=True)
    timed("all_reduce 4 MiB (data) + allgather (control)", lambda: collectives_on_both_planes(planes, device))
    tells = hasattr(dist.group.WORLD._get_backend(torch.device(device)), "get_error")
    recorded = backends.async_error(dist.group.WORLD, backend)
    print(f"the watchdog's recorded failures readable at commit (Backend.get_error): {tells}; recorded after "
          f"healthy collectives: {recorded}", flush=True)
    assert recorded is None, recorded
    started = time.perf_counter()
    timed("abort both planes (NCCL's abort started: in place a revoke; Gloo shutdown)", lambda: planes.abort(1))
    timed("form generation 1", lambda: planes.form(Plan(1, [0]), lambda: False))
    print(f"generation 0's abort still tearing down when generation 1 was formed: {not planes.wait_aborts(0)}",
          flush=True)
    timed("collectives on generation 1", lambda: collectives_on_both_planes(planes, device))
    assert planes.wait_aborts(60), "generation 0's abort did not end within 60 s"
    print(f"{'generation 0 aborted, from the abort on':<52} {1000 * (time.perf_counter() - started):8.1f} ms",
          flush=True)
    timed("release generation 0", planes.release)
    assert not planes.stale, "generation 0 was not released"
    if in_place:
        print(f"data group re-formed in place (torch's reconfigure): {planes.in_place}", flush=True)
    return planes


def check_step(device: str = "cuda") -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(4)]).to(device)
    reference = [p.detach().clone() for p in model.parameters()]
    inputs = torch.randn(64, 1024, device=device)
    collectives = StepCollectives(threading.Condition(), None)
    ddp = DistributedDataParallel(model, bucket_cap_mb=1)
    ddp.register_comm_hook(dist.group.WORLD, collectives.hook)
    total: list[float | None] = []

    def step() -> None:
        collectives.begin()
        loss = ddp(inputs).square().mean()
        collectives.start_loss(loss, lambda _: dist.group.WORLD, with_first_bucket=True)  # as Session.backward
        loss.backward()
        ok, summed = collectives.finish(loss, lambda _: dist.group.WORLD)
        assert ok, "the step's collectives failed"
        total.append(summed)

    timed(f"DDP step on {device} through ftrun's hook and finish", step)
    plain = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(4)]).to(device)
    with torch.no_grad():
        for p, r in zip(plain.parameters(), reference):
            p.copy_(r)
    loss = plain(inputs).square().mean()
    loss.backward()
    for p, q in zip(model.parameters(), plain.parameters()):
        assert torch.allclose(p.grad, q.grad, rtol=1e-5, atol=1e-7), "gradients differ from a plain backward"
    assert abs(total[0] - loss.item()) <= 1e-5 * abs(loss.item()), (total[0], loss.item())
    print(f"hook and commit on {device}: gradients match a plain backward, loss {total[0]:.6g} summed on the data "
          f"plane, carried by the first bucket", flush=True)


class LateGroup:
    """A world of one whose all-reduce adds 1 to the tensor after the GPU has slept ~50 ms, on a stream of its
    own, and whose work's future is done at once, its event on that stream: NCCL's way, made slow enough that a
    reader whose stream does not wait for the collective's reads the tensor as it was."""

    SLEEP_CYCLES = 100_000_000

    def __init__(self) -> None:
        self.stream = torch.cuda.Stream()

    def allreduce(self, tensors: list[torch.Tensor]) -> SimpleNamespace:
        (tensor,) = tensors
        future: torch.futures.Future = torch.futures.Future(devices=[tensor.device])
        self.stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.stream):
            if hasattr(torch.cuda, "_sleep"):
                torch.cuda._sleep(self.SLEEP_CYCLES)
            else:  # torch's test helper gone: as long a wait made of matrix products (4096^3 x 2 flops each)
                square = torch.ones(4096, 4096, device=tensor.device)
                for _ in range(50):
                    square = square @ square / 4096
            tensor.add_(1)
            future.set_result([tensor])
        return SimpleNamespace(get_future=lambda: future)


def check_stream_order() -> None:
    group = LateGroup()
    collectives = StepCollectives(threading.Condition(), None)
    collectives.begin()
    bucket = torch.zeros(1 << 20, device="cuda")
    bucket_seen = collectives.hook(group, SimpleNamespace(buffer=lambda: bucket)).wait().clone()  # DDP's read
    loss = torch.zeros(1, device="cuda")
    collectives.wait(group.allreduce([loss]))
    loss_seen = loss.clone()  # finish()'s read of the summed loss
    collectives.begin()  # the next step: its loss carried by the bucket, copied out of it in the hook's callback
    carried, second = torch.zeros((), device="cuda"), torch.zeros(1 << 20, device="cuda")
    collectives.start_loss(carried, lambda _: group, with_first_bucket=True)
    second_seen = collectives.hook(group, SimpleNamespace(buffer=lambda: second)).wait().clone()
    ok, carried_seen = collectives.finish(carried, lambda _: group)
    torch.cuda.synchronize()
    assert float(bucket_seen.min()) == 1.0, "a bucket was read through the hook's future before its all-reduce ran"
    assert float(loss_seen) == 1.0, "the loss was read after the step's wait before its all-reduce ran"
    assert float(second_seen.min()) == 1.0, "a bucket carrying the loss was read before its all-reduce ran"
    assert ok and carried_seen == 1.0, f"the carried loss was read before its all-reduce ran ({carried_seen})"
    print("stream order: a late collective's bucket and loss are read after it, through the hook's future and "
          "the step's wait, the loss on its own and carried by the bucket", flush=True)


def check_manifest() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(2048, 2048), torch.nn.Linear(2048, 16)).cuda()
    optimizer = torch.optim.Adam(model.parameters())
    model(torch.randn(4, 2048, device="cuda")).sum().backward()
    optimizer.step()
    state = snapshot({"model": model, "optimizer": optimizer}, 3)
    data, specs, _ = transfer.manifest(state)
    kinds = sorted({spec.device_type for spec in specs})
    into = transfer.targets(specs, state, {"cuda": backends.device_of("cuda")})
    in_place = sum(t.data_ptr() == dict(transfer.leaves(state))[s.path].data_ptr() for t, s in zip(into, specs))
    routed = {kind for kind in backends.served("nccl")}
    print(f"manifest: {len(data)} bytes, {len(specs)} tensors by reference on {kinds} (the data plane takes "
          f"{sorted(routed)}), {in_place} of them received in place", flush=True)
    assert kinds == ["cuda"] and in_place == len(specs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--planes", choices=["fresh", "native"],
                        help="only the planes, the data group formed as --data-reconfigure says")
    parser.add_argument("--backend", choices=["nccl", "gloo"], default="nccl",
                        help="the data plane's backend of --planes (gloo: on the CPU)")
    args = parser.parse_args()
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    if args.backend == "nccl" or not args.planes:  # all but the planes on Gloo need the GPU
        assert torch.cuda.is_available(), "no GPU visible"
        torch.cuda.set_device(0)
        backends.prepare("nccl")
        print(f"torch {torch.__version__}, NCCL {'.'.join(map(str, torch.cuda.nccl.version()))}, "
              f"{torch.cuda.get_device_name(0)}", flush=True)
    if args.planes:
        in_place = backends.reconfigures_in_place(args.planes)  # as a worker decides it
        if args.planes == "native" and not in_place:
            print("this torch has no in-place reconfigure (its API): the data group is formed fresh each generation",
                  flush=True)
        planes = check_planes(store, in_place=in_place, backend=args.backend)
        if args.backend == "gloo":
            check_step("cpu")
        planes.destroy()
        print(f"planes ({args.planes}, {args.backend}): ok", flush=True)
        return
    planes = check_planes(store)
    check_step()
    check_stream_order()
    check_manifest()
    planes.destroy()
    for name, costs in hook_costs(100, "nccl", "cuda").items():
        print(f"comm hook per bucket call on CUDA/NCCL, {name:7s}: median {statistics.median(costs):6.1f} us, "
              f"90th percentile {statistics.quantiles(costs, n=10)[-1]:6.1f} us ({len(costs)} calls)", flush=True)
    print("gpu check: ok", flush=True)


if __name__ == "__main__":
    main()
