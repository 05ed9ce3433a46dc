"""Every message ftrun's processes exchange, by kind, with its fields; and generation plans.

- A worker and its agent: JSON objects, one per line, over the socket pair the worker inherits as
  ``FTRUN_CHANNEL_FD`` (``"t"`` is the kind).
- Agents across nodes, and the hostfile launcher: JSON objects posted to an agent's mailbox in the store
  (``"t"`` is the kind).
- Commands (``ftrun inject``, ``ftrun status``...): JSON objects with ``"cmd"`` posted to an agent's mailbox,
  answered through the store (``"reply_to"``).

This module is shared by the worker runtime and the agent, so it imports neither.
"""

from __future__ import annotations

import json
import math
import re
import signal
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field, fields
from typing import Any

STACK_DUMP_SIGNAL = signal.SIGRTMIN + 5
"""Sent by the agent to a hung worker, which dumps every thread's Python stack to stderr (faulthandler).

A real-time signal, so that SIGUSR1/SIGUSR2, which schedulers use for preemption notices, stay the user's.
"""

# worker -> agent
HELLO = "hello"  # the worker adopted the API: {uid, pid, spare}
READY = "ready"  # a joiner (spare or respawned worker) waits to be placed: {uid}
PROGRESS = "progress"  # a step committed: {gen, step, time, step_time}; told as PROGRESS_FIRST/EVERY say
ENTERED = "entered"  # the first collective of a step started: {step}
FINISHED = "finished"  # the worker left the step loop: no more progress is to be expected; {step}
LEFT = "left"  # the worker left the step loop before its end (a break, an exception): in no collective; {step}
RECOVERED = "recovered"  # the worker finished recovery for a generation: {gen, step, held, timings}
SAVED = "saved"  # the worker wrote its state (for a restart, or a next launch): {step}, or {step, error} if it could not
UNRECOVERABLE = "unrecoverable"  # the new generation cannot recover in place (a shard in no memory): {reason}
COLLECTIVE_FAILED = "collective_failed"  # a collective failed with no new plan to explain it: {gen, step, phase,
# error, unreachable}: phase "step" (in training), "form", "agree", "transfer" or "probe"; unreachable, after a
# probe: {uid: [uids it could not connect to]} for every member (empty lists when all connected)
RECOVERY_PHASES = ("abort", "rendezvous", "agree", "transfer")
"""The phases a worker times in its ``recovered`` message (``timings``: seconds by phase)."""
# agent -> worker
PLAN = "plan"  # a new generation: Plan fields
SAVE = "save"  # recovery failed, or ftrun is stopped: write your state to FTRUN_RUN_DIR/rescue (sharded state:
# with ``copies``, also the copies of another rank's shard it holds, for a rank that may be lost)
RAISE = "raise"  # a drill (`ftrun inject exception`): raise InjectedFault(message) at the next step: {message}
SLOW = "slow"  # a drill (`ftrun inject slow`): sleep `seconds` in each step, for `duration` s (None: until cleared)

# a follower or the hostfile launcher -> the leader's mailbox
WORKER_STARTED = "worker_start"  # a follower's worker started: {uid, pid, local_rank, rank, joiner}
WORKER_MESSAGE = "msg"  # a follower's worker said something on its channel: {uid, msg}
COMMITS = "commits"  # a follower's workers' latest commits, held and told together: {commits: [{uid, msg}, ...]}
WORKER_EXITED = "exit"  # a follower's worker ended: {uid, code, failure (a WorkerFailure's fields) unless code 0}
NODE_GONE = "node_gone"  # the hostfile launcher saw a node's agent end: {node, reason, since (wall clock)}
NODE_STUCK = "node_stuck"  # every rank of a follower waits in a collective past its hang timeout: {node, gen, reason}
FOLLOWING = "following"  # after an election, a follower told the new leader of its workers: {node, term, gen}
# the leader -> a follower's mailbox
RELAY = "relay"  # control messages for one of its workers: {uid, data (JSON lines)}
RELAY_ALL = "relay_all"  # broadcast to every node: the same control messages for each of these workers: {uids, data}
SIGNAL = "signal"  # signal one of its workers: {uid, sig}
START_WORKER = "start_worker"  # start the replacement of its worker: {uid, local_rank, rank}
STOP = "stop"  # the leader's attempt failed (or was stopped): stop every worker and end: {reason}
RESTART = "restart"  # the group restarts once every worker ended: as {attempt}, rendezvous in {store}: {reason}
DONE = "done"  # the leader's attempt succeeded: a node with no worker left ends too

