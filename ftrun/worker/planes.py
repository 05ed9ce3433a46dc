"""The two planes of each generation: a data group on the user's backend and a CPU Gloo control group.

Data plane: the default process group, on the user's backend (NCCL on CUDA, Gloo on CPU). DDP's gradient
all-reduce and the bulk of a state transfer run on it, as does any ``torch.distributed`` call of the user's
script. Control plane: a Gloo group of the same members, not registered with ``torch.distributed`` (the
user's code cannot reach it by accident), for everything with CPU tensors: agreement on the committed
step, transfer sizes and the small tensors of the state. A per-device default group (``"cpu:gloo,
cuda:nccl"``) would give one group on a CPU machine, where the CPU suite would then run another code path
than a GPU; two groups run the same path on both.

One store barrier per generation (which a newer plan can interrupt), then both planes form at once, each on
its own store prefix: no second rendezvous in series.

The stale generation is aborted on both planes at once when the next plan arrives, from the channel
thread: on NCCL every data group's ``abort`` on a thread of its own (it takes about a second to tear a
communicator down, and the next generation forms meanwhile), and for every Gloo group the shutdown of the
generation's own TCP connections (Gloo's ``abort`` is a no-op, and torch's in-place ``_reconfigure`` on
Gloo leaves the collectives in flight blocked: tests/test_torch_reconfigure.py). Every collective in
flight then fails at once, here and on every peer; once they have, and the aborts are done, the stale
groups hold no blocked thread and are released (their threads end and their sockets close), off the
recovery's critical path.

In place (``--data-reconfigure native``, where the backend offers torch's reconfigure): each process makes its
data group once, for reconfigure (``enable_reconfigure=True``: no rendezvous yet), and each generation
re-forms it with ``_reconfigure`` over the members' handles, in rank order, instead of forming a new default
group. A reconfigure rendezvouses through the store the group was made with, keyed by the group's name and the
uuid (Gloo and torch 2.15's NCCL backend alike: scripts/reconfigure_probe.py), so every process of an attempt
makes its group on one prefix, a spare's alone included, and each reconfigure takes a uuid no other takes on
it: the generation's (plus one), or for a spare alone one of its own. Each member's handle travels as the
value of its barrier key: no second rendezvous. At a plan the data group is aborted as in the fresh mode, and
kept: torch 2.15's NCCL backend revokes a group made for reconfigure (``ncclCommRevoke``) where it would tear
another down, so a kernel waiting for a dead peer ends at the plan, not at the reconfigure, and the reconfigure
then replaces the revoked communicator (torch/csrc/distributed/c10d/nccl2/ProcessGroupNCCL.cpp ``abort``,
ReconfigureNCCL.cpp). The reconfigure waits for that abort to end: neither locks against the other. Gloo's
connections are shut down as in the fresh mode (its reconfigure leaves collectives in flight blocked). A new
leader's store (a moved rendezvous) gets a new group made for reconfigure.
"""

from __future__ import annotations

import os
import socket
import stat
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

from ftrun.protocol import Plan, split_address
from ftrun.store import keys
from ftrun.store.client import open_client
from ftrun.store.wire import StoreClient
from ftrun.worker import backends, links
from ftrun.worker.interruptible import InterruptibleStore, StoreTimeout, Superseded
from ftrun.worker.steps import first_line


def _open_fds() -> set[int]:
    """This process's open descriptors: a listing of /dev/fd, a fraction of a millisecond (psutil's table of
    connections parses the whole machine's TCP tables: 10-15 ms a call on 2 busy cores, on the recovery path)."""
    return {fd for fd in map(int, os.listdir("/dev/fd")) if _is_open(fd)}  # not the listing's own, closed now


def _is_open(fd: int) -> bool:
    try:
        os.fstat(fd)
    except OSError:
        return False
    return True


Sockets = dict[int, tuple[int, int]]
"""Connected TCP sockets by descriptor: descriptor -> the socket's identity (device and inode), which tells it
apart from a later socket given the same descriptor number once this one is closed."""


def _identity(fd: int) -> tuple[int, int]:
    status = os.fstat(fd)
    return status.st_dev, status.st_ino


def _connected_tcp(fds: set[int]) -> Sockets:
    """Those of ``fds`` that are connected TCP sockets (listeners left out: Gloo's must keep accepting)."""
    found: Sockets = {}
    for fd in fds:
        try:
            if not stat.S_ISSOCK(os.fstat(fd).st_mode):
                continue
            with socket.socket(fileno=os.dup(fd)) as sock:
                if sock.type == socket.SOCK_STREAM and sock.family in (socket.AF_INET, socket.AF_INET6):
                    sock.getpeername()  # raises for a socket not connected: a listener
                    found[fd] = _identity(sock.fileno())
        except OSError:
            continue  # closed meanwhile (the listing's own descriptor), or not connected
    return found


