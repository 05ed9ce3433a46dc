"""The two planes: control collectives never touch the data group, and nothing leaks per generation.

Real worker processes on real Gloo groups. The first test runs the worker API under ftrun with a data
group that, like NCCL's, takes no CPU tensors; the second plays the agent itself over the workers'
control channels to drive 20 generations in a row through the same three processes.
"""

from __future__ import annotations

import json
import re
import selectors
import socket
import subprocess
import sys
import threading
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from runs import NATIVE, read_run

from ftrun.protocol import STACK_DUMP_SIGNAL, Plan
from ftrun.store import keys
from ftrun.store.client import open_client
from ftrun.worker import backends
from ftrun.worker.planes import Planes, _connected_tcp, _open_fds, _shut_down

STRICT = re.compile(r"commit uid=(\d+) rank=(\d+) world=(\d+) step=(\d+) loss=(\S+) sum=(\S+)$")


@pytest.mark.fast
def test_a_data_group_of_cuda_only_rejects_cpu_tensors(free_port):
    # what makes the next test meaningful: such a group raises on a CPU tensor, as NCCL's does
    store = dist.TCPStore("127.0.0.1", free_port(), is_master=True, wait_for_workers=False)
    dist.init_process_group("cuda:gloo", store=store, rank=0, world_size=1, timeout=timedelta(seconds=30))
    try:
        with pytest.raises(RuntimeError, match="device type cpu"):
            dist.all_reduce(torch.ones(1))
    finally:
        dist.destroy_process_group()


@pytest.mark.compat
@pytest.mark.parametrize("data_reconfigure", ["fresh", NATIVE])
def test_recovery_with_a_data_group_that_rejects_cpu_tensors_uses_only_the_control_plane(run_ftrun, workload,
                                                                                         tmp_path, data_reconfigure):
    # uid 2 is killed before step 5, when the spare is ready: the spare takes its place and receives the
    # whole state (parameters, Adam moments and step counts) from a peer; every collective ftrun issues on
    # CPU tensors must go to the control plane, or the worker raises and the job fails. native: the data
    # group is re-formed by torch's reconfigure, the spare's (made alone) among the survivors' in place
    steps = 9
    result = run_ftrun("--nproc-per-node", 4, "--spares", 1, "--hang-timeout", 300, "--log-dir", tmp_path,
                       "--data-reconfigure", data_reconfigure, workload("strict_planes.py"), steps,
                       env={"FAULTS": "kill:5:2", "AWAIT": "5:joiner_ready"}, timeout=150)
    run = read_run(result, tmp_path)
    why = run.explain()
    assert run.returncode == 0, why
    (recovery,) = run.of("recovery")
    assert (recovery["world_before"], recovery["world_after"], recovery["joiners"]) == (4, 4, [4]), why
    assert recovery["data_plane"] == ("reconfigured" if data_reconfigure == "native" else "formed"), why
    assert recovery["steps_lost"] == 0 and recovery["resumed_at_step"] == 5, why
    commits: dict[int, dict[int, tuple[str, str]]] = {}
    for line in run.stdout.splitlines():
        if match := STRICT.search(line):
            uid, _, world, step, loss, total = match.groups()
            commits.setdefault(int(step), {})[int(uid)] = (loss, total)
    assert sorted(commits) == list(range(steps)), why
    for step, by_uid in commits.items():
        members = {0, 1, 2, 3} if step < 5 else {0, 1, 3, 4}
        if step == 4:  # the step in flight at the kill: a rank whose last message from uid 2 never came aborted it
            assert 2 in by_uid and set(by_uid) <= members, f"step {step}\n{why}"  # and took it from a peer
        else:
            assert set(by_uid) == members, f"step {step}\n{why}"
        assert len(set(by_uid.values())) == 1, f"ranks disagree at step {step}: {by_uid}\n{why}"


@pytest.mark.fast
def test_the_sockets_a_generation_opened_are_its_connected_tcp_ones(tmp_path):
    # The abort shuts down exactly what forming a generation opened: connected TCP sockets, never a listener
    # (Gloo's must keep accepting), nor anything else opened meanwhile.
    before = _open_fds()
    listener = socket.create_server(("127.0.0.1", 0))
    client = socket.create_connection(listener.getsockname())
    served, _ = listener.accept()
    datagram = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    local, _ = socket.socketpair()
    with open(tmp_path / "file", "w") as file:
        opened = _open_fds() - before
        assert {listener.fileno(), client.fileno(), served.fileno(), datagram.fileno(), file.fileno()} <= opened
        assert set(_connected_tcp(opened)) == {client.fileno(), served.fileno()}
    for sock in (listener, client, served, datagram, local, _):
        sock.close()


