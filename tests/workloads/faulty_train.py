"""The example's training with faults planted at exact points, for the recovery tests.

FAULTS (environment) is a comma list of KIND:STEP:UID, where UID is the worker's FTRUN_UID (its initial rank):
kill (SIGKILL itself before the step), exception (raise in the step), allreduce (SIGKILL itself inside the
gradient all-reduce: after the first bucket's all-reduce has started on every rank), recovery (SIGKILL itself
while re-forming the group after the first fault; armed from the first step whatever STEP says, since the
first fault's recovery may begin before this worker reaches STEP), reset (shut down every TCP connection
between itself and one other worker, both alive: a link reset, no death), backend (the data plane's backend
reports an asynchronous failure at the step's commit, as NCCL's watchdog records one before it aborts a
communicator under a collective whose future was done when queued: faked where ftrun reads it), backward (SIGKILL itself in backward
before the first layer's gradients: with FSDP, between the layers' reduce-scatters), refresh (SIGKILL itself
as it starts the copy of the state of committed step STEP to its buddy, once the copy of the step before is
complete: that one is then the newest; sharded state only), copying (SIGKILL itself before the step, as kill,
but with sharded state without waiting for the copies of the step before: they may still be in flight), sleep
(sleep SLEEP seconds before the step, in its own code: a rank hung outside any collective, alive). Each
fault is planted once, in the first attempt only, so a group restart runs clean.
EXAMPLE (environment) names the example trained: train_ddp (the default) or train_fsdp.
Every rank prints `commit uid=<uid> step=<n> loss=<float>` for each committed step.
"""

from __future__ import annotations

import importlib
import os
import signal
import socket
import sys
import time
from collections.abc import Callable
from pathlib import Path

import psutil
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))

import ftrun  # noqa: E402
import train_ddp  # noqa: E402
from ftrun.worker import backends, planes, redundancy  # noqa: E402

UID = int(os.environ.get("FTRUN_UID", os.environ.get("RANK", "0")))
FIRST_ATTEMPT = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
FAULTS = [f.split(":") for f in os.environ.get("FAULTS", "").split(",") if f] if FIRST_ATTEMPT else []
EXAMPLE = importlib.import_module(os.environ.get("EXAMPLE") or "train_ddp")
SHARDED = EXAMPLE.__name__ == "train_fsdp"
JOINER = os.environ.get("FTRUN_JOINER") == "1"


SLEEP = 600.0
"""Seconds a ``sleep`` fault sleeps: far past any hang timeout the tests set, so the hang watchdog ends it."""


def wait_until(condition: Callable[[], bool], timeout: float = 120.0) -> None:
    """Poll ``condition`` until it holds or ``timeout`` seconds pass (then carry on: the test fails on what it
    checks, instead of hanging)."""
    deadline = time.monotonic() + timeout
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.02)  # polling a condition; the order comes from the condition, not from the delay


def build(args, ft: ftrun.Session) -> train_ddp.Training:
    """The example's training; DDP with small buckets, so that the gradient all-reduce has several."""
    return EXAMPLE.build(args, ft, bucket_cap_mb=1) if EXAMPLE is train_ddp else EXAMPLE.build(args, ft)


def die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def reset_link() -> None:
    """Shut down (both ways) every TCP connection between this worker and one other worker process."""
    me = psutil.Process()
    connections = psutil.net_connections(kind="tcp")
    owner = {(c.laddr.ip, c.laddr.port): c.pid for c in connections if c.laddr and c.pid}
    mine = [c for c in me.net_connections(kind="tcp") if c.raddr and c.fd != -1]
    workers = {owner.get((c.raddr.ip, c.raddr.port)) for c in mine} - {None, me.pid}
    peer = min(pid for pid in workers if "faulty_train.py" in " ".join(psutil.Process(pid).cmdline()))
    for connection in mine:
        if owner.get((connection.raddr.ip, connection.raddr.port)) == peer:
            with socket.socket(fileno=os.dup(connection.fd)) as sock:
                sock.shutdown(socket.SHUT_RDWR)


