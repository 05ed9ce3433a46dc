"""Write what a worker process can see of how it was started to OUT_DIR/facts_<restart count>_<local rank>.json.

usage: worker_facts.py OUT_DIR [PLAN]

A torch script (it imports torch first, so ftrun starts it from the fork server): the comparison of a forked
worker with a new process in tests/agent/test_forkserver.py reads these files. Each worker prints
``facts attempt=A rank=R`` once its file is written. PLAN says, per attempt (comma-separated, from attempt
0; attempts past its end are ``ok``), what happens once every worker of the attempt has written its facts
(a Gloo barrier): ``ok`` every worker exits 0; ``exit`` rank 1 exits with code 3; ``signal`` rank 0 dies of
SIGUSR1; ``hold`` (no barrier) every worker waits for a signal.
"""

import torch  # noqa: F401  (first: what makes this a torch script)

import ctypes
import faulthandler
import gc
import json
import os
import random
import resource
import signal
import stat
import sys
import threading

import __main__

PR_GET_PDEATHSIG = 2


def stream(s):
    return {"fileno": s.fileno(), "isatty": s.isatty(), "encoding": s.encoding, "errors": s.errors,
            "line_buffering": s.line_buffering, "write_through": getattr(s, "write_through", None),
            "mode": getattr(s, "mode", None), "name": s.name, "buffer": type(s.buffer).__name__,
            "raw": type(getattr(s.buffer, "raw", s.buffer)).__name__, "newlines": s.newlines,
            "kind": stat.S_IFMT(os.fstat(s.fileno()).st_mode), "is_dunder": s is getattr(sys, f"__{s.name[1:-1]}__")}


def fd_kinds():
    kinds = {}
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue  # the directory listing's own descriptor, closed by now
        kinds[fd] = target.split(":")[0] if target.startswith(("pipe:", "socket:", "anon_inode:")) else target
    return kinds


def pdeathsig():
    value = ctypes.c_int()
    ctypes.CDLL(None).prctl(PR_GET_PDEATHSIG, ctypes.byref(value), 0, 0, 0)
    return value.value


out_dir = sys.argv[1]
attempt, local_rank = os.environ["TORCHELASTIC_RESTART_COUNT"], os.environ["LOCAL_RANK"]
channel = int(os.environ["FTRUN_CHANNEL_FD"])
facts = {
    "environ": dict(os.environ),
    "argv": sys.argv, "orig_argv": sys.orig_argv, "path": sys.path, "executable": sys.executable,
    "flags": repr(sys.flags), "cwd": os.getcwd(),
    "main": {"names": sorted(vars(__main__)), "name": __name__, "file": __file__, "spec": repr(__spec__),
             "loader": type(__loader__).__name__, "package": __package__, "doc": __doc__ is not None,
             "cached": __cached__, "is_sys_main": sys.modules["__main__"] is __main__},
    "stdio": [stream(s) for s in (sys.stdin, sys.stdout, sys.stderr)],
    "own_session": os.getsid(0) == os.getpid() == os.getpgrp(),
    "pdeathsig": pdeathsig(),
    "signals": {s.name: repr(signal.getsignal(s)) for s in signal.valid_signals() if isinstance(s, signal.Signals)},
    "blocked": sorted(int(s) for s in signal.pthread_sigmask(signal.SIG_BLOCK, [])),
    "channel": {"socket": stat.S_ISSOCK(os.fstat(channel).st_mode), "inheritable": os.get_inheritable(channel)},
    "fds": fd_kinds(),
    "threads": [threading.active_count(), len(os.listdir("/proc/self/task"))],
    "torch_seed": torch.initial_seed(), "torch_rand": torch.rand(3).tolist(),
    "random": random.random(),
    "gc": [gc.isenabled(), gc.get_threshold()],
    "umask": os.umask(0o022),
    "limits": {name: resource.getrlimit(getattr(resource, name)) for name in dir(resource) if name.startswith("RLIMIT_")},
    "affinity": sorted(os.sched_getaffinity(0)), "nice": os.nice(0),
    "cmdline": open("/proc/self/cmdline", "rb").read().decode().split("\0"),
    "faulthandler": faulthandler.is_enabled(), "recursion": sys.getrecursionlimit(),
    "switch": sys.getswitchinterval(), "encodings": [sys.getdefaultencoding(), sys.getfilesystemencoding()],
    "pid": os.getpid(),
}
path = os.path.join(out_dir, f"facts_{attempt}_{local_rank}.json")
with open(path + ".tmp", "w") as f:
    json.dump(facts, f)
os.replace(path + ".tmp", path)
print(f"facts attempt={attempt} rank={os.environ['RANK']}", flush=True)
plan = sys.argv[2].split(",") if len(sys.argv) > 2 else []
action = plan[int(attempt)] if int(attempt) < len(plan) else "ok"
if action == "hold":
    while True:
        signal.pause()
import torch.distributed as dist  # noqa: E402  (after the facts: its threads are not the start's)

dist.init_process_group("gloo")
dist.barrier()
if action == "exit" and os.environ["RANK"] == "1":
    sys.exit(3)
if action == "signal" and os.environ["RANK"] == "0":
    os.kill(os.getpid(), signal.SIGUSR1)
dist.destroy_process_group()