@pytest.mark.fast
def test_an_abort_cuts_only_the_sockets_it_recorded_not_a_later_one_under_the_same_number():
    # Gloo closes a connection whose peer died; the next socket opened takes its number (the lowest free one),
    # and an abort that shut down "that number" would cut it: a new generation's connection, or the script's.
    listener = socket.create_server(("127.0.0.1", 0))
    old = socket.create_connection(listener.getsockname())
    old_served, _ = listener.accept()
    recorded = _connected_tcp({old.fileno()})
    number = old.fileno()
    old.close()
    new = socket.create_connection(listener.getsockname())
    new_served, _ = listener.accept()
    try:
        assert new.fileno() == number  # the kernel hands out the lowest free number: the one just freed
        _shut_down(recorded)
        new.sendall(b"ping")
        assert new_served.recv(4) == b"ping"
        _shut_down(_connected_tcp({number}))  # recorded now, it is cut
        assert new_served.recv(4) == b""
    finally:
        for sock in (listener, old_served, new, new_served):
            sock.close()


@pytest.mark.fast
def test_a_generation_is_not_retired_while_another_threads_abort_of_it_runs(free_port, monkeypatch):
    # The channel thread aborts the generation as a plan arrives, while the main thread, woken by the same
    # plan, forms the next one: retiring the old groups closes their sockets, and the next generation's take
    # the numbers freed. Forming must wait for the abort in progress, else the abort cuts the new sockets.
    formed_meanwhile = []
    forming: list[threading.Thread] = []
    store = dist.TCPStore("127.0.0.1", free_port(), is_master=True, wait_for_workers=False)
    planes = Planes(store, attempt=0, uid=0, backend="gloo", timeout=timedelta(seconds=30))
    aborting = backends.abort

    def slow_abort(group):  # the channel thread, descheduled in the middle of its abort
        forming.append(threading.Thread(target=planes.form, args=(Plan(1, [0]), lambda: False)))
        forming[0].start()
        forming[0].join(2)
        formed_meanwhile.append(not forming[0].is_alive())
        return aborting(group)

    try:
        planes.form(Plan(0, [0]), lambda: False)
        monkeypatch.setattr(backends, "abort", slow_abort)
        planes.abort(1)
        forming[0].join(60)
        assert formed_meanwhile == [False] and planes.current.gen == 1
    finally:
        planes.destroy()


@pytest.mark.fast
def test_an_abort_for_a_plan_already_formed_leaves_its_generation_alone(free_port, monkeypatch):
    # The main thread may form a plan's generation (aborting the old one itself) before the channel thread,
    # which received the plan, gets to its own abort: that late abort must not cut the generation just formed.
    aborted = []
    aborting = backends.abort
    monkeypatch.setattr(backends, "abort", lambda group: aborted.append(group) or aborting(group))
    store = dist.TCPStore("127.0.0.1", free_port(), is_master=True, wait_for_workers=False)
    planes = Planes(store, attempt=0, uid=0, backend="gloo", timeout=timedelta(seconds=30))
    try:
        planes.form(Plan(0, [0]), lambda: False)
        first = dist.group.WORLD
        planes.form(Plan(1, [0]), lambda: False)
        planes.abort(1)  # the channel thread, late
        assert aborted == [first]
        planes.abort(2)  # a newer plan's
        assert aborted == [first, dist.group.WORLD]
    finally:
        planes.destroy()


@pytest.mark.fast
def test_the_next_generation_forms_while_the_last_ones_abort_still_runs(free_port, monkeypatch):
    # NCCL's abort takes about a second to tear a communicator down (0.95 s on an H200): the next generation
    # must not wait for it. The backend's abort is made to block until released, in place of NCCL's.
    released = threading.Event()
    monkeypatch.setattr(backends, "ABORTING", ("gloo",))  # abort the Gloo data group as NCCL's is aborted
    # (a torch whose groups have no abort() of their own, 2.6, is given one: backends looks for it first)
    monkeypatch.setattr(dist.ProcessGroup, "abort", lambda group: released.wait(60), raising=False)
    store = dist.TCPStore("127.0.0.1", free_port(), is_master=True, wait_for_workers=False)
    planes = Planes(store, attempt=0, uid=0, backend="gloo", timeout=timedelta(seconds=30))
    try:
        planes.form(Plan(0, [0]), lambda: False)
        first = dist.group.WORLD
        planes.abort(1)
        planes.form(Plan(1, [0]), lambda: False)
        assert dist.group.WORLD is not first and not planes.wait_aborts(0)
        summed = torch.ones(2)
        dist.all_reduce(summed)
        assert summed.tolist() == [1.0, 1.0]
        planes.release()
        assert planes.stale  # still aborting: not freed under its abort
        released.set()
        assert planes.wait_aborts(30)
        planes.release()
        assert not planes.stale
    finally:
        released.set()
        planes.destroy()


