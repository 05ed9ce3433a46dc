"""What torch's native in-place reconfigure does on a backend, with one rank: the facts ftrun needs to use it.

ftrun aborts the stale data group at each plan and forms a fresh one (README, "How recovery works on NCCL and
on Gloo"). torch's ``init_process_group(..., enable_reconfigure=True)`` / ``_get_reconfigure_handle`` /
``_reconfigure`` could re-form the data group in place instead, where the backend implements them (torch
2.15's rewritten NCCL backend; Gloo). Before ftrun's recovery can rest on it, three things must be known of the
backend, and one rank shows each:

1. whether forming the group with ``enable_reconfigure=True`` already rendezvouses through the store (keys
   written at init), or waits for the first ``_reconfigure``;
2. whether ``_reconfigure`` rendezvouses through the store the group was made with (then every member, a
   spare's group made alone included, must make its group on one store prefix, shared across generations)
   or through its handles alone;
3. whether the group can still be reconfigured after ``ProcessGroup.abort()``, which ftrun calls the moment a
   plan arrives (it is what frees a kernel waiting for a dead peer), or only reconfigure revokes its work.

For 2, a second group is made on a Python store that records the keys written through it (as ftrun's
interruptible store would serve the rendezvous) and reconfigured once: the names show whether the
rendezvous goes through the group's own store (under its prefix).

Each step prints one line: what it did, the store keys it wrote, how long it took, and what it raised, if it
raised; a collective of the world of one checks the group after each reconfigure. Nothing here fails on a
finding: the probe exits 0 once it has reported, and 1 only if it could not run at all.

    python scripts/reconfigure_probe.py --backend gloo   # on any machine
    python scripts/reconfigure_probe.py --backend nccl   # on a GPU (scripts/gpu_check.sh runs it)

On torch 2.14 ``"nccl"`` is the old backend unless ``TORCH_DIST_USE_NCCL2=1``; on 2.15 the rewritten one unless
``TORCH_DIST_USE_NCCL2=0``: gpu_check.sh probes both.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from ftrun.worker import backends

TIMEOUT = timedelta(seconds=30)


def step(label: str, store: dist.TCPStore, action: Callable[[], Any]) -> tuple[bool, Any]:
    """Run ``action``; print what it cost (ms, store keys written) or what it raised; (whether it ran, its
    result)."""
    keys_before, start = store.num_keys(), time.perf_counter()
    try:
        result = action()
    except Exception as exc:  # noqa: BLE001 -- a finding, reported in one line
        ran, result, said = False, None, f"raised {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
    else:
        ran, said = True, "ok"
    elapsed = 1000 * (time.perf_counter() - start)
    print(f"{label:<46} {said}; {elapsed:7.1f} ms, {store.num_keys() - keys_before} store keys written", flush=True)
    return ran, result


class RecordingStore(dist.Store):
    """A store that passes every call on to ``inner`` and records the keys written through it."""

    def __init__(self, inner: dist.Store) -> None:
        super().__init__()
        self.inner = inner
        self.written: list[str] = []

    def set(self, key: str, value: Any) -> None:
        self.written.append(key)
        self.inner.set(key, value)

    def compare_set(self, key: str, expected: Any, desired: Any) -> bytes:
        self.written.append(key)
        return self.inner.compare_set(key, expected, desired)

    def add(self, key: str, amount: int) -> int:
        self.written.append(key)
        return self.inner.add(key, amount)

    def get(self, key: str) -> bytes:
        return self.inner.get(key)

    def check(self, keys: list[str]) -> bool:
        return self.inner.check(keys)

    def wait(self, keys: list[str], *timeout: timedelta) -> None:
        self.inner.wait(keys, *timeout)

    def delete_key(self, key: str) -> bool:
        return self.inner.delete_key(key)

    def num_keys(self) -> int:
        return self.inner.num_keys()

    def set_timeout(self, timeout: timedelta) -> None:
        self.inner.set_timeout(timeout)


def reconfigure(uuid: int) -> None:
    """Re-form the default group in place over this rank's own handle (a world of one), and wait for it."""
    dist._reconfigure(uuid, [dist._get_reconfigure_handle()],
                                       timeout=TIMEOUT).wait()


def collective(device: torch.device) -> None:
    """An all-reduce on the default group, which a world of one leaves as it was."""
    tensor = torch.full((1024,), 3.0, device=device)
    dist.all_reduce(tensor)
    if device.type == "cuda":
        torch.cuda.synchronize()
    if float(tensor[0]) != 3.0 or dist.get_world_size() != 1 or dist.get_rank() != 0:
        raise AssertionError(f"world {dist.get_world_size()}, rank {dist.get_rank()}, sum {float(tensor[0])}")


def probe(backend: str) -> None:
    """Print the three findings (module docstring) for ``backend``, in this process."""
    device = torch.device("cuda", 0) if backend == "nccl" else torch.device("cpu")
    backends.prepare(backend)  # the environment ftrun's workers build the backend in
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    print(f"torch {torch.__version__}, backend {backend!r} on {device}", flush=True)
    formed, _ = step("init_process_group(enable_reconfigure=True)", store, lambda: dist.init_process_group(
        backend, store=dist.PrefixStore("probe", store), rank=0, world_size=1, timeout=TIMEOUT,
        enable_reconfigure=True))
    if not formed:
        return
    impl = dist.group.WORLD._get_backend(device)
    supported = dist._supports_reconfigure()
    print(f"{type(impl).__name__}: supports_reconfigure {supported}", flush=True)
    if not supported:
        print("native reconfigure: not offered by this backend; ftrun forms a fresh group each generation", flush=True)
        dist.destroy_process_group()
        return
    handle = dist._get_reconfigure_handle()
    print(f"reconfigure handle: {handle}", flush=True)
    if step("_reconfigure(uuid=1): the first communicator", store, lambda: reconfigure(1))[0]:
        step("all_reduce after it", store, lambda: collective(device))
    again = dist._get_reconfigure_handle()
    print(f"handle after it: {'unchanged' if again == handle else again}", flush=True)
    if step("_reconfigure(uuid=2): again, nothing aborted", store, lambda: reconfigure(2))[0]:
        step("all_reduce after it", store, lambda: collective(device))
    step("ProcessGroup.abort() (ftrun's at a plan)", store, dist.group.WORLD.abort)
    if step("_reconfigure(uuid=3): after the abort", store, lambda: reconfigure(3))[0]:
        step("all_reduce after it", store, lambda: collective(device))
    step("destroy_process_group", store, dist.destroy_process_group)
    recording = RecordingStore(dist.PrefixStore("recorded", store))
    if step("a group made on a store that records keys", store, lambda: dist.init_process_group(
            backend, store=recording, rank=0, world_size=1, timeout=TIMEOUT, enable_reconfigure=True))[0]:
        step("_reconfigure(uuid=1) through it", store, lambda: reconfigure(1))
        print(f"keys written through the group's own store: {recording.written}", flush=True)
        step("destroy_process_group", store, dist.destroy_process_group)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backend", choices=["gloo", "nccl"], default="nccl" if torch.cuda.is_available() else "gloo",
                        help="the data plane's backend to probe (default: nccl where a GPU is visible, else gloo)")
    args = parser.parse_args()
    if not hasattr(dist, "_reconfigure"):
        print(f"torch {torch.__version__} has no native reconfigure API", flush=True)
        return
    probe(args.backend)


if __name__ == "__main__":
    main()