def plant(kind: str, step: int, uid: int, training: train_ddp.Training) -> None:
    if uid != UID:
        return
    if kind in ("kill", "copying"):
        die()
    if kind == "exception":
        raise RuntimeError(f"planted exception at step {step}")
    if kind == "reset":
        reset_link()
    if kind == "backend":
        reads = backends.async_error

        def reported_once(group: dist.ProcessGroup, backend: str) -> str | None:
            backends.async_error = reads
            return f"the data plane's {backend} backend reported COMM_ERROR"

        backends.async_error = reported_once
    if kind == "sleep":
        time.sleep(SLEEP)
    if kind == "allreduce":
        first = next(iter(training.model.module.parameters()))
        first.register_hook(lambda grad: die())
    if kind == "freeze":
        freezer = Path(os.environ["FREEZER"])
        (freezer / "cgroup.procs").write_text(str(os.getpid()))
        (freezer / "freezer.state").write_text("FROZEN")  # this process stops here, in state D
    if kind == "recovery":
        original = planes.Planes.form
        planes.Planes.form = lambda self, plan, superseded: die() if plan.gen >= 1 else original(
            self, plan, superseded)
    if kind == "backward":
        training.model[0].register_full_backward_pre_hook(lambda *_: die())
    if kind == "refresh":
        original_refresh = redundancy.Redundancy.refresh

        def refresh(self: redundancy.Redundancy, at: int, *rest) -> None:  # noqa: ANN002
            if at != step:
                return original_refresh(self, at, *rest)
            self.wait()  # as a refresh does first: the copy of the step before is complete
            die()

        redundancy.Redundancy.refresh = refresh


def plant_due(step: int, planted: set[int], training: train_ddp.Training, ft: ftrun.Session) -> None:
    """Plant the faults due at ``step`` that ``planted`` (their indices in FAULTS) does not hold yet, and add
    them to it: each fault once, so a step replayed after a recovery does not plant it again.

    For a death due now (kill, backward) every rank counts itself in at the step in the job's store, and a
    rank about to die waits for all of them: the death lands once every rank has committed the step before
    (else a survivor the machine's load held back between the last collective of that step and its commit
    would meet the new plan first and do that step again, a step later than the test's fault step). With
    sharded state every rank that started with the job first waits for its copy of the last committed step
    (it overlaps the step) and then at a barrier, so the death lands after every copy's window, on every rank
    alike (a death inside it, which replays a step, is the refresh fault's drill); a rank that leaves the
    barrier may still owe another its last message, which the count waits out too: the death hits the
    training, never the barrier."""
    due = [(index, kind, at, uid) for index, (kind, at, uid) in enumerate(FAULTS)
           if index not in planted and (int(at) == step or kind == "recovery")]
    deaths = [int(uid) for _, kind, at, uid in due if kind in ("kill", "backward") and int(at) == step]
    if deaths and ft.managed and not (SHARDED and JOINER):  # unmanaged (--no-recovery): no recovery to race
        if SHARDED:
            ft.redundancy.wait()
            dist.barrier()
        arrived = f"test/arrived/{step}"
        ft.store.add(arrived, 1)
        if UID in deaths:
            wait_until(lambda: ft.store.add(arrived, 0) >= dist.get_world_size())
    for index, kind, at, uid in due:
        planted.add(index)
        plant(kind, int(at), int(uid), training)


def main() -> None:
    args = EXAMPLE.parse_args()
    ft = ftrun.init()
    training = build(args, ft)
    planted: set[int] = set()
    for step in ft.steps(args.steps):
        plant_due(step, planted, training, ft)
        loss = EXAMPLE.train_step(ft, training, step)
        if loss is not None:
            print(f"commit uid={UID} rank={ft.rank} world={ft.world_size} step={step} loss={loss:.12g}", flush=True)


if __name__ == "__main__":
    main()
