"""The worker API: join the job, protect state, run steps that commit only when they completed everywhere."""

from __future__ import annotations

import atexit
import operator
import os
import sys
import threading
import time
import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.nn  # noqa: F401 -- imported before any group exists, on purpose: see Session._shut_down
from torch.nn.parallel import DistributedDataParallel

from ftrun import protocol
from ftrun.protocol import Plan, initial_members
from ftrun.store.client import open_client
from ftrun.worker import backends, transfer
from ftrun.worker.channel import AgentChannel
from ftrun.worker.ddp_models import DdpModels
from ftrun.worker.entered import EnteredNotice
from ftrun.worker.injected import WorkerDrills
from ftrun.worker.interruptible import Superseded
from ftrun.worker.planes import Planes
from ftrun.worker.progress import ProgressNotice
from ftrun.worker.recovery import INVALID_STEP, Recovery
from ftrun.worker.redundancy import Rebuild, Redundancy, is_sharded, refresh_interval
from ftrun.worker.stack_dumps import answer_stack_dump_requests
from ftrun.worker.steps import CollectiveFailed, StepCollectives
from ftrun.worker.state import Stateful, state_of

EXIT_CALLBACK_WAIT = 10.0
"""Seconds an exiting worker waits for torch to drop the completion callbacks of its last collectives (done
ones' take microseconds; past that the groups are freed all the same)."""
DEFAULT_RECOVERY_DEADLINE = 90.0
"""Seconds a worker waits for a recovery when its agent names none (FTRUN_RECOVERY_DEADLINE): ftrun's
default --recovery-timeout plus --join-timeout."""


