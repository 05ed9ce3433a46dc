"""The worker API: join the job, protect state, run steps that commit only when they completed everywhere."""

from __future__ import annotations

import atexit
import faulthandler
import inspect
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from ftrun import protocol
from ftrun.protocol import Plan, initial_members
from ftrun.worker.channel import AgentChannel
from ftrun.store.client import open_client
from ftrun.worker.injected import WorkerDrills
from ftrun.worker.group import Communicator, Superseded
from ftrun.worker.state import Stateful, load_rescue, pack, save_rescue, unpack


class CollectiveFailed(Exception):
    """A collective of the current generation failed (a peer died or the group was re-formed)."""


class Session:
    """One worker's membership in the job.

    Under ftrun the session learns of each new generation from its agent, re-forms the process group
    among the survivors, agrees with them on the last committed step and takes state from a peer if
    it is behind. Under plain torchrun (no ftrun agent) it is an ordinary DDP loop.
    """

    def __init__(self, backend: str | None = None, timeout: timedelta = timedelta(minutes=30)) -> None:
        self.backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
        self.uid = int(os.environ.get("FTRUN_UID", os.environ.get("RANK", "0")))
        self.spare = os.environ.get("FTRUN_JOINER") == "1"
        self.managed = "FTRUN_CHANNEL_FD" in os.environ and os.environ.get("FTRUN_RECOVERY", "1") == "1"
        self.recovery_timeout = float(os.environ.get("FTRUN_RECOVERY_DEADLINE", "0"))
        """Seconds this worker waits for a recovery to finish (the agent's --recovery-timeout + --join-timeout)."""
        self.protected: dict[str, Stateful] = {}
        self.committed_step = -1
        self.gen = 0
        self._ddps: list[tuple[DistributedDataParallel, dict[str, Any]]] = []
        self._cond = threading.Condition()
        self._state_lock = threading.Lock()  # held while the optimizer steps: a rescue never sees half a step
        self._latest: Plan | None = None
        self._poisoned = False  # a newer plan arrived: nothing more may be issued on this generation
        self._step_failed = False
        self._pending: dict[torch.futures.Future, torch.Tensor] = {}  # hook futures and their buckets
        self._considered = 0  # newest plan generation looked at by recovery
        self._plan_received = time.time()
        self._step = 0
        self._epoch = 0  # steps and recoveries started: a late collective failure only fails its own epoch
        self._entered_epoch = -1  # the epoch whose first collective was reported to the agent
        self._step_started = 0.0
        self._drills = WorkerDrills()  # `ftrun inject exception|slow`, acted out at the start of a step
        atexit.register(_shut_down_group)
        if not self.managed:
            dist.init_process_group(self.backend, timeout=timeout)
            self.channel = None
            return
        self.store = open_client(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), timeout=300)
        self.comm = Communicator(self.store, int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")), self.uid,
                                 self.backend, timeout)
        self.channel = AgentChannel(int(os.environ["FTRUN_CHANNEL_FD"]), self._on_message)
        faulthandler.register(protocol.STACK_DUMP_SIGNAL, all_threads=True)  # the agent's hang watchdog asks
        sizes = [int(n) for n in os.environ.get("FTRUN_NODE_SIZES", os.environ["WORLD_SIZE"]).split(",")]
        first = None if self.spare else Plan(0, initial_members(sizes))
        with self._cond:
            self._latest = self._latest or first or Plan(-1, [])
        if first is None:
            self.gen = self._considered = -1
            self.committed_step = -2  # a joiner is always behind: it takes state even before any commit
            self.comm.start_alone()
        else:
            self.comm.form(first, lambda: False)
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
        model = DistributedDataParallel(module, **kwargs)
        model.register_comm_hook(None, self._allreduce_hook)
        self._ddps.append((model, kwargs))
        return model

    def protect(self, **objects: Stateful) -> None:
        """Register the state a peer sends to a rank that is behind: models, optimizers, schedulers..."""
        self.protected.update(objects)

    def steps(self, total: int) -> Iterator[int]:
        """Yield step numbers up to ``total``; after a fault, the first uncommitted step comes again."""
        if not self.managed:
            for step in range(total):
                self._step = step
                yield step
            return
        if self.spare:
            self.channel.send(protocol.READY, uid=self.uid)
            self._recover()
        else:
            self._restore_rescue()
        step = self.committed_step + 1
        while step < total:
            if self._needs_recovery():
                self._recover()
                step = self.committed_step + 1
                continue
            with self._cond:
                self._step, self._step_failed = step, False
                self._epoch += 1
            self._step_started = time.monotonic()
            self._drills.at_step()
            yield step
            if self.committed_step == step:
                step += 1
            elif not self._needs_recovery():
                raise RuntimeError("ftrun: call commit(optimizer) once in every step of steps()")
        self.channel.send(protocol.FINISHED, step=self.committed_step)

    def commit(self, optimizer: torch.optim.Optimizer, loss: torch.Tensor | None = None) -> float | None:
        """Step ``optimizer`` if this step's collectives completed; returns the loss summed over ranks.

        Returns None when the step was abandoned (a peer was lost): nothing was applied, the gradients
        are dropped and :meth:`steps` yields the same step again after recovery.
        """
        total = None
        if loss is not None:
            summed = loss.detach().reshape(1).to(torch.float64)
            try:
                self._wait(self._issue(lambda: dist.all_reduce(summed, async_op=True)))
                total = float(summed.item())
            except (CollectiveFailed, Superseded):
                self._fail_step()
        with self._cond:
            ok = not (self._poisoned or self._step_failed)
        if not ok:
            optimizer.zero_grad(set_to_none=True)
            return None
        with self._state_lock:
            optimizer.step()
            self.committed_step = self._step
        optimizer.zero_grad(set_to_none=True)
        self._rebuild_buckets()
        if self.channel is not None:
            self.channel.send(protocol.PROGRESS, gen=self.gen, step=self._step, time=time.time(),
                              step_time=time.monotonic() - self._step_started)
        return total

    def _rebuild_buckets(self) -> None:
        """Run DDP's one-time bucket rebuild (a broadcast) now, not in the next forward pass.

        A fresh DDP (at the start, and after each recovery) rebuilds its buckets once, at the start of
        its second forward pass: a collective outside the comm hook, which would raise in the user's
        ``model(x)`` if a peer died then. Here, a failure is left for the next step to meet, as any other.
        """
        if not torch.is_grad_enabled():
            return
        for model, _ in self._ddps:
            try:
                if model.reducer._rebuild_buckets():
                    model._has_rebuilt_buckets = True
            except RuntimeError:
                return  # the group broke: the next step's collectives fail too and recovery follows

    # ------------------------------------------------------ hook and issuing
    def _allreduce_hook(self, _state, bucket):  # noqa: ANN001, ANN202 -- DDP rejects string annotations here
        """DDP comm hook: sum the bucket over the current generation; a failure only discards the step."""
        buffer = bucket.buffer()
        result: torch.futures.Future = torch.futures.Future()
        with self._cond:  # issue and register in one step, so a new plan cannot slip between them
            abandoned = self._poisoned
            epoch = self._epoch
            first_of_step, self._entered_epoch = self._entered_epoch != epoch, epoch
            if abandoned:
                self._step_failed = True
            else:
                work = dist.all_reduce(buffer, async_op=True)
                self._pending[result] = buffer
        if abandoned:
            result.set_result(buffer)
            return result
        if first_of_step and self.channel is not None:
            self.channel.send(protocol.ENTERED, step=self._step)

        def finished(fut: torch.futures.Future) -> None:
            try:
                fut.value()
            except Exception:
                self._fail_step(epoch)
            self._complete({result})

        work.get_future().add_done_callback(finished)
        return result

    def _complete(self, futures: set[torch.futures.Future]) -> None:
        """Complete hook futures (once each), so a blocked backward returns; called outside the lock."""
        with self._cond:
            mine = {fut: self._pending.pop(fut) for fut in futures if fut in self._pending}
            self._cond.notify_all()
        for fut, buffer in mine.items():
            fut.set_result(buffer)

    def _fail_step(self, epoch: int | None = None) -> None:
        """Mark the current step failed; a late failure of an earlier step's collective (``epoch``) is ignored."""
        with self._cond:
            if epoch is None or epoch == self._epoch:
                self._step_failed = True
            self._cond.notify_all()

    def _issue(self, start: Callable[[], dist.Work]) -> dist.Work:
        """Start a collective unless a newer generation was announced (then raise Superseded)."""
        with self._cond:
            if self._poisoned:
                raise Superseded("a newer generation was announced")
            return start()

    def _wait(self, work: dist.Work, deadline: float | None = None) -> None:
        """Wait for ``work`` but give up as soon as a newer generation is announced or the deadline passes."""
        future = work.get_future()
        future.add_done_callback(lambda _: self._notify())
        with self._cond:
            remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
            self._cond.wait_for(lambda: future.done() or self._poisoned, timeout=remaining)
            if not future.done():
                raise Superseded("a newer generation was announced") if self._poisoned else CollectiveFailed("timeout")
        try:
            future.value()
        except Exception as exc:
            raise CollectiveFailed(str(exc)) from exc

    def _notify(self) -> None:
        with self._cond:
            self._cond.notify_all()

    # -------------------------------------------------------------- watcher
    def _on_message(self, message: dict[str, Any]) -> None:
        """Runs on the channel thread: a new plan poisons the current generation and frees a blocked step."""
        if self._drills.on_message(message):
            return
        if message.get("t") == protocol.SAVE:
            self._save_rescue()
        if message.get("t") != protocol.PLAN:
            return
        plan = Plan.from_message(message)
        with self._cond:
            if self._latest is not None and plan.gen <= self._latest.gen:
                return
            self._latest = plan
            self._poisoned = True
            self._plan_received = time.time()
            pending = set(self._pending)
            self._cond.notify_all()
        self.comm.abort()
        self._complete(pending)

    def _save_rescue(self) -> None:
        """The agent asks (before a group restart, or as ftrun is stopped): keep this worker's last committed
        state; a state that cannot be written (a full disk) is answered with the reason."""
        with self._state_lock:
            step = self.committed_step
            try:
                save_rescue(self.protected, step, self._rescue_dir / f"{self.uid}.pt")
            except (OSError, RuntimeError) as exc:
                self.channel.send(protocol.SAVED, step=step, error=(str(exc).splitlines() or [repr(exc)])[0])
                return
        self.channel.send(protocol.SAVED, step=step)

    def _restore_rescue(self) -> None:
        """Start from the best state in the directory the agent names (FTRUN_RESCUE_FROM: the previous
        attempt's rescue after a group restart, an earlier launch's with --resume-from), if any."""
        source = Path(os.environ.get("FTRUN_RESCUE_FROM", ""))
        if source.name and source.is_dir():
            restored = load_rescue(source, self.protected)
            if restored is not None:
                self.committed_step = restored
                if self.rank == 0:
                    print(f"ftrun: resuming from the state of step {restored} saved in {source}",
                          file=sys.stderr, flush=True)

    @property
    def _rescue_dir(self) -> Path:
        return Path(os.environ["FTRUN_RUN_DIR"]) / "rescue"

    def _needs_recovery(self) -> bool:
        with self._cond:
            return self._step_failed or self._latest.gen > self.gen

    # -------------------------------------------------------------- recovery
    def _recover(self) -> None:
        """Join the newest generation: form its group, agree on the committed step, fetch state if behind."""
        deadline = None if self.spare else time.monotonic() + self.recovery_timeout
        while True:
            plan, received = self._next_plan(deadline)
            deadline = deadline or time.monotonic() + self.recovery_timeout
            superseded = lambda: self._latest.gen != plan.gen  # noqa: E731
            try:
                t0 = time.time()
                self.comm.form(plan, superseded)
                t1 = time.time()
                best, source, behind = self._agree(deadline)
                t2 = time.time()
                self._transfer(best, source, behind, deadline)
                self._rebuild_ddp()  # after the transfer: every rank now holds the same state
                t3 = time.time()
            except (Superseded, CollectiveFailed, dist.DistError) as exc:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"ftrun: recovery did not finish in time: {exc}") from exc
                with self._cond:  # a newer plan is coming (a peer failed during recovery): wait for it
                    self._cond.wait_for(lambda: self._latest.gen != plan.gen, timeout=1.0)
                continue
            with self._cond:
                if self._latest.gen != plan.gen:
                    continue
                self.gen = plan.gen
                self.spare = False
            timings = {"abort": round(t0 - received, 6), "rendezvous": round(t1 - t0, 6),
                       "agree": round(t2 - t1, 6), "transfer": round(t3 - t2, 6)}
            self.channel.send(protocol.RECOVERED, gen=plan.gen, step=self.committed_step, timings=timings,
                              received_state=self.rank in behind, plan_received=received)
            return

    def _next_plan(self, deadline: float | None) -> tuple[Plan, float]:
        """Wait for a plan newer than any looked at that places this worker; reopen the gate for it."""
        with self._cond:
            while True:
                timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
                if not self._cond.wait_for(lambda: self._latest.gen > self._considered, timeout=timeout):
                    raise RuntimeError(f"ftrun: no new generation within {self.recovery_timeout:.0f} s of a fault")
                plan = self._latest
                self._considered = plan.gen
                if plan.rank_of(self.uid) is not None:
                    self._poisoned = self._step_failed = False
                    self._epoch += 1  # late failures of the abandoned step's collectives no longer count
                    return plan, self._plan_received
                if not self.spare:
                    raise RuntimeError(f"ftrun: worker {self.uid} was left out of generation {plan.gen}")

    def _agree(self, deadline: float) -> tuple[int, int, list[int]]:
        """All-gather the committed steps: (highest, lowest rank holding it, ranks behind it)."""
        mine = torch.tensor([self.committed_step], dtype=torch.int64)
        steps = [torch.zeros(1, dtype=torch.int64) for _ in range(self.world_size)]
        self._wait(self._issue(lambda: dist.all_gather(steps, mine, async_op=True)), deadline)
        values = [int(t.item()) for t in steps]
        best = max(values)
        return best, values.index(best), [r for r, v in enumerate(values) if v < best]

    def _transfer(self, best: int, source: int, behind: list[int], deadline: float) -> None:
        """The source rank broadcasts its protected state; the ranks behind it load it, the others drop it.

        A broadcast rather than point-to-point sends: Gloo's send/recv work has no future, so it could
        not be abandoned when a newer generation arrives mid-transfer.
        """
        if not behind:
            return
        payload = pack(self.protected, best) if self.rank == source else torch.empty(0, dtype=torch.uint8)
        size = torch.tensor([payload.numel()], dtype=torch.int64)
        self._wait(self._issue(lambda: dist.broadcast(size, source, async_op=True)), deadline)
        if self.rank != source:
            payload = torch.empty(int(size.item()), dtype=torch.uint8)
        self._wait(self._issue(lambda: dist.broadcast(payload, source, async_op=True)), deadline)
        if self.rank in behind:
            self.committed_step = unpack(payload, self.protected)

    def _rebuild_ddp(self) -> None:
        """Rebuild each DDP on the new default group; the user's model object stays the same.

        DDP's reducer holds its process group; re-running its constructor binds the new group and builds
        fresh buckets, so no collective of the abandoned group can write into them. The ranks already hold
        the same state, so the constructor's parameter broadcast is skipped where DDP allows it.
        """
        skip_sync = {"init_sync": False} if "init_sync" in inspect.signature(DistributedDataParallel).parameters else {}
        for model, kwargs in self._ddps:
            DistributedDataParallel.__init__(model, model.module, **{**kwargs, **skip_sync})
            model.register_comm_hook(None, self._allreduce_hook)


def _shut_down_group() -> None:
    """At exit, while the interpreter is whole: shut the current group down, so no backend thread is
    left running into the interpreter's teardown (an abandoned generation's group is never touched)."""
    if dist.is_initialized():
        dist.destroy_process_group()


_session: Session | None = None


def init(backend: str | None = None, timeout: timedelta = timedelta(minutes=30)) -> Session:
    """Join the job (once per process) and return the :class:`Session`.

    Under ftrun a spare or restarted worker returns at once too, with a group of its own; it takes its
    place, and a peer's state, when it reaches :meth:`Session.steps`.
    """
    global _session
    if _session is None:
        _session = Session(backend, timeout)
    return _session