def _shut_down(sockets: Sockets) -> None:
    """Shut down the sockets of ``sockets`` (both directions) without closing their descriptors.

    A descriptor whose socket is gone is left alone: Gloo closes a connection whose peer died, and the number
    is then free for any socket opened after it (the script's, a new generation's), which must not be cut.
    """
    for fd, identity in sockets.items():
        try:
            copy = os.dup(fd)
        except OSError:
            continue  # closed, its number free
        if _identity(copy) != identity:
            os.close(copy)
            continue
        with socket.socket(fileno=copy) as sock:  # the same socket: the object owns the copy and closes it
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass  # no longer connected


EXIT_ABORT_WAIT = 60.0  # seconds an exiting worker waits for aborts still running (NCCL's take about one)
ALONE_UUID = 1 << 40
"""In place: a spare's group alone is reconfigured with this plus its uid, a uuid no generation (the
generation's number plus one) ever takes on the shared prefix."""


@dataclass
class Generation:
    """One generation's groups: ``data`` is the default group, ``control`` a Gloo group beside it."""

    gen: int
    data: dist.ProcessGroup
    control: dist.ProcessGroup
    sockets: Sockets  # the Gloo connections of both groups: shut down to abort them
    aborts: list[threading.Thread] = field(default_factory=list)  # its data groups' aborts, once started

    def aborting(self) -> bool:
        """Whether an abort of its data groups still runs."""
        return any(thread.is_alive() for thread in self.aborts)