# commands, in any agent's mailbox: {"cmd": ..., "reply_to": token, ...}, answered {"ok": bool, ...}
PING = "ping"  # who are you: {} -> {node_rank, pid, attempt, ranks: {rank: pid}}
INJECT = "inject"  # a drill: {kind, rank, ...} -> see ftrun.agent.drills
DRILL_KINDS = ("kill", "hang", "exception", "slow", "xid", "ecc")
"""The drills one ``inject`` command can carry (chaos is a client-side series of them)."""


UID_STRIDE = 100_000
"""Worker uids of node ``n`` are ``n * UID_STRIDE + i``: unique across nodes without a round trip."""


def node_of(uid: int) -> int:
    """The node rank that started worker ``uid``."""
    return uid // UID_STRIDE


def initial_members(sizes: list[int] | tuple[int, ...]) -> list[int]:
    """Generation 0 in rank order: node ``n``'s workers are uids ``n * UID_STRIDE + i``, ``i < sizes[n]``."""
    return [node * UID_STRIDE + i for node, size in enumerate(sizes) for i in range(size)]


@dataclass(frozen=True)
class Plan:
    """One generation: who is in the group, in rank order, and why it changed."""

    gen: int
    members: list[int]  # worker uids in rank order
    reason: str = "start"
    lost: list[int] = field(default_factory=list)
    joiners: list[int] = field(default_factory=list)
    probe: bool = False  # before forming, every member checks it can connect to every other (a link fault)
    store: str = ""  # "host:port" of the process groups' store from this generation on ("": where it was)

    @property
    def world_size(self) -> int:
        """Number of ranks in this generation."""
        return len(self.members)

    def rank_of(self, uid: int) -> int | None:
        """The rank ``uid`` has in this generation, or None when it is not a member."""
        try:
            return self.members.index(uid)
        except ValueError:
            return None

    def message(self) -> dict[str, Any]:
        """The plan as a control message."""
        return {"t": PLAN, **asdict(self)}

    @staticmethod
    def from_message(message: dict[str, Any]) -> Plan:
        """Read a plan back from a control message (one :func:`problem` accepts as a plan)."""
        return Plan(**{f.name: message[f.name] for f in fields(Plan) if f.name in message})


def encode(kind: str, **fields: Any) -> bytes:
    """One control message as a JSON line."""
    return (json.dumps({"t": kind, **fields}) + "\n").encode()


# ------------------------------------------------------------------------------------- validation
# A message is checked where it enters a process (a worker's channel, a mailbox): one that is not of a known
# kind with every field of the right type is dropped and counted there, so the handlers read fields freely.
Check = Callable[[Any], bool]


MAX_INT = 2**63 - 1
"""The largest integer a message may carry: what a process hands on as a C int64 (a step, a uid, a tensor of
them). JSON reads integers of thousands of digits, which overflow a float or a tensor where they are used."""
MAX_SECONDS = 1_000_000.0
"""The longest duration a flag or a message may give, about 11.6 days. Every wait made on one (a select, a
sleep, a deadline twice as far) must fit in what the system's waits take: epoll's timeout is at most 2**31 - 1
ms, about 24.8 days, and a longer one raises OverflowError instead of waiting."""


def is_int(value: Any) -> bool:
    """Whether ``value`` is an int (not a bool) a C int64 holds (:data:`MAX_INT`)."""
    return type(value) is int and -MAX_INT <= value <= MAX_INT


def is_optional_int(value: Any) -> bool:
    """None, or :func:`is_int`."""
    return value is None or is_int(value)


def is_number(value: Any) -> bool:
    """Whether ``value`` is an :func:`is_int` or a finite float."""
    return is_int(value) or type(value) is float and math.isfinite(value)


def is_duration(value: Any, *, zero: bool = False) -> bool:
    """Whether ``value`` is a number of seconds ftrun waits or sleeps: more than 0 (or 0, with ``zero``) and at
    most :data:`MAX_SECONDS` (never nan, an infinity or a bool)."""
    return is_number(value) and (0 <= value if zero else 0 < value) and value <= MAX_SECONDS


def _pause(value: Any) -> bool:
    return is_duration(value, zero=True)


def _optional_duration(value: Any) -> bool:
    return value is None or is_duration(value)


def is_text(value: Any) -> bool:
    """Whether ``value`` is a string."""
    return isinstance(value, str)


