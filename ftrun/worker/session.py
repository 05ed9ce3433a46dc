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
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.nn  # noqa: F401 -- imported before any group exists, on purpose: see Session._shut_down
from torch.nn.parallel import DistributedDataParallel

from ftrun import protocol
from ftrun.protocol import Plan, initial_members
from ftrun.store.client import open_client
from ftrun.worker import backends, saved_shards, transfer
from ftrun.worker.channel import AgentChannel
from ftrun.worker.ddp_models import DdpModels
from ftrun.worker.entered import EnteredNotice
from ftrun.worker.injected import WorkerDrills
from ftrun.worker.links import LinkFailure
from ftrun.worker.interruptible import Superseded
from ftrun.worker.planes import Planes
from ftrun.worker.progress import ProgressNotice
from ftrun.worker.redundancy import Rebuild, Redundancy, is_sharded, refresh_interval
from ftrun.worker.shards import NOTHING, Choice, Holding, choose, choose_saved
from ftrun.worker.stack_dumps import answer_stack_dump_requests
from ftrun.worker.steps import CollectiveFailed, StepCollectives
from ftrun.worker.state import Stateful, best_rescue, load_into, save_rescue, snapshot, state_of

INVALID_STEP = -2  # a rank whose state is not a committed one (a joiner, or a transfer that broke off): always behind

DEFAULT_RECOVERY_DEADLINE = 90.0
"""Seconds a worker waits for a recovery when its agent names none (FTRUN_RECOVERY_DEADLINE): ftrun's
default --recovery-timeout plus --join-timeout."""


@contextmanager
def _state_from(source: int) -> Iterator[None]:
    """Around taking the state rank ``source`` sends: bytes that are not state (:class:`transfer.MalformedState`)
    end this worker in one line, as another rank's death would; a retry would get the same bytes."""
    try:
        yield
    except transfer.MalformedState as exc:
        raise SystemExit(f"ftrun: cannot take the state rank {source} sent: {exc}") from None


