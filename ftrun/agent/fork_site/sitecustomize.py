"""ftrun's fork server: a process that has imported torch once and forks workers that start ready to train.

The agent starts this process with the worker's own command line (``python -u script.py args``, or
--run-path's ``-c``) and this file's directory first on PYTHONPATH, so Python loads it as ``sitecustomize``
while it starts up: after its own initialisation (flags, stdio, signals, sys.argv) and before it puts the
script's directory at sys.path[0] and runs the script. Here the process imports what a torch training
script imports (the agent's list), checks that forking it is safe (no thread left that a fork would cut in
half; CUDA untouched), says so to the agent, then forks a child per request. Each child makes itself the
worker (its session, its pipes and control channel, its environment and working directory) and returns
from this file: Python finishes starting up exactly as a worker started with that command line does, and
runs the script as ``__main__``, with that command's sys.argv, sys.path[0], exit codes and tracebacks.
The server reaps its children and writes each one's wait status to the pipe the agent gave with the request.

It also forks, once, the process that serves the job's store (a TCPStore on the socket the agent listens on):
torch is imported here already, so the agent never imports it. That process is not the server's: it outlives
the server and ends when the agent does (its lifeline pipe closes).

Only the standard library is used here: the worker imports ftrun itself, from its own sys.path, if it does.
A server whose imports or checks fail says why and exits; the agent then starts workers the usual way.
"""

from __future__ import annotations

import ctypes
import gc
import json
import os
import selectors
import signal
import socket
import struct
import sys
import threading
import time
import traceback
from typing import Any

VARIABLE = "FTRUN_FORK_SERVER"
"""The environment variable that carries the server's setup (JSON), removed as soon as it is read."""
MAX_REQUEST = 1 << 22
"""Largest fork request read (its environment, as JSON)."""
FDS_PER_REQUEST = 4
"""A worker request's descriptors: its stdout and stderr pipes, its control channel, the agent's status pipe."""
FDS_PER_STORE_REQUEST = 2
"""A store request's descriptors: the listening socket, and the read end of the agent's lifeline pipe."""
STATUS = struct.Struct("i")
"""A child's wait status, as written to its status pipe."""
_PR_SET_PDEATHSIG = 1
_HOOK_DIR = os.path.dirname(__file__)