def is_flag(value: Any) -> bool:
    """Whether ``value`` is a bool."""
    return type(value) is bool


def is_uids(value: Any) -> bool:
    """Whether ``value`` is a list of distinct :func:`is_int`."""
    return isinstance(value, list) and all(is_int(v) for v in value) and len(set(value)) == len(value)


def _digits(value: Any, most: int) -> bool:
    """Whether ``value`` is a decimal number of at most ``most`` ASCII digits (int() refuses more than 4,300)."""
    return isinstance(value, str) and value.isdigit() and value.isascii() and len(value) <= most


def _unreachable(value: Any) -> bool:
    return value is None or isinstance(value, dict) and all(_digits(k, 18) and is_uids(v) for k, v in value.items())


def _timings(value: Any) -> bool:
    return isinstance(value, dict) and all(name in value for name in RECOVERY_PHASES) \
        and all(isinstance(k, str) and is_number(v) for k, v in value.items())


MAX_HOST_NAME = 253
"""The longest host name DNS allows (RFC 1035); a longer one would only fail later, at ssh or its lookup."""
_HOST_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]*")


def is_host_name(value: Any) -> bool:
    """Whether ``value`` is a host name or an IPv4 address as a hostfile, ``-H`` or an etcd endpoint names one:
    at most :data:`MAX_HOST_NAME` letters, digits, '_', '.' and '-', not starting with '.' or '-'."""
    return isinstance(value, str) and len(value) <= MAX_HOST_NAME and _HOST_NAME.fullmatch(value) is not None


def is_address(value: Any) -> bool:
    """Whether ``value`` is a store's "host:port" (a plan's, an ``--endpoint``)."""
    if not isinstance(value, str):
        return False
    host, _, port = value.rpartition(":")
    return bool(host) and _digits(port, 5) and 0 < int(port) < 65536


def _address(value: Any) -> bool:
    """"" (the store it was) or "host:port" (a store's address in a plan)."""
    return value == "" or is_address(value)


def split_address(address: str) -> tuple[str, int]:
    """A plan's "host:port" store address as (host, port)."""
    host, _, port = address.rpartition(":")
    return host, int(port)


def _signal(value: Any) -> bool:
    return type(value) is int and value in _SIGNALS


_SIGNALS = frozenset(s.value for s in signal.Signals)

PROGRESS_FIRST = 3
"""A worker's first commits, each told: the hang watchdog's warm-up counts them (``HangPolicy.warmup_steps``)."""
PROGRESS_EVERY = 0.25
"""Seconds between two later ``progress`` messages of one generation; the first commit of each generation is
told at once (it ends a recovery). A message per commit woke the agent once per step and worker, CPU the workers
lose where cores are few; the agent's uses (the hang watchdog, whose timeouts are seconds; ``ftrun status``,
refreshed every second) need no more. A worker also tells its last committed step as it leaves its step loop
(``finished``), and the step it held when a recovery began (``recovered``'s ``held``)."""

FAILURE_FIELDS: dict[str, Check] = {"rank": is_optional_int, "local_rank": is_int, "pid": is_int, "exitcode": is_int,
                                    "when": is_number, "message": is_text, "traceback": is_text}
"""The fields of a worker failure, as a follower reports one (``ftrun.agent.failures.WorkerFailure``)."""

FROM_WORKER: dict[str, dict[str, Check]] = {
    HELLO: {"uid": is_int, "pid": is_int, "spare": is_flag},
    READY: {"uid": is_int},
    PROGRESS: {"gen": is_int, "step": is_int, "time": is_number, "step_time": is_number},
    ENTERED: {"step": is_int},
    FINISHED: {"step": is_int},
    LEFT: {"step": is_int},
    RECOVERED: {"gen": is_int, "step": is_int, "held": is_int, "timings": _timings, "plan_received": is_number},
    SAVED: {"step": is_int},
    UNRECOVERABLE: {"gen": is_int, "reason": is_text},
    COLLECTIVE_FAILED: {"gen": is_int, "step": is_int, "phase": is_text, "error": is_text, "unreachable": _unreachable},
}
"""Every message a worker sends its agent, with the fields the agent reads."""

TO_WORKER: dict[str, dict[str, Check]] = {
    PLAN: {"gen": is_int, "members": is_uids, "reason": is_text, "lost": is_uids, "joiners": is_uids, "store": _address},
    SAVE: {"copies": is_flag},
    RAISE: {"message": is_text},
    SLOW: {"seconds": _pause, "duration": _optional_duration},
}
"""Every message an agent sends a worker (directly, or relayed by the worker's own agent)."""


