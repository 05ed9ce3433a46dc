"""How a worker recovers, and the state it keeps for a restart: a part of :class:`~ftrun.worker.session.Session`.

:class:`Recovery` joins each new generation (forms its planes, agrees on the committed step, moves state to
the ranks behind, or re-shards sharded state from the copies in peers' memory), starts a launch or a group
restart from the state saved before (``--resume-from``, the previous attempt's rescue), and saves that state
when the agent asks. It works on the session's attributes, declared below; the session sets them.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.distributed as dist

from ftrun import protocol
from ftrun.protocol import Plan
from ftrun.worker import backends, saved_shards, transfer
from ftrun.worker.channel import AgentChannel
from ftrun.worker.ddp_models import DdpModels
from ftrun.worker.entered import EnteredNotice
from ftrun.worker.interruptible import Superseded
from ftrun.worker.links import LinkFailure
from ftrun.worker.planes import Planes
from ftrun.worker.redundancy import Redundancy
from ftrun.worker.shards import NOTHING, Choice, Holding, choose, choose_saved
from ftrun.worker.state import Stateful, best_rescue, load_into, save_rescue, snapshot
from ftrun.worker.steps import CollectiveFailed, StepCollectives

INVALID_STEP = -2  # a rank whose state is not a committed one (a joiner, or a transfer that broke off): always behind


@contextmanager
def _state_from(source: int) -> Iterator[None]:
    """Around taking the state rank ``source`` sends: bytes that are not state (:class:`transfer.MalformedState`)
    end this worker in one line, as another rank's death would; a retry would get the same bytes."""
    try:
        yield
    except transfer.MalformedState as exc:
        raise SystemExit(f"ftrun: cannot take the state rank {source} sent: {exc}") from None


def _cannot_resume(step: int, source: object, exc: BaseException) -> SystemExit:
    """The one line a worker ends with when the state saved in ``source`` does not load into its objects (another
    model's, or other names)."""
    return SystemExit(f"ftrun: cannot resume from the state of step {step} saved in {source}: "
                      f"{' '.join(str(exc).split())[:300]}")


class Recovery:
    """The session's recovery and saved state (see the module's docstring)."""

    backend: str
    uid: int
    spare: bool
    recovery_timeout: float
    protected: dict[str, Stateful]
    redundancy: Redundancy | None
    committed_step: int
    gen: int
    members: list[int]
    channel: AgentChannel | None
    entered: EnteredNotice | None
    collectives: StepCollectives
    planes: Planes | None
    _swallowed: BaseException | None
    _cond: threading.Condition
    _state_lock: threading.Lock
    _saved: tuple[tuple[int, tuple[int, ...], bool], int] | None
    _latest: Plan | None
    _considered: int
    _plan_received: float
    _step: int
    _ddps: DdpModels
    rank: int  # the session's properties: this worker's rank in the current generation, and its size
    world_size: int

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
                    raise _cannot_resume(best["step"], source, exc) from None
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
                    raise _cannot_resume(choice.step, source, exc) from None
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