class Server:
    """The fork server's side: preload, check, then serve fork requests and report the children's exits."""

    def __init__(self, setup: dict[str, Any]) -> None:
        self.pid = os.getpid()
        self.control = socket.socket(fileno=setup["control"])
        self.output: list[int] = setup["output"]  # read ends of this process's own stdout and stderr pipes
        self.log: int = setup["log"]  # where this process's own output goes once the imports are done
        self.preload: list[str] = setup["preload"]
        self.replay = (b"", b"")  # what the imports printed: each worker prints it too, as it would have
        self.selector: selectors.BaseSelector | None = None
        self.children: dict[int, tuple[int, int | None]] = {}  # pidfd -> (pid, status pipe; None: the store's)

    def run(self) -> Child:
        """Preload and serve; returns only in a forked child, as that worker (the server itself never returns)."""
        try:
            started = time.monotonic()
            # Nearly everything the imports make lives as long as the process: the collections their
            # allocations would set off walk ever more objects and find next to no garbage (0.6 s of CPU of the
            # 4.5 s torch and DDP's modules take here); one collection follows.
            collecting = gc.isenabled()
            gc.disable()
            try:
                hazard = self._import()
            finally:
                if collecting:
                    gc.enable()
            if hazard is None:
                # Frozen, what the imports made is out of the workers' garbage collections: they never walk
                # it, so they neither copy its pages (copy-on-write) nor spend seconds on it at exit, as
                # Python's documentation advises for a process that forks without exec.
                gc.collect()
                gc.freeze()
            self._report({"ready": hazard is None, "reason": hazard, "seconds": round(time.monotonic() - started, 3),
                          "modules": len(sys.modules), "torch": _torch_facts()})
            if hazard is not None:
                os._exit(0)
            return self._serve()
        except BaseException:  # noqa: BLE001 - anything that escaped would let Python go on to run the script here
            traceback.print_exc()
            sys.stderr.flush()
            os._exit(1)

    def _import(self) -> str | None:
        """Import the preload list as the script would (its directory first on sys.path); why not to fork, or None."""
        path0 = _script_dir(sys.argv)
        if path0 is not None:
            sys.path.insert(0, path0)
        try:
            for name in self.preload:
                __import__(name)
        except Exception as error:  # noqa: BLE001 - a script that cannot import them is started the usual way
            return f"importing {name} failed: {type(error).__name__}: {error}"
        finally:
            if path0 is not None:
                sys.path.remove(path0)
            self._capture_output()
        return fork_hazard()

    def _capture_output(self) -> None:
        """Keep what the imports printed (to replay in each worker), then send this process's output to its log."""
        sys.stdout.flush()
        sys.stderr.flush()
        captured = []
        for fd in self.output:
            os.set_blocking(fd, False)
            chunks = []
            while True:
                try:
                    chunk = os.read(fd, 65536)
                except BlockingIOError:
                    break
                if not chunk:
                    break
                chunks.append(chunk)
            os.close(fd)
            captured.append(b"".join(chunks))
        self.replay = (captured[0], captured[1])
        os.dup2(self.log, 1)
        os.dup2(self.log, 2)
        os.close(self.log)

    def _report(self, message: dict[str, Any], fds: tuple[int, ...] = ()) -> None:
        if fds:
            socket.send_fds(self.control, [json.dumps(message).encode()], list(fds))
        else:
            self.control.send(json.dumps(message).encode())

    def _serve(self) -> Child:
        self.selector = selectors.DefaultSelector()
        self.selector.register(self.control, selectors.EVENT_READ)
        while True:
            for key, _ in self.selector.select():
                if key.fileobj is self.control:
                    worker = self._fork()
                    if worker is not None:
                        return worker
                else:
                    self._reap(key.fd)

    def _fork(self) -> Child | None:
        """Serve one request: fork its worker (returned in the child), or the store's process, and answer with
        the child's pid."""
        try:
            data, fds, flags, _ = socket.recv_fds(self.control, MAX_REQUEST, FDS_PER_REQUEST)
        except ConnectionError:
            data, fds, flags = b"", [], 0
        if not data:  # the agent is gone or closed the socket: so is every reason to be here
            os._exit(0)
        request = json.loads(data)
        store = "store" in request
        if len(fds) != (FDS_PER_STORE_REQUEST if store else FDS_PER_REQUEST) or \
                flags & (socket.MSG_TRUNC | socket.MSG_CTRUNC):
            for fd in fds:
                os.close(fd)
            self._report({"error": f"malformed request ({len(data)} bytes, {len(fds)} descriptors)"})
            return None
        sys.stdout.flush()
        sys.stderr.flush()
        try:
            pid = os.fork()
        except OSError as error:
            for fd in fds:
                os.close(fd)
            self._report({"error": f"fork: {error}"})
            return None
        if pid == 0:
            if store:
                _serve_store(self, request["store"], *fds)
            return Child(self, request, *fds)
        for fd in fds[:-1]:
            os.close(fd)
        if store:
            os.close(fds[-1])
        pidfd = os.pidfd_open(pid)
        self.children[pidfd] = (pid, None if store else fds[-1])
        self.selector.register(pidfd, selectors.EVENT_READ)
        # The agent gets a pidfd of its own, opened before this process can reap the child: a bare pid could
        # be gone, or another process's, by the time the agent opened one.
        self._report({"pid": pid}, (pidfd,))
        return None

    def _reap(self, pidfd: int) -> None:
        """A child ended: collect its wait status and write it to the agent's status pipe for that worker."""
        pid, status_pipe = self.children.pop(pidfd)
        self.selector.unregister(pidfd)
        os.close(pidfd)
        _, status = os.waitpid(pid, 0)
        if status_pipe is None:  # the store's process: the agent learns of its end from its own connections
            return
        try:
            os.write(status_pipe, STATUS.pack(status))
        except OSError:  # the agent stopped listening for this worker: nobody to tell
            pass
        os.close(status_pipe)

    def close_in_child(self) -> None:
        """In a forked child: release everything of the server's, so the worker holds only its own descriptors."""
        self.selector.close()
        self.control.close()
        for pidfd, (_, status_pipe) in self.children.items():
            os.close(pidfd)
            if status_pipe is not None:
                os.close(status_pipe)
        self.children.clear()