class Planes:
    """Owns both process groups across generations, one fresh pair per generation.

    Group keys live under ``ftrun/a<attempt>/g<gen>``, so no key of a dead generation or attempt is ever
    read. ``release`` frees the aborted generations once nothing of theirs can still run.
    """

    def __init__(self, store: dist.TCPStore, attempt: int, uid: int, backend: str, timeout: timedelta,
                 in_place: bool = False) -> None:
        self.store = store
        self._rendezvous = _rendezvous_clients(store.host, store.port, store.timeout.total_seconds())
        self.attempt = attempt
        self.prober = links.Prober()
        self.uid = uid
        self.backend = backend
        self.timeout = timeout
        self.current: Generation | None = None
        self._lock = threading.Lock()
        self._aborted: list[Generation] = []  # stale generations waiting to be released
        self._moved_to = ""  # the store address the last plan that named one named ("": none yet)
        self.in_place = in_place
        """Whether the data group is re-formed in place by torch's reconfigure (else formed anew each time)."""
        self._reconfigurable: dist.ProcessGroup | None = None  # in place: the data group, once made
        self._reconfigurable_store: dist.Store | None = None  # ... and the store it rendezvouses through

    @property
    def stale(self) -> bool:
        """Whether aborted generations wait to be released."""
        return any(g is not self.current for g in self._aborted)

    @property
    def control(self) -> dist.ProcessGroup:
        """The current generation's control group."""
        return self.current.control

    def _move(self, host: str, port: int) -> None:
        """Rendezvous through the store at ``host:port`` from now on: a new leader serves it (the first one's
        node was lost, with its store)."""
        timeout = self.store.timeout.total_seconds()
        self.store = open_client(host, port, timeout)
        for client in self._rendezvous:
            client.close()
        self._rendezvous = _rendezvous_clients(host, port, timeout)
        if self._reconfigurable is not None:  # its store is gone: the group goes as a fresh one would, and the
            self.abort(sys.maxsize)           # next is made for reconfigure on the new store
            self._reconfigurable = self._reconfigurable_store = None
            self._retire()

    def start_alone(self) -> None:
        """Groups of this worker alone: a spare waits in them until a plan places it."""
        handle = self._handle(lambda: False) if self.in_place else None
        self._form(f"alone{self.uid}", -1, 0, 1, handles=[handle] if self.in_place else None,  # (read again:
                   uuid=ALONE_UUID + self.uid)                                              # it may fall back)

    def form(self, plan: Plan, superseded: Callable[[], bool]) -> None:
        """Form ``plan``'s planes; raises :class:`Superseded` if a newer plan comes during the barrier.

        A plan that asks for a probe first checks every link among its members; :class:`LinkFailure`
        (and nothing formed) if one does not connect.
        """
        if plan.store and plan.store != self._moved_to:
            # a new leader's store, even at the old one's address: one freed a moment ago on the same machine
            # is the kernel's likely pick for a new port, and the old connection there is dead
            self._moved_to = plan.store
            self._move(*split_address(plan.store))
        if plan.probe:
            links.probe(self.store, self.prober, self.uid, plan.members,
                        lambda uid: keys.probe_address(self.attempt, plan.gen, uid),
                        lambda uid: keys.probe_result(self.attempt, plan.gen, uid),
                        lambda waited: self._wait_keys(waited, superseded))
        mark = self._handle(superseded) if self.in_place else "1"  # in place, the handle: no second rendezvous
        self.store.set(keys.arrived(self.attempt, plan.gen, self.uid), mark)
        arrived = {uid: keys.arrived(self.attempt, plan.gen, uid) for uid in plan.members}
        try:
            self._wait_keys(list(arrived.values()), superseded)
        except StoreTimeout:
            missing = [uid for uid, key in arrived.items() if not self.store.check([key])]
            raise RuntimeError(f"ftrun: worker{'s' if len(missing) > 1 else ''} {missing} did not reach generation "
                               f"{plan.gen}'s barrier within {self.timeout.total_seconds():g} s (the process group "
                               "timeout of ftrun.init)") from None
        self.abort(plan.gen)
        self._retire()
        handles = None
        if self.in_place:  # each member's handle, in rank order: rank r is the r-th handle's
            in_order = [arrived[uid] for uid in sorted(plan.members, key=plan.rank_of)]
            handles = [value.decode() for value in self.store.multi_get(in_order)]
            self.wait_aborts(self.timeout.total_seconds())  # NCCL's revoke ends before its reconfigure begins
        self._form(f"g{plan.gen}", plan.gen, plan.rank_of(self.uid), plan.world_size, superseded, handles=handles,
                   uuid=plan.gen + 1)

    def abort(self, before: int) -> None:
        """Make every collective in flight on the current planes fail now, here and on their peers, if they
        are of a generation before ``before`` (the plan that supersedes them: a plan the main thread has
        already formed, ahead of the channel thread, is left alone).

        Safe to call from the channel thread, and more than once; returns at once (the data groups' aborts
        run on threads of their own); the aborted groups are released later. A second caller waits for the
        first caller's abort to end, so no generation is retired (its sockets closed, their numbers reused by
        the next one's) while its abort runs.
        """
        with self._lock:
            current = self.current
            if current is None or current.gen >= before or current in self._aborted:
                return
            self._aborted.append(current)
            current.aborts = backends.abort(current.data)
            _shut_down(current.sockets)

    def release(self) -> None:
        """Free the aborted generations' groups whose aborts are done: their threads end and their sockets
        close (one still aborting is freed by a later call).

        Call only once no collective of theirs can still complete into Python (every hook future done):
        a group's destructor joins its threads, and a thread waiting for the interpreter would never end.
        """
        with self._lock:
            stale = [g for g in self._aborted if g is not self.current and not g.aborting()]
            self._aborted = [g for g in self._aborted if g not in stale]
        for generation in stale:
            backends.shut_down(generation.control)
        del stale  # the last references: each destructor joins its (now idle) threads and closes its sockets

    def wait_aborts(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds for the aborts of the aborted generations; whether all are done."""
        deadline = time.monotonic() + timeout
        threads = self._abort_threads()
        for thread in threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        return not any(thread.is_alive() for thread in threads)

    def destroy(self) -> None:
        """At exit: shut the current planes down, so no backend thread runs into the interpreter's teardown
        (under the lock: a plan that arrives meanwhile finds nothing left to abort)."""
        self.wait_aborts(min(self.timeout.total_seconds(), EXIT_ABORT_WAIT))
        with self._lock:
            if self.current is not None:
                backends.shut_down(self.current.control)
            if dist.is_initialized():
                dist.destroy_process_group()
            self.current = None

    def _abort_threads(self) -> list[threading.Thread]:
        """The abort threads started for the aborted generations (none on Gloo)."""
        with self._lock:
            return [thread for generation in self._aborted for thread in generation.aborts]

    def _retire(self) -> None:
        """Take the aborted groups out of torch.distributed, so the next default group can be formed: where
        they were aborted on threads (NCCL), while those still run; else (Gloo, whose connections were shut
        down) by destroying them."""
        if not dist.is_initialized() or self._reconfigurable is not None:
            return  # in place, the data group stays: the next generation reconfigures it
        aborting = self._abort_threads()
        if aborting:
            backends.forget_groups(aborting)
        else:
            dist.destroy_process_group()

    def _data_store(self, prefix: str, superseded: Callable[[], bool]) -> dist.Store:
        """The store a data group of ``prefix`` rendezvouses through."""
        if "nccl" in self.backend:  # NCCL's rendezvous is not served to C++ through Python, as Gloo's is
            return dist.PrefixStore(prefix, self.store)
        return InterruptibleStore(self._rendezvous[0], superseded, prefix)  # Gloo's runs inside init, through it

    def _handle(self, superseded: Callable[[], bool]) -> str:
        """In place: this process's reconfigure handle, its data group made first if need be (for reconfigure:
        no rendezvous yet, on the prefix every process of the attempt shares). A backend that turns out not to
        offer reconfigure leaves the group unmade and this process in the fresh mode (every process of a job
        has the same backend, so all of them do): the handle is then a plain mark."""
        if self._reconfigurable is None:
            hook = sys.excepthook
            store = self._data_store(keys.group_prefix(self.attempt, "data"), superseded)
            try:  # a rank of its own (its uid) for the handle: every handle must differ from every other
                dist.init_process_group(self.backend, store=store, rank=self.uid, world_size=self.uid + 1,
                                        timeout=self.timeout, enable_reconfigure=True)
            except Exception as exc:
                raise _formation_failed("the data group", exc, superseded()) from None
            sys.excepthook = hook
            if not dist._supports_reconfigure():
                print(f"ftrun: --data-reconfigure native: the {self.backend} backend here cannot reconfigure in "
                      "place; each generation forms a fresh data group", file=sys.stderr, flush=True)
                dist.destroy_process_group()
                self.in_place = False
                return "1"
            self._reconfigurable, self._reconfigurable_store = dist.group.WORLD, store
        if isinstance(self._reconfigurable_store, InterruptibleStore):
            self._reconfigurable_store.superseded = superseded  # this formation's plan ends its waits
        return dist._get_reconfigure_handle(self._reconfigurable)

    def _form(self, name: str, gen: int, rank: int | None, world_size: int,
              superseded: Callable[[], bool] = lambda: False, handles: list[str] | None = None,
              uuid: int = 0) -> None:
        """Form the data and control groups at once, each on its own store prefix (in place: reconfigure the
        data group over ``handles`` with ``uuid``); a newer plan ends their rendezvous (:class:`Superseded`)
        where it goes through the store (Gloo; NCCL reads it later)."""
        before, hook = _open_fds(), sys.excepthook
        control_prefix = keys.group_prefix(self.attempt, f"{name}/control")
        control_store = InterruptibleStore(self._rendezvous[1], superseded, control_prefix)
        control: list[dist.ProcessGroup] = []
        failure: list[BaseException] = []

        def form_control() -> None:
            try:
                control.append(dist.ProcessGroupGloo(control_store, rank, world_size, self.timeout))
            except BaseException as exc:  # noqa: BLE001 -- re-raised in the forming thread below
                failure.append(exc)

        thread = threading.Thread(target=form_control, name="ftrun-control-plane", daemon=True)
        thread.start()
        try:
            if handles is not None:
                with backends.on_own_device(self.backend):
                    dist._reconfigure(uuid, handles, self._reconfigurable, self.timeout).wait()
            else:
                dist.init_process_group(self.backend, store=self._data_store(keys.group_prefix(self.attempt, name),
                                                                             superseded),
                                        rank=rank, world_size=world_size, timeout=self.timeout,
                                        **backends.init_options(self.backend))
        except Exception as exc:
            raise _formation_failed(name, exc, superseded()) from None
        finally:
            thread.join()
        sys.excepthook = hook  # torch's would stack a "[rankN]:" prefix per group; the agent prefixes lines
        if failure:
            raise _formation_failed(name, failure[0], superseded()) from None
        with self._lock:
            self.current = Generation(gen, dist.group.WORLD, control[0], _connected_tcp(_open_fds() - before))

    def _wait_keys(self, keys: list[str], superseded: Callable[[], bool]) -> None:
        """Wait for every key up to the process group timeout (:class:`StoreTimeout`), ending at once with
        :class:`Superseded` when a newer plan comes (torch's own store waits cannot be cut short)."""
        InterruptibleStore(self._rendezvous[0], superseded).wait(keys, self.timeout)


def _formation_failed(name: str, error: BaseException, superseded: bool) -> BaseException:
    """What a group's failed formation raises: :class:`Superseded` when a newer plan came (torch may hand the
    store's Superseded back as an error of its own), else a DistError, which the recovery reports and then
    waits for the next plan on. Gloo's rendezvous raises a plain RuntimeError when a peer closes a connection
    while it connects (a peer dying before its agent has seen it): that must not end a survivor."""
    if superseded:
        return Superseded(name)
    if isinstance(error, dist.DistError):
        return error
    return dist.DistNetworkError(f"forming {name}: {first_line(error)}")


def _rendezvous_clients(host: str, port: int, timeout: float) -> tuple[StoreClient, StoreClient]:
    """The connections the data and the control plane rendezvous through (:class:`InterruptibleStore`),
    ftrun's own client: its waits end the moment their keys are written and can be withdrawn silently. One
    each: a connection serves one request at a time and is held through a wait, so two groups forming at
    once on one connection could deadlock across ranks (each waiting for a key the other's blocked thread
    has yet to set)."""
    return StoreClient(host, port, timeout), StoreClient(host, port, timeout)


def is_cpu(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` travels on the control plane (CPU memory) rather than the data plane."""
    return tensor.device.type == "cpu"