class Session:
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

    def _save_rescue(self, copies: bool) -> None:
        """The agent asks (before a group restart, or as ftrun is stopped): keep this worker's last committed
        state (sharded state: with ``copies``, with the copies it holds of its giver's shard); a state that
        cannot be written (a full disk) is answered with the reason.

        On a thread of its own: a state transfer may hold the state lock, and the channel thread must
        stay free to deliver plans meanwhile.
        """
        with self._state_lock:
            step = self.committed_step
            held = tuple(slot.step for slot in self.redundancy.own) if self.redundancy is not None else ()
            if self._saved is not None and self._saved[0] in ((step, held, copies), (step, held, True)):  # asked twice
                self.channel.send(protocol.SAVED, step=self._saved[1])
                return
            try:
                if self.redundancy is not None:  # its copies of committed steps: the live state may be mid-step
                    written = saved_shards.write(self.redundancy, self._rescue_dir, copies)
                else:
                    save_rescue(self.protected, step, self._rescue_dir / f"{self.uid}.pt")
                    written = step
            except Exception as exc:  # a full disk, or state pickle refuses: the agent waits for the answer
                self.channel.send(protocol.SAVED, step=step, error=(str(exc).splitlines() or [repr(exc)])[0])
                return
            self._saved = ((step, held, copies), written)
        self.channel.send(protocol.SAVED, step=written)

    def _restore_rescue(self) -> None:
        """Start from the best state in the directory the agent names (FTRUN_RESCUE_FROM: the previous
        attempt's rescue after a group restart, an earlier launch's with --resume-from), if any."""
        source = Path(os.environ.get("FTRUN_RESCUE_FROM", ""))
        if source.name and source.is_dir():
            best = best_rescue(source)
            if best is not None:
                try:
                    with self._state_lock:
                        self.committed_step = load_into(best, self.protected)
                except (RuntimeError, ValueError, KeyError, TypeError) as exc:  # another model's state, or names
                    why = " ".join(str(exc).split())[:300]
                    raise SystemExit(f"ftrun: cannot resume from the state of step {best['step']} saved in "
                                     f"{source}: {why}") from None
                if self.rank == 0:
                    print(f"ftrun: resuming from the state of step {self.committed_step} saved in {source}",
                          file=sys.stderr, flush=True)

    def _start_together(self) -> None:
        """Every rank starts from the same committed state: the newest any of them restored (each node reads
        its own rescue directory, which may hold another step, or nothing), sent to the ranks behind.

        Sharded state keeps no rescue files and starts as it is. A collective that fails here is met as
        in a step: the next generation's recovery agrees again.
        """
        if self.redundancy is not None or self.world_size == 1:
            return
        try:
            best, source, behind = self._agree(time.monotonic() + self.recovery_timeout)
            self._transfer(best, source, behind)
        except (CollectiveFailed, LinkFailure, dist.DistError) as exc:
            self._swallowed = exc
            self.collectives.fail()

    def _start_sharded(self) -> None:
        """Every rank starts from the newest step of sharded state whose every shard the previous attempt (or the
        launch --resume-from names) saved, if any: each rank reads its shard's file (a world smaller than the
        one that saved: several), and the ranks send each other the bytes of the new shards, as at a recovery."""
        source = os.environ.get("FTRUN_RESCUE_FROM", "")
        saved = saved_shards.read_for(Path(source), self.rank, self.world_size) if source else []
        mine = [one.holding for one in saved]
        deadline = time.monotonic() + self.recovery_timeout
        try:
            read = self._gather_saved(mine, deadline) if self.world_size > 1 else [mine]
            picked = choose_saved(read)
            if picked is None:
                what = ("does not hold every shard of any step here (rank r reads shards/r.pt, and r + world..., "
                        "on its own node)") if any(read) else "holds no saved shard (shards/<rank>.pt)"
                if self.rank == 0 and source:
                    print(f"ftrun: the sharded state saved in {source} {what}: the workers start from scratch "
                          "(step 0)", file=sys.stderr, flush=True)
                return
            choice, sender = picked
            with self._state_lock, _state_from(sender):
                if saved:  # the sender's layout is that of the files it sends from
                    mine_sent = [s.slot // 2 for s in choice.sources.values() if s.rank == self.rank]
                    self.redundancy.adopt(saved[min(mine_sent, default=0)].layout, *saved_shards.slots_of(saved))
                self.committed_step = INVALID_STEP  # until loaded whole: a recovery never takes it half loaded
                try:
                    self.redundancy.restore(choice, self.planes.control, self.gen, self.members, sender)
                except (CollectiveFailed, LinkFailure, dist.DistError, transfer.MalformedState):
                    raise
                except (RuntimeError, ValueError, KeyError, TypeError) as exc:  # another model's state
                    raise SystemExit(f"ftrun: cannot resume from the state of step {choice.step} saved in "
                                     f"{source}: {' '.join(str(exc).split())[:300]}") from None
                self.committed_step = choice.step
        except (CollectiveFailed, LinkFailure, dist.DistError) as exc:
            self._swallowed = exc
            self.collectives.fail()
            return
        if self.rank == 0:
            print(f"ftrun: resuming from the state of step {choice.step} saved in {source}", file=sys.stderr,
                  flush=True)

    @property
    def _rescue_dir(self) -> Path:
        return Path(os.environ["FTRUN_RUN_DIR"]) / "rescue"

    def _needs_recovery(self) -> bool:
        with self._cond:
            return self.collectives.failed or self._latest.gen > self.gen

    # -------------------------------------------------------------- recovery
    def _recover(self) -> None:
        """Join the newest generation: form its planes, agree on the committed step, fetch state if behind.

        A step (or a recovery) that failed with no new plan to explain it is reported to the agent: every
        process being alive, a link failed, and the leader re-forms the group or excludes a member.
        """
        deadline = None if self.spare else time.monotonic() + self.recovery_timeout
        held = self.committed_step  # the agent counts the steps lost from it
        if self.entered is not None:
            self.entered.left()  # recovering, not waiting in a step's collectives
        with self._cond:
            unexplained = not self.spare and self._latest.gen <= self.gen and self.collectives.failed
        if unexplained:
            self._report(self.gen, "step", self.collectives.error or "a collective failed")
        was_spare = self.spare
        while True:
            plan, received = self._next_plan(deadline)
            deadline = deadline or time.monotonic() + self.recovery_timeout
            superseded = lambda: self._latest.gen != plan.gen  # noqa: E731
            phase = "form"
            try:
                t0 = time.time()
                self.planes.form(plan, superseded)
                t1 = time.time()
                phase = "agree"
                if self.redundancy is not None:
                    choice = self._agree_sharded(plan.gen, deadline)
                    t2 = time.time()
                    phase = "transfer"
                    self._restore_sharded(choice, plan)
                    behind = [self.rank] if was_spare else []
                else:
                    best, source, behind = self._agree(deadline)
                    t2 = time.time()
                    phase = "transfer"
                    self._transfer(best, source, behind)
                self._ddps.rebind()  # after the transfer: every rank now holds the same state
                t3 = time.time()
            except (Superseded, CollectiveFailed, LinkFailure, dist.DistError) as exc:
                if not isinstance(exc, Superseded) and not superseded():
                    self._report(plan.gen, "probe" if isinstance(exc, LinkFailure) else phase, str(exc),
                                 getattr(exc, "unreachable", None))
                if time.monotonic() > deadline:
                    raise RuntimeError(f"ftrun: recovery did not finish in time: {exc}") from exc
                with self._cond:  # a newer plan is coming (a peer failed during recovery): wait for it
                    self._cond.wait_for(lambda: self._latest.gen != plan.gen, timeout=1.0)
                continue
            with self._cond:
                if self._latest.gen != plan.gen:
                    continue
                self.gen, self.members = plan.gen, plan.members
                self.spare = False
            timings = {"abort": round(t0 - received, 6), "rendezvous": round(t1 - t0, 6),
                       "agree": round(t2 - t1, 6), "transfer": round(t3 - t2, 6)}
            self.channel.send(protocol.RECOVERED, gen=plan.gen, step=self.committed_step, held=held, timings=timings,
                              received_state=self.rank in behind, plan_received=received,
                              data_plane="reconfigured" if self.planes.in_place else "formed")
            return

    def _report(self, gen: int, phase: str, error: str, unreachable: dict[int, list[int]] | None = None) -> None:
        """Tell the agent a collective of generation ``gen`` failed in ``phase`` with no death to explain it."""
        self.channel.send(protocol.COLLECTIVE_FAILED, gen=gen, step=self._step, phase=phase,
                          error=error.strip().splitlines()[0] if error.strip() else phase,
                          unreachable=None if unreachable is None else {str(k): v for k, v in unreachable.items()})

    def _release_stale(self) -> None:
        """Release the aborted generations' groups once none of their completion callbacks can still run
        (else at a later commit: never wait for them on the step path)."""
        if self.collectives.quiet(0):
            self.planes.release()

    def _next_plan(self, deadline: float | None) -> tuple[Plan, float]:
        """Wait for a plan newer than any looked at that places this worker; reopen the gate for it."""
        with self._cond:
            while True:
                timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
                if not self._cond.wait_for(lambda: self._latest.gen > self._considered, timeout=timeout):
                    raise RuntimeError(f"ftrun: no new generation within {self.recovery_timeout:.0f} s of a fault") \
                        from self._swallowed
                plan = self._latest
                self._considered = plan.gen
                if plan.rank_of(self.uid) is not None:
                    self.collectives.reopen()
                    return plan, self._plan_received
                if not self.spare:
                    raise RuntimeError(f"ftrun: worker {self.uid} was left out of generation {plan.gen}")

    def _agree(self, deadline: float) -> tuple[int, int, list[int]]:
        """All-gather the committed steps on the control plane: (highest, lowest rank holding it, ranks behind)."""
        mine = torch.tensor([self.committed_step], dtype=torch.int64)
        steps = [torch.zeros(1, dtype=torch.int64) for _ in range(self.world_size)]
        control = self.planes.control
        self.collectives.wait(self.collectives.issue(lambda: control.allgather([steps], [mine])), deadline)
        values = [int(t.item()) for t in steps]
        best = max(values)
        if best < -1:
            raise RuntimeError("ftrun: no member of the new generation holds a committed state to resume from")
        return best, values.index(best), [r for r, v in enumerate(values) if v < best]

    def _agree_sharded(self, gen: int, deadline: float) -> Choice:
        """All-gather what each rank holds of the sharded state; every rank picks the same step and sources."""
        self.redundancy.wait(max(0.0, deadline - time.monotonic()))  # an aborted refresh ends at once
        choice = choose(self._gather_holdings(self.redundancy.holding(self.committed_step, self.spare), deadline))
        if choice is None:  # every rank sees it: the agent falls back to a group restart and stops this worker
            reason = "a rank and its buddy were lost together: a shard of the sharded state is in no memory"
            self.channel.send(protocol.UNRECOVERABLE, gen=gen, reason=reason)
            with self._cond:
                self._cond.wait_for(lambda: time.monotonic() >= deadline, timeout=max(0.0, deadline - time.monotonic()))
            sys.exit(f"ftrun: {reason}; no group restart came within the recovery deadline")
        return choice

    def _gather_holdings(self, holding: Holding, deadline: float) -> list[Holding]:
        """Every rank's holding of sharded state, in rank order (an all-gather on the control plane)."""
        return [Holding.from_list(values) for values in self._gather_ints(holding.to_list(), deadline)]

    def _gather_saved(self, mine: list[Holding], deadline: float) -> list[list[Holding]]:
        """What every rank read of the saved shards, in rank order: how many files each, then their holdings."""
        most = max(count for (count,) in self._gather_ints([len(mine)], deadline))
        if not most:
            return [[] for _ in range(self.world_size)]
        padded = [value for holding in [*mine, *[NOTHING] * (most - len(mine))] for value in holding.to_list()]
        width = len(NOTHING.to_list())
        return [[h for h in (Holding.from_list(values[i:i + width]) for i in range(0, len(values), width))
                 if h.index >= 0] for values in self._gather_ints(padded, deadline)]

    def _gather_ints(self, values: list[int], deadline: float) -> list[list[int]]:
        """Every rank's ``values`` (as many on every rank), in rank order: an all-gather on the control plane."""
        mine = torch.tensor(values, dtype=torch.int64)
        held = [torch.zeros_like(mine) for _ in range(self.world_size)]
        control = self.planes.control
        self.collectives.wait(self.collectives.issue(lambda: control.allgather([held], [mine])), deadline)
        return [t.tolist() for t in held]

    def _restore_sharded(self, choice: Choice, plan: Plan) -> None:
        """Move the chosen copies into the new shards, rebuild the objects over this world and load them;
        then copy the result to the buddies at once, so the new generation is redundant from its start."""
        with self._state_lock, _state_from(0):
            self.committed_step = INVALID_STEP
            self.redundancy.restore(choice, self.planes.control, plan.gen, plan.members)
            self.committed_step = choice.step
        if not self.redundancy.every:
            return  # no copies are kept (refresh_every 0)
        with self._state_lock:
            self.redundancy.refresh(choice.step, self.planes.control)
        self.redundancy.wait()
        if not self.redundancy.copied(choice.step):
            raise CollectiveFailed("the copy to the buddies after recovery broke off")

    def _transfer(self, best: int, source: int, behind: list[int]) -> None:
        """The source sends its protected state to the ranks behind it (and only to them), device to device.

        A receiver changes its state in place, under the state lock (a rescue never saves half of it); if
        the transfer breaks off, its state is marked invalid, so that it is behind in the next agreement.
        """
        if self.rank == source and behind:
            try:
                transfer.send(snapshot(self.protected, best), behind, self._route())
            except transfer.UnsendableState as exc:
                raise SystemExit(f"ftrun: cannot send the protected state to ranks {behind}: {exc}") from None
        elif self.rank in behind:
            with self._state_lock, _state_from(source):
                self.committed_step = INVALID_STEP
                received = transfer.receive(source, snapshot(self.protected, INVALID_STEP), self._route())
                self.committed_step = load_into(received, self.protected)

    def _route(self) -> transfer.Route:
        """Tensors of the devices the data plane takes travel on it, through host memory where it moves them
        in collectives only (Gloo with CUDA tensors); CPU tensors otherwise on the control plane."""
        control = transfer.p2p_on_backend(self.planes.control)
        data = transfer.p2p_on_group(dist.group.WORLD)
        kinds = {kind for kind in backends.served(self.backend)
                 if kind == "cpu" or (kind == "cuda" and torch.cuda.is_available())}
        native = backends.moves_point_to_point(self.backend)
        host = data if "cpu" in native else control
        exchanges = {kind: data if kind in native else transfer.via_host(host) for kind in kinds}
        exchanges.setdefault("cpu", control)
        return transfer.Route(exchanges, {kind: backends.device_of(kind) for kind in exchanges}, control)

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

        Not when an unhandled exception ends the process (Python set ``sys.last_value`` as it printed it): that
        is a fault, and the groups close with the process, when its agent sees it die. Closed here, the peers'
        collectives would fail while it still lives, which reads as a link fault with every worker alive.
        """
        if getattr(sys, "last_value", None) is None:
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