class Child:
    """A forked child about to become the worker a request asked for."""

    def __init__(self, server: Server, request: dict[str, Any], stdout: int, stderr: int, channel: int,
                 status: int) -> None:
        self.server, self.request = server, request
        self.stdout, self.stderr, self.channel, self.status = stdout, stderr, channel, status

    def become(self) -> None:
        """Set this process up as a worker started with its command line would be, then let Python go on."""
        # Killed with the server as a spawned worker is with the agent; the server dies with the agent.
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        if os.getppid() != self.server.pid:  # the server died before the line above: so would this process
            os.kill(os.getpid(), signal.SIGKILL)
        os.setsid()
        self.server.close_in_child()
        os.close(self.status)
        os.dup2(self.stdout, 1)
        os.dup2(self.stderr, 2)
        os.close(self.stdout)
        os.close(self.stderr)
        os.set_inheritable(self.channel, True)
        env = dict(self.request["env"])
        env[self.request["channel_variable"]] = str(self.channel)
        os.environ.clear()  # unsetenv, then putenv: the C environment is the worker's too
        os.environ.update(env)
        os.chdir(self.request["cwd"])
        for fd, text in zip((1, 2), self.server.replay):
            if text:
                os.write(fd, text)
        _reseed()
        _skip_the_servers_exit_handlers()


def _skip_the_servers_exit_handlers() -> None:
    """End this worker, at its exit(), without the C exit handlers the server's imports registered.

    Those are torch's C++ static destructors and the CUDA libraries' (unregistering every operator, freeing
    what the imports allocated): in a forked worker they write all over the memory it shares with the
    server, so the kernel copies it page by page, about 0.45 s of CPU and 80 MB of page copies per worker
    (README, "How workers start"), for nothing a script can see. Everything before exit() runs as in a new
    process: Python's end (threads joined, atexit functions, finalizers, its files flushed) and the exit
    status it chose. exit() then runs the handlers registered after this one (by the script's own libraries)
    as usual, then these two: ``fflush(NULL)`` writes out C's buffered streams, and ``_exit(status)`` ends the
    process where the inherited handlers and C's own flush would have come. Where the C library has no
    ``on_exit`` (not glibc) the worker ends as any process does.
    """
    libc = ctypes.CDLL(None)
    if not hasattr(libc, "on_exit"):
        return
    libc.on_exit(ctypes.cast(libc._exit, ctypes.c_void_p), None)  # called with (status, NULL): _exit(status)
    libc.__cxa_atexit(ctypes.cast(libc.fflush, ctypes.c_void_p), None, None)  # called first, as fflush(NULL)


def _serve_store(server: Server, store: dict[str, Any], listen: int, lifeline: int) -> None:
    """In a forked child: serve the job's TCPStore on ``listen`` until ``lifeline`` (a pipe the agent holds the
    write end of) reaches its end: the agent finished, or died. Never returns."""
    try:
        os.setsid()  # signals for the job's process group (a terminal's Ctrl-C) are the agent's business
        server.close_in_child()
        from datetime import timedelta

        from torch.distributed import TCPStore

        options = {"is_master": True, "master_listen_fd": listen, "wait_for_workers": False,
                   "timeout": timedelta(seconds=300)}
        try:  # as ftrun.store.host.StoreHost.start serves it (ftrun is not imported here)
            served = TCPStore(store["host"], store["port"], use_libuv=True, **options)
        except NotImplementedError:  # a libuv server that takes no listening socket (before pytorch#150215)
            served = TCPStore(store["host"], store["port"], use_libuv=False, **options)
        os.read(lifeline, 1)  # blocks until the agent's end closes
        del served
    except BaseException:  # noqa: BLE001 - this process must never go on to run the script
        traceback.print_exc()
        sys.stderr.flush()
    finally:
        os._exit(0)