def _problem(message: Any, kinds: Mapping[str, Mapping[str, Check]], tag: str = "t") -> str | None:
    """Why ``message`` is not one of ``kinds`` with its fields (the kind under ``tag``), or None."""
    if not isinstance(message, dict):
        return f"not a JSON object but {type(message).__name__}"
    kind = message.get(tag)
    if not isinstance(kind, str) or kind not in kinds:
        return f"unknown {'kind' if tag == 't' else 'command'} {str(kind)[:40]!r}"
    for name, check in kinds[kind].items():
        if name not in message:
            return f"{kind}: no field {name!r}"
        if not check(message[name]):
            return f"{kind}: field {name!r} has a wrong type or value"
    return None


def worker_message_problem(message: Any) -> str | None:
    """Why ``message`` from a worker is not one its agent can act on, or None when it is."""
    return _problem(message, FROM_WORKER)


def _commits(value: Any) -> bool:
    """A follower's workers' commits: a list of ``{uid, msg}``, each ``msg`` a valid ``progress`` message and each
    uid once."""
    return isinstance(value, list) and 0 < len(value) <= UID_STRIDE and all(
        isinstance(entry, dict) and set(entry) == {"uid", "msg"} and is_int(entry["uid"])
        and isinstance(entry["msg"], dict) and entry["msg"].get("t") == PROGRESS
        and worker_message_problem(entry["msg"]) is None for entry in value) \
        and len({entry["uid"] for entry in value}) == len(value)


def _relayed(data: Any) -> bool:
    """Control messages for a worker, as JSON lines (the leader's relay through a follower)."""
    if not isinstance(data, str) or not data:
        return False
    try:
        return all(_problem(json.loads(line), TO_WORKER) is None for line in data.splitlines())
    except (ValueError, RecursionError):
        return False


def _failure(value: Any) -> bool:
    return isinstance(value, dict) and set(value) == set(FAILURE_FIELDS) \
        and all(check(value[k]) for k, check in FAILURE_FIELDS.items())


MAIL: dict[str, dict[str, Check]] = {
    WORKER_STARTED: {"uid": is_int, "pid": is_int, "local_rank": is_int, "rank": is_optional_int, "joiner": is_flag},
    WORKER_MESSAGE: {"uid": is_int, "msg": lambda msg: worker_message_problem(msg) is None},
    COMMITS: {"commits": _commits},
    WORKER_EXITED: {"uid": is_int, "code": is_int},
    NODE_GONE: {"node": is_int, "reason": is_text, "since": is_number},
    NODE_STUCK: {"node": is_int, "gen": is_int, "reason": is_text},
    FOLLOWING: {"node": is_int, "term": is_int, "gen": is_int},
    RELAY: {"uid": is_int, "data": _relayed},
    RELAY_ALL: {"uids": is_uids, "data": _relayed},
    SIGNAL: {"uid": is_int, "sig": _signal},
    START_WORKER: {"uid": is_int, "local_rank": is_int, "rank": is_optional_int},
    STOP: {"reason": is_text},
    RESTART: {"attempt": is_int, "reason": is_text, "store": is_address},
    DONE: {},
}
"""Every message agents (and the hostfile launcher) post to each other's mailboxes, with its fields."""

COMMANDS: dict[str, dict[str, Check]] = {PING: {}, INJECT: {"kind": is_text, "rank": is_int}}
"""Every command a client posts to an agent's mailbox, with the fields the agent reads before its handler."""


def mail_problem(message: Any) -> str | None:
    """Why ``message`` read from an agent's mailbox is not a valid message or command, or None when it is.

    A command's ``reply_to`` must be a string; a command of another ftrun version (an unknown ``cmd``) is
    accepted, so that the agent can answer that it does not know it.
    """
    if isinstance(message, dict) and "cmd" in message:
        if not isinstance(message["cmd"], str) or not isinstance(message.get("reply_to", ""), str):
            return "a command whose cmd or reply_to is not a string"
        return _problem(message, COMMANDS, "cmd") if message["cmd"] in COMMANDS else None
    problem = _problem(message, MAIL)
    if problem is None and message["t"] == WORKER_EXITED and message["code"] != 0 \
            and not _failure(message.get("failure")):
        return f"{WORKER_EXITED}: no valid 'failure' for exit code {message['code']}"
    return problem