@pytest.mark.fast
def test_a_new_leaders_store_at_the_lost_ones_address_is_connected_to_afresh(free_port):
    # the lost leader's store ends with its node; a new leader on the same machine may get the very port it
    # freed (the kernel's likely pick), so the plan names the same address: the old connection is dead all
    # the same, and the next generation must form through a new one
    port = free_port()
    lost = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)
    planes = Planes(open_client("127.0.0.1", port, 30), attempt=0, uid=0, backend="gloo",
                    timeout=timedelta(seconds=30))
    try:
        planes.form(Plan(0, [0]), lambda: False)
        del lost  # its server goes with it, and every connection to it
        elected = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)
        planes.abort(1)
        planes.form(Plan(1, [0], store=f"127.0.0.1:{port}"), lambda: False)
        summed = torch.ones(2)
        dist.all_reduce(summed)
        assert summed.tolist() == [1.0, 1.0] and elected.check([keys.arrived(0, 1, 0)])
    finally:
        planes.destroy()


# ------------------------------------------------------------------------------ nothing leaks
CYCLE = re.compile(r"commit uid=(\d+) step=(\d+) gen=(\d+) fds=(\d+) threads=(\d+)$")


class Agent:
    """The test's stand-in for ftrun's agent: three workers on socket pairs, plans sent by hand."""

    def __init__(self, workload: str, steps: int, hold: list[int], env: dict[str, str], tmp_path) -> None:
        self.store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                                   timeout=timedelta(seconds=60))
        self.sockets, self.procs, self.lines = [], [], {}
        for uid in range(3):
            mine, theirs = socket.socketpair()
            worker_env = {**env, "FTRUN_UID": str(uid), "RANK": str(uid), "LOCAL_RANK": str(uid),
                          "WORLD_SIZE": "3", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(self.store.port),
                          "FTRUN_CHANNEL_FD": str(theirs.fileno()), "FTRUN_RUN_DIR": str(tmp_path),
                          "HOLD": ",".join(map(str, hold)), "OMP_NUM_THREADS": "1"}
            self.procs.append(subprocess.Popen([sys.executable, workload, "--steps", str(steps), "--width", "64"],
                                               env=worker_env, pass_fds=[theirs.fileno()], stdout=subprocess.PIPE,
                                               stderr=subprocess.PIPE, text=True))
            theirs.close()
            self.sockets.append(mine)
        self.buffers = [b""] * 3
        self.selector = selectors.DefaultSelector()
        for uid, sock in enumerate(self.sockets):
            self.selector.register(sock, selectors.EVENT_READ, uid)

    def wait_for(self, wanted: set[tuple[int, str, int]], deadline: float) -> None:
        """Read messages until each (uid, kind, gen-or-step) in ``wanted`` has come."""
        while wanted:
            assert time.monotonic() < deadline, f"still waiting for {wanted}: {self.explain()}"
            for key, _ in self.selector.select(timeout=1.0):
                data = key.fileobj.recv(65536)
                assert data, f"worker {key.data} closed its channel: {self.explain()}"
                *lines, self.buffers[key.data] = (self.buffers[key.data] + data).split(b"\n")
                for line in lines:
                    message = json.loads(line)
                    value = message.get("gen", message.get("step", -1)) if message["t"] != "entered" \
                        else message["step"]
                    wanted.discard((key.data, message["t"], value))

    def plan(self, gen: int) -> None:
        data = (json.dumps(Plan(gen, [0, 1, 2], reason="link fault").message()) + "\n").encode()
        for sock in self.sockets:
            sock.sendall(data)

    def finish(self) -> list[tuple[int, str, str]]:
        results = [(p.wait(timeout=120), *p.communicate()) for p in self.procs]
        return results

    def explain(self) -> str:
        """Each worker's Python stacks (the agent's stack-dump signal) and its stderr, for a failure."""
        for proc in self.procs:
            if proc.poll() is None:
                proc.send_signal(STACK_DUMP_SIGNAL)
        self.stop()
        return "\n".join(f"--- worker {p.pid}, exit {p.returncode}\n{p.stderr.read()[-6000:]}" for p in self.procs)

    def stop(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        for sock in self.sockets:
            sock.close()


@pytest.mark.soak  # 20 generations: a repetition, left to the soak run for time
def test_a_survivors_file_descriptors_and_threads_stay_flat_over_20_generations(workload, launcher_env, tmp_path):
    # Each cycle: uid 2 holds back before its step while uids 0 and 1 wait in the gradient all-reduce for
    # it; then a new generation of the same members arrives (a link fault: nobody lost). The stale groups,
    # both planes, are aborted with collectives in flight and must be released: after the first few
    # generations, every worker's open descriptors and OS threads are the same at each new generation.
    cycles = 20
    hold = [2 * c + 1 for c in range(cycles)]
    agent = Agent(workload("cycles.py"), 2 * cycles + 2, hold, launcher_env, tmp_path)
    try:
        deadline = time.monotonic() + 240  # three workers import torch on a busy machine first
        agent.wait_for({(uid, "hello", -1) for uid in range(3)}, deadline)
        for cycle, step in enumerate(hold, start=1):
            agent.wait_for({(0, "entered", step), (1, "entered", step)}, deadline)
            agent.plan(cycle)
            agent.store.set(f"go/{step}", "1")
            agent.wait_for({(uid, "recovered", cycle) for uid in range(3)}, deadline)
        results = agent.finish()
    finally:
        agent.stop()
    for uid, (code, out, err) in enumerate(results):
        assert code == 0, f"uid {uid} exited {code}:\n{err[-3000:]}"
        # per generation, the fewest descriptors and threads at any of its commits: a stale generation may be
        # released by the first commit after its recovery rather than by the recovery, and uid 2's last commit
        # of a generation can run after its peers have already aborted it (their sockets closing)
        counts: dict[int, tuple[int, int]] = {}
        for line in out.splitlines():
            if match := CYCLE.search(line):
                _, _, gen, fds, threads = map(int, match.groups())
                counts[gen] = min(counts.get(gen, (fds, threads)), (fds, threads))
        assert sorted(counts) == list(range(cycles + 1)), out
        settled = max(counts[gen] for gen in (3, 4, 5))
        grown = {gen: c for gen, c in counts.items() if gen > 5 and (c[0] > settled[0] or c[1] > settled[1])}
        assert not grown, f"uid {uid}: (fds, threads) grew past {settled}: {counts}"


@pytest.mark.fast
@pytest.mark.compat
@pytest.mark.skipif(not backends.reconfigures_in_place("native"), reason="this torch has no in-place reconfigure")
def test_a_backend_that_cannot_reconfigure_leaves_the_worker_forming_fresh_groups_in_one_line(free_port, monkeypatch,
                                                                                             capsys):
    # torch 2.14's NCCL backend (not here): the group made for reconfigure says it cannot; the worker says so
    # once and forms each generation's group anew, as every worker of the job does with the same backend
    monkeypatch.setattr(dist, "_supports_reconfigure", lambda group=None: False)
    store = dist.TCPStore("127.0.0.1", free_port(), is_master=True, wait_for_workers=False)
    planes = Planes(open_client("127.0.0.1", store.port, 30), 0, 0, "gloo", timedelta(seconds=30), in_place=True)
    try:
        planes.form(Plan(0, [0]), lambda: False)
        assert not planes.in_place and planes.current.data is dist.group.WORLD
        planes.form(Plan(1, [0]), lambda: False)
        assert dist.get_world_size() == 1 and planes.current.gen == 1
    finally:
        planes.destroy()
    err = capsys.readouterr().err
    assert err == "ftrun: --data-reconfigure native: the gloo backend here cannot reconfigure in place; each " \
                  "generation forms a fresh data group\n"


@pytest.mark.fast
@pytest.mark.compat
@pytest.mark.skipif(not backends.reconfigures_in_place("native"), reason="this torch has no in-place reconfigure")
def test_in_place_the_data_group_is_made_once_and_reconfigured_at_each_generation(free_port):
    store = dist.TCPStore("127.0.0.1", free_port(), is_master=True, wait_for_workers=False)
    planes = Planes(open_client("127.0.0.1", store.port, 30), 0, 7, "gloo", timedelta(seconds=30), in_place=True)
    try:
        planes.start_alone()  # a spare's: a world of one, through the prefix the job's groups share
        group = dist.group.WORLD
        assert (dist.get_rank(), dist.get_world_size()) == (0, 1)
        for gen in (1, 2):
            handle = dist._get_reconfigure_handle()
            planes.abort(gen)
            planes.form(Plan(gen, [7]), lambda: False)
            assert store.get(keys.arrived(0, gen, 7)).decode() == handle  # the barrier key carried it
            tensor = torch.ones(2)
            dist.all_reduce(tensor)
            assert dist.group.WORLD is group and planes.current.data is group and planes.current.gen == gen
            assert tensor.tolist() == [1.0, 1.0] and (dist.get_rank(), dist.get_world_size()) == (0, 1)
            planes.release()
        assert planes.in_place
    finally:
        planes.destroy()


@pytest.mark.fast
@pytest.mark.compat
@pytest.mark.skipif(not backends.reconfigures_in_place("native"), reason="this torch has no in-place reconfigure")
def test_in_place_the_plan_aborts_the_data_group_keeps_it_and_reconfigures_it_once_the_abort_ended(free_port,
                                                                                                  monkeypatch):
    # torch 2.15's NCCL backend revokes a group made for reconfigure where it would tear another down, so the
    # plan aborts it as in the fresh mode (a kernel waiting for a dead peer ends then, not at the reconfigure),
    # the group stays, and its reconfigure, which replaces the revoked communicator, begins only once the abort
    # has ended (neither locks against the other). Gloo's group is aborted here as NCCL's would be; its abort
    # ends only once the reconfigure's side waits for it, so a reconfigure that did not wait would overlap it.
    aborted, waiting, ended, overlapped = [], threading.Event(), threading.Event(), []

    def abort(group: dist.ProcessGroup) -> None:
        aborted.append(group)
        waiting.wait(60)
        ended.set()

    wait_aborts, reconfigure = Planes.wait_aborts, dist._reconfigure
    monkeypatch.setattr(backends, "ABORTING", ("gloo",))
    monkeypatch.setattr(dist.ProcessGroup, "abort", abort)
    monkeypatch.setattr(Planes, "wait_aborts", lambda self, timeout: waiting.set() or wait_aborts(self, timeout))
    store = dist.TCPStore("127.0.0.1", free_port(), is_master=True, wait_for_workers=False)
    planes = Planes(open_client("127.0.0.1", store.port, 30), 0, 0, "gloo", timedelta(seconds=30), in_place=True)
    try:
        planes.form(Plan(0, [0]), lambda: False)
        group = dist.group.WORLD
        monkeypatch.setattr(dist, "_reconfigure", lambda *args: overlapped.append(not ended.is_set()) or
                            reconfigure(*args))
        planes.abort(1)  # the channel thread, as the plan arrives
        assert aborted == [group]
        planes.form(Plan(1, [0]), lambda: False)
        tensor = torch.ones(2)
        dist.all_reduce(tensor)
        assert overlapped == [False]
        assert dist.group.WORLD is group and planes.current.data is group and tensor.tolist() == [1.0, 1.0]
    finally:
        waiting.set()
        planes.destroy()


@pytest.mark.fast
@pytest.mark.compat
@pytest.mark.skipif(not backends.reconfigures_in_place("native"), reason="this torch has no in-place reconfigure")
def test_in_place_the_reconfigure_runs_on_the_ranks_own_gpu(free_port, monkeypatch):
    # torch 2.15's NCCL backend binds a group made for reconfigure to the current CUDA device at its first
    # reconfigure: unless ftrun makes the rank's own GPU current for it, every rank of a node would take GPU 0
    # (ftrun.init runs before the script picks its GPU). Four GPUs are faked under torch.cuda's device switch,
    # the lowest layer torch.cuda.device goes through; the data group stays Gloo's.
    current, during = [0], []

    def exchange(index: int) -> int:
        previous, current[0] = current[0], index if index >= 0 else current[0]
        return previous

    monkeypatch.setenv("LOCAL_RANK", "2")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    monkeypatch.setattr(torch.cuda, "_exchange_device", exchange)
    monkeypatch.setattr(torch.cuda, "_maybe_exchange_device", exchange)
    reconfigure = dist._reconfigure
    monkeypatch.setattr(dist, "_reconfigure", lambda *args: during.append(current[0]) or reconfigure(*args))
    store = dist.TCPStore("127.0.0.1", free_port(), is_master=True, wait_for_workers=False)
    planes = Planes(open_client("127.0.0.1", store.port, 30), 0, 0, "gloo", timedelta(seconds=30), in_place=True)
    try:
        planes.form(Plan(0, [0]), lambda: False)
        planes.abort(1)
        planes.form(Plan(1, [0]), lambda: False)
        assert during == [2, 2] and current == [0]  # the script's own choice is left as it was
    finally:
        planes.destroy()