def _torch_facts() -> dict[str, Any] | None:
    """What the agent reports of the imported torch at start-up (ftrun.nccl): its version, CUDA, NCCL."""
    torch = sys.modules.get("torch")
    if torch is None:
        return None
    try:
        nccl = list(torch.cuda.nccl.version())[:3]  # reads the library, no CUDA call
    except (AttributeError, RuntimeError):  # a build without NCCL
        nccl = None
    return {"version": torch.__version__, "cuda": getattr(torch.version, "cuda", None), "nccl": nccl}


def _reseed() -> None:
    """Draw new the per-process secrets a new process draws from the OS when they are imported (``random``
    redraws its own at a fork): else every worker would share the server's."""
    numpy_random = sys.modules.get("numpy.random")
    if numpy_random is not None:
        numpy_random.seed()
    generator = getattr(sys.modules.get("torch"), "default_generator", None)
    if generator is not None:  # torch's CPU generator (a new process seeds it at random; CUDA's are fixed)
        generator.seed()
    process = sys.modules.get("multiprocessing.process")
    if process is not None:
        process.current_process().authkey = os.urandom(32)


def _script_dir(argv: list[str]) -> str | None:
    """The sys.path[0] Python will give this command line's script (as Python computes it), or None."""
    if getattr(sys.flags, "safe_path", False):
        return None
    if argv[0] == "-c":
        return ""
    return os.path.dirname(os.path.realpath(argv[0]))


def fork_hazard() -> str | None:
    """Why forking this process now would give a worker that differs from a fresh one, or None.

    Threads: a fork copies only the calling thread, so a lock another thread holds stays held in the child.
    Libraries that stop their threads before a fork (OpenBLAS, through pthread_atfork) are safe: a trial
    fork shows it, the threads having gone. CUDA: torch refuses CUDA in a child forked after CUDA was
    initialised (a "bad fork"), which the trial child reports; loading the CUDA libraries without
    initialising them, as ``import torch`` does, is harmless.
    """
    pid = os.fork()
    if pid == 0:
        code = 4
        try:
            torch_c = getattr(sys.modules.get("torch"), "_C", None)
            code = 3 if getattr(torch_c, "_cuda_isInBadFork", lambda: False)() else 0
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    if os.waitstatus_to_exitcode(status) == 3:
        return "CUDA was initialised while importing: a forked worker could not use it"
    if os.waitstatus_to_exitcode(status) != 0:
        return f"a trial fork failed (wait status {status})"
    tasks = sorted(os.listdir("/proc/self/task"))
    if len(tasks) > 1 or threading.active_count() > 1:
        names = []
        for task in tasks:
            try:
                with open(f"/proc/self/task/{task}/comm") as comm:
                    names.append(comm.read().strip())
            except OSError:
                names.append(task)
        return (f"{len(tasks)} threads ({', '.join(names)}) still run after the imports and a fork: a forked "
                "worker could inherit a lock one of them holds")
    return None


def _start() -> None:
    """Be the fork server if the agent started this process as one; in each forked child, become its worker."""
    sys.path[:] = [entry for entry in sys.path if entry != _HOOK_DIR]
    sys.path_importer_cache.pop(_HOOK_DIR, None)
    setup = os.environ.pop(VARIABLE, None)
    if setup is None:  # this directory on someone's PYTHONPATH: only pass through
        return
    setup = json.loads(setup)
    if setup["pythonpath"] is None:
        del os.environ["PYTHONPATH"]
    else:
        os.environ["PYTHONPATH"] = setup["pythonpath"]
    child = Server(setup).run()
    try:
        child.become()
    except BaseException:  # noqa: BLE001 - a half-made worker must not go on to run the script
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)


_start()
# The worker's own sitecustomize, if there is one, runs here, where Python would have run it: this module
# leaves sys.modules, and a ModuleNotFoundError for the name tells Python's `site` there is none.
del sys.modules[__name__]
import sitecustomize  # noqa: E402,F401