class Session(Recovery):
    """One worker's membership in the job.

    Under ftrun the session learns of each new generation from its agent, forms the generation's data and
    control planes among its members, agrees with them on the last committed step and takes state from a
    peer if it is behind. Under plain torchrun (no ftrun agent) it is an ordinary DDP loop.
    """

    def __init__(self, backend: str | None = None, timeout: timedelta = timedelta(minutes=30)) -> None:
        self.backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
        self.uid = int(os.environ.get("FTRUN_UID", os.environ.get("RANK", "0")))
        self.spare = os.environ.get("FTRUN_JOINER") == "1"
        self.managed = "FTRUN_CHANNEL_FD" in os.environ and os.environ.get("FTRUN_RECOVERY", "1") == "1"
        self.recovery_timeout = float(os.environ.get("FTRUN_RECOVERY_DEADLINE", DEFAULT_RECOVERY_DEADLINE))
        """Seconds this worker waits for a recovery to finish (the agent's --recovery-timeout + --join-timeout)."""
        self.protected: dict[str, Stateful] = {}
        self.redundancy: Redundancy | None = None  # sharded (FSDP2) state: its copies in peers' memory
        self._swallowed: BaseException | None = None  # the last collective error guard() turned into a failed step
        self.committed_step = -1
        self.gen = 0
        self.members: list[int] = []  # the uids of generation ``gen``, in rank order
        self._cond = threading.Condition()
        self._state_lock = threading.Lock()  # held while the state changes: a rescue never sees half of it
        self._saved: tuple[tuple[int, tuple[int, ...], bool], int] | None = None  # the last save: of what, its step
        self._latest: Plan | None = None
        self._considered = 0  # newest plan generation looked at by recovery
        self._plan_received = time.time()
        self._step = 0
        self._step_started = 0.0
        self._drills = WorkerDrills()  # `ftrun inject exception|slow`, acted out at the start of a step
        self.channel: AgentChannel | None = None
        self.entered: EnteredNotice | None = None
        self.progress: ProgressNotice | None = None
        self.collectives = StepCollectives(self._cond, self._entered)
        self._ddps = DdpModels(self.collectives)
        self._began = False  # steps() was called: what is protected is what a rank behind will take
        self._in_step = False  # a step of steps() runs: commit() has a step to commit
        self.planes: Planes | None = None
        atexit.register(self._shut_down)
        if not self.managed:  # torch's own error handling: a failed collective ends the process, torchrun restarts
            dist.init_process_group(self.backend, timeout=timeout, **backends.init_options(self.backend))
            return
        backends.prepare(self.backend)
        self.store = open_client(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), timeout=300)
        self.planes = Planes(self.store, int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")), self.uid,
                             self.backend, timeout,
                             backends.reconfigures_in_place(os.environ.get("FTRUN_DATA_RECONFIGURE", "fresh")))
        self.channel = AgentChannel(int(os.environ["FTRUN_CHANNEL_FD"]), self._on_message)
        self.entered = EnteredNotice(lambda step: self.channel.send(protocol.ENTERED, step=step))
        self.progress = ProgressNotice(lambda gen, step, step_time: self.channel.send(
            protocol.PROGRESS, gen=gen, step=step, time=time.time(), step_time=step_time))
        answer_stack_dump_requests()
        sizes = [int(n) for n in os.environ.get("FTRUN_NODE_SIZES", os.environ["WORLD_SIZE"]).split(",")]
        first = None if self.spare else Plan(0, initial_members(sizes))
        with self._cond:
            self._latest = self._latest or first or Plan(-1, [])
        if first is None:
            self.gen = self._considered = -1
            self.committed_step = INVALID_STEP  # a joiner is always behind: it takes state even before any commit
            self.planes.start_alone()
        else:
            self.planes.form(first, lambda: False)
            self.members = first.members
        self.channel.send(protocol.HELLO, uid=self.uid, pid=os.getpid(), spare=self.spare)

    # ------------------------------------------------------------ public API
    @property
    def rank(self) -> int:
        """This worker's rank in the current generation."""
        return dist.get_rank()

    @property
    def world_size(self) -> int:
        """Number of ranks in the current generation."""
        return dist.get_world_size()

    def ddp(self, module: torch.nn.Module, **kwargs: Any) -> DistributedDataParallel:
        """Wrap ``module`` in stock DDP whose gradients are summed through ftrun's comm hook.

        The hook turns a failed or abandoned all-reduce into a discarded step instead of an exception
        in ``backward()``. Gradients are summed, not averaged: divide the loss by the global batch size.
        """
        return self._ddps.wrap(module, **kwargs)

    def protect(self, rebuild: Rebuild | None = None, refresh_every: int = 1, **objects: Stateful) -> None:
        """Register the state a peer sends to a rank that is behind: models, optimizers, schedulers...

        Sharded state (an FSDP2 ``fully_shard`` model and its optimizer: DTensors) is kept redundant
        instead: each rank's shards are copied into a peer's host memory after every ``refresh_every``-th
        committed step (0: never; ftrun's ``--refresh-every`` overrides it), and recovered from there. It
        needs ``rebuild``: a function that builds the same objects anew over the current world
        (``fully_shard`` over the default group, a new optimizer) and returns them by the names given here;
        after a recovery :attr:`protected` holds them.
        """
        if self._began:
            raise RuntimeError("ftrun: protect() every object before steps(): a rank that is behind takes what was "
                               "protected when the loop began")
        states = {name: state_of(name, obj) for name, obj in objects.items()}
        sharded = any(is_sharded(t) for state in states.values() for _, t in transfer.leaves(state))
        for name, state in states.items() if not sharded else ():
            problem = transfer.unsendable(state)
            if problem is not None:
                raise TypeError(f"ftrun: protect({name}=...): no peer could take its state: {problem}")
        self.protected.update(objects)
        if not sharded:
            return
        if rebuild is None:
            raise ValueError("ftrun: protect() of sharded (FSDP2) state needs rebuild=, a function that builds "
                             "the same objects over the current world (README, 'Sharded models')")
        if self.managed:
            every = refresh_interval(refresh_every, os.environ.get("FTRUN_REFRESH_EVERY"))
            self.redundancy = Redundancy(self.protected, rebuild, every, self.collectives.issue, self.members)

    @contextmanager
    def guard(self) -> Iterator[None]:
        """Run a step's forward and backward: a collective failed by a peer's loss ends the block quietly.

        Sharded models (FSDP2) run their collectives inside ``model(x)`` and ``backward()``, outside
        ftrun's reach: under ftrun such a failure marks the step failed, :meth:`commit` then returns
        None and the step is run again after recovery. Elsewhere (plain torchrun) errors propagate.
        """
        try:
            yield
        except (RuntimeError, CollectiveFailed, Superseded) as exc:
            if not self.managed or not (isinstance(exc, (CollectiveFailed, Superseded)) or _from_collective(exc)):
                raise
            self._swallowed = exc  # the cause shown if no recovery follows
            self.collectives.fail()

    def steps(self, total: int) -> Iterator[int]:
        """Yield step numbers from the one after the last committed up to ``total`` (the run's steps: called
        again, it goes on from there); after a fault, the first uncommitted step comes again."""
        try:
            total = operator.index(total)
        except TypeError:
            raise TypeError(f"ftrun: steps() takes a whole number of steps, not {total!r:.40}") from None
        first, self._began = not self._began, True
        return self._steps(total, first)

    def _steps(self, total: int, first: bool) -> Iterator[int]:
        if not self.managed:
            for step in range(self.committed_step + 1, total):
                self._step = step
                self.collectives.begin()
                yield from self._run_step(step)
            return
        if first and self.spare:
            self.channel.send(protocol.READY, uid=self.uid)
            self._recover()
        elif first:
            if self.redundancy is not None:
                self._start_sharded()
            else:
                self._restore_rescue()
                self._start_together()
            with self._state_lock:
                self._refresh()
        step = self.committed_step + 1
        try:
            while step < total:
                if self._needs_recovery():
                    self._recover()
                    step = self.committed_step + 1
                    continue
                self._step = step
                self.collectives.begin()
                self._step_started = time.monotonic()
                self._drills.at_step()
                yield from self._run_step(step)
                if self.committed_step == step:
                    step += 1
                elif not self._needs_recovery():
                    raise RuntimeError("ftrun: call commit(optimizer) once in every step of steps()")
        except GeneratorExit:  # the script left the loop (a break, an exception): it waits in no collective
            self.entered.left()
            self.channel.send(protocol.LEFT, step=self.committed_step)
            raise
        if self.redundancy is not None:
            self.redundancy.wait()  # the copy of the last step: no thread left in a collective at exit
        self.channel.send(protocol.FINISHED, step=self.committed_step)

    def _run_step(self, step: int) -> Iterator[int]:
        """Hand ``step`` to the script's loop body, during which :meth:`commit` may commit it."""
        self._in_step = True
        try:
            yield step
        finally:
            self._in_step = False

    def backward(self, loss: torch.Tensor, scale: float = 1.0) -> None:
        """``loss.backward()`` (of ``loss * scale``), with the sum of ``loss`` over the ranks started beside it
        instead of after it (carried by the first gradient bucket of a DDP model from :meth:`ddp`, when one syncs
        in this pass); pass the same ``loss`` to :meth:`commit`."""
        self.collectives.start_loss(loss, self._loss_group, with_first_bucket=self._ddps.sync())
        (loss * scale if scale != 1.0 else loss).backward()

    def commit(self, optimizer: torch.optim.Optimizer, loss: torch.Tensor | None = None) -> float | None:
        """Step ``optimizer`` if this step's collectives completed; returns the loss summed over ranks.

        Returns None when the step was abandoned (a peer was lost, or a collective failed): nothing was
        applied, the gradients are dropped and :meth:`steps` yields the same step again after recovery. On a GPU,
        reading the summed ``loss`` waits for the step's collectives to end, so that a failure the backend's
        watchdog recorded meanwhile is seen here (:func:`~ftrun.worker.backends.async_error`).
        """
        if not self._in_step:
            raise RuntimeError("ftrun: commit() commits a step of steps(): call it inside the loop")
        ok, total = self.collectives.finish(loss, self._loss_group, self._backend_error)
        if self.entered is not None:
            self.entered.left()
        if not ok:
            optimizer.zero_grad(set_to_none=True)
            return None
        with self._state_lock:  # a rescue sees the committed step with its snapshot (if one is due), or neither
            optimizer.step()
            self.committed_step = self._step
            if self.progress is not None:  # committed: the agent learns it before the work that follows a commit
                self.progress.committed(self.gen, self._step, time.monotonic() - self._step_started)
            self._refresh()
        optimizer.zero_grad(set_to_none=True)
        self._ddps.rebuild_buckets()
        if self.planes is not None and self.planes.stale:
            self._release_stale()
        return total

    def _refresh(self) -> None:
        """Snapshot the sharded state of the committed step and start copying it to the buddy, if this step is
        due. The caller holds the state lock: a rescue never saves a snapshot being overwritten."""
        if self.redundancy is not None and self.redundancy.due(self.committed_step):
            self.redundancy.refresh(self.committed_step, self.planes.control)

    def _backend_error(self) -> str | None:
        """A failure the data plane's backend recorded in this step (NCCL's watchdog), under ftrun only."""
        return backends.async_error(dist.group.WORLD, self.backend) if self.managed else None

    def _loss_group(self, loss: torch.Tensor) -> dist.ProcessGroup:
        """Where the step's loss is summed: the data plane if it takes the loss's device, else the control plane."""
        if self.planes is None or loss.device.type in backends.served(self.backend):
            return dist.group.WORLD
        return self.planes.control

    def _entered(self) -> None:
        """The step's first collective started: the agent's hang watchdog learns it if the step stays there."""
        if self.entered is not None:
            self.entered.entered(self._step)

    # -------------------------------------------------------------- watcher
    def _on_message(self, message: dict[str, Any]) -> None:
        """Runs on the channel thread: a new plan poisons the current generation and frees a blocked step."""
        if self._drills.on_message(message):
            return
        if message.get("t") == protocol.SAVE:
            threading.Thread(target=self._save_rescue, args=(message["copies"],), name="ftrun-rescue",
                             daemon=True).start()
        if message.get("t") != protocol.PLAN:
            return
        plan = Plan.from_message(message)
        with self._cond:
            if self._latest is not None and plan.gen <= self._latest.gen:
                return
            self._latest = plan
            self._plan_received = time.time()
            pending = self.collectives.abandon()
        self.planes.abort(plan.gen)
        self.collectives.complete(pending)

    def _shut_down(self) -> None:
        """At exit, while the interpreter is whole: free the current planes, so that their destructors join
        the backends' threads now (an aborted generation is released or left alone).

        A Gloo worker thread releases its last work a moment after waking the thread that waited for it, and
        the release takes the GIL (the work's future drops its Python done-callbacks, a tensor the script
        dropped meanwhile drops its Python object). Once the interpreter has begun to finalize, CPython ends
        such a thread with pthread_exit, whose unwinding through pybind11's noexcept destructors calls
        std::terminate: SIGABRT, "terminate called without an active exception", after a run that succeeded.
        Destroying the default group alone joins nothing while each DDP keeps it alive through its reducer,
        its logger, its ``process_group`` and its comm hooks' state (``_comm_hooks``: ftrun's hook is registered
        with the group as its state): they are dropped first (no model trains after exit). So would
        ``torch.distributed.nn.functional``, whose functions bind ``group.WORLD`` as a default argument when
        it is imported (DDP imports it): this module imports it before any group is formed.

        Before they are, the collectives' completion callbacks still held by the backend's threads are waited
        for (at most EXIT_CALLBACK_WAIT s; steps._Counted): where torch's groups have no ``shutdown()``
        (torch 2.6), freeing a group joins its threads while holding the GIL, and a thread on its way to the
        GIL would never end. Without the wait 9 of 30 fault-free jobs hung at exit there, on 2 cores.

        The DDPs are not released when an unhandled exception ends the process (Python set ``sys.last_value``
        as it printed it): that is a fault, and the groups close with the process, when its agent sees it die.
        Closed here, the peers' collectives would fail while it still lives, which reads as a link fault with
        every worker alive.
        """
        if getattr(sys, "last_value", None) is None:
            self.collectives.quiet(EXIT_CALLBACK_WAIT)
            self._ddps.release()
        if self.planes is not None:
            self.planes.destroy()
        elif dist.is_initialized():
            dist.destroy_process_group()


def _from_collective(exc: BaseException) -> bool:
    """Whether ``exc`` was raised inside torch.distributed's collective calls (Gloo raises a plain
    RuntimeError when a peer's connection closes), rather than by the user's code or a kernel."""
    frames = traceback.extract_tb(exc.__traceback__)
    return isinstance(exc, dist.DistError) or bool(frames) and frames[-1].filename.endswith(_C10D)


_C10D = os.path.join("torch", "distributed", "distributed_c10d.py")

_session: Session | None = None


def init(backend: str | None = None, timeout: timedelta = timedelta(minutes=30)) -> Session:
    """Join the job (once per process) and return the :class:`Session`.

    Under ftrun a spare or restarted worker returns at once too, with a group of its own; it takes its
    place, and a peer's state, when it reaches :meth:`Session.steps`.
    """
    global _session
    if _session is None:
        _session = Session(backend, timeout)
    elif backend is not None and backend != _session.backend:
        raise ValueError(f"ftrun: init({backend!r:.40}) after init() on {_session.backend!r}: a process joins once")
    return _session
