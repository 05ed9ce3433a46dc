"""`ftrun inject`: fault drills against a running job, delivered to the agent that owns the target rank.

The job is the only one of this user running on this machine, or the one named by ``--run-id`` (both found
in the run registry, with the run's secret), or the store at ``--endpoint`` (with ``--secret-file``); the
node running a rank is found by pinging each node's agent through the store; the drill is posted to that
agent's mailbox as ``{"cmd": "inject", ...}``, signed with the run's secret, and carried out there (see
``ftrun.agent.drills``). Chaos is a series of drills on random live ranks, each awaited through its recovery
in the run's event log.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ftrun import event_log, events, protocol, registry
from ftrun.errors import NoSuchJob, UsageError
from ftrun.flag_values import seconds
from ftrun.paths import Unreadable
from ftrun.protocol import DRILL_KINDS
from ftrun.store import keys
from ftrun.store.client import STORE_START_WAIT, check_endpoint, connect_job
from ftrun.store.job import JobStore, MalformedValue

CHAOS_KINDS = ("kill", "hang", "exception", "xid", "ecc")
"""Drills chaos may pick: the ones that lose a worker."""
JOB_KEY_WAIT = 5.0
"""Seconds to wait for a store's ``ftrun/job`` key before calling it not an ftrun job's."""
CHAOS_XID = 13
"""The Xid chaos injects: "graphics engine exception", which the policy answers by restarting the rank."""
MAX_VALUE = 2**32 - 1
"""The largest Xid code or ECC error count a drill takes (NVML reports both as 32-bit counts)."""
ALIVE_CHECK = 1.0
"""Seconds between two checks, while chaos waits, that the job's store still answers (its agent is there)."""


# ------------------------------------------------------------------------------------- the drill
def drill_message(kind: str, value: str | None, rank: int | None, duration: float | None) -> dict[str, Any]:
    """The ``inject`` command for ``ftrun inject KIND [VALUE] --rank R [--for S]``; UsageError if malformed."""
    if kind not in DRILL_KINDS:
        raise UsageError(f"unknown drill {kind!r}: choose from {', '.join(DRILL_KINDS)} or chaos")
    if rank is None:
        raise UsageError(f"inject {kind} needs --rank R, the rank to act on")
    message: dict[str, Any] = {"cmd": protocol.INJECT, "kind": kind, "rank": rank}
    if kind == "xid":
        message["value"] = _count(value, "xid CODE", "an Xid code, e.g. 79")
    elif kind == "ecc":
        message["value"] = 1 if value is None else _count(value, "ecc COUNT", "a count of errors")
    elif kind == "slow":
        message["seconds"] = _number(value, float, "slow SECONDS", "seconds added to each step, 0 clears")
        seconds("slow SECONDS", message["seconds"], zero=True)
        message["duration"] = None if duration is None else seconds("--for", duration)
    elif value is not None:
        raise UsageError(f"inject {kind} takes no value (got {value!r})")
    if duration is not None and kind != "slow":
        raise UsageError("--for only applies to slow")
    return message


def _number(text: str | None, kind: type, usage: str, what: str) -> Any:
    try:
        return kind(text)
    except (TypeError, ValueError):
        raise UsageError(f"{usage}: expected {what}, got {str(text)[:40]!r}") from None


def _count(text: str | None, usage: str, what: str) -> int:
    """A whole number from 1 to MAX_VALUE, in ASCII digits."""
    if text is None or not (text.isascii() and text.isdigit() and len(text) <= 10 and 0 < int(text) <= MAX_VALUE):
        raise UsageError(f"{usage}: expected {what} (from 1 to {MAX_VALUE}), got {str(text)[:40]!r}")
    return int(text)


# ------------------------------------------------------------------------------------- the job
def job_store(run_id: str | None, endpoint: str | None, secret_file: str | None) -> JobStore:
    """The store of the one job to drill: --endpoint (with --secret-file), else the job running here named by
    --run-id, or the only one (NoSuchJob when there is none, UsageError when there are several)."""
    if endpoint:
        if run_id:
            raise UsageError("--endpoint names the job already; drop --run-id")
        check_endpoint(endpoint)
        return connect_job(endpoint, None, secret_file)
    if secret_file:
        raise UsageError("--secret-file goes with --endpoint: a job running here is found with its secret")
    entry = registry.only_running(run_id, "pass --endpoint HOST:PORT and --secret-file FILE for a job elsewhere")
    return connect_job(entry.endpoint, entry.secret, connect_timeout=STORE_START_WAIT)


@dataclass
class Job:
    """A connection to a running job's store, and what ``ftrun/job`` says about it."""

    store: JobStore
    info: dict[str, Any]

    @classmethod
    def connect(cls, store: JobStore) -> Job:
        """The job whose store ``store`` is; NoSuchJob when it is not an ftrun job's, UsageError when its
        records are not signed with the secret ``store`` has."""
        try:  # a job that has just started writes it right after its workers
            info = store.read_job(JOB_KEY_WAIT)
        except MalformedValue:
            raise UsageError("the job does not sign its records with this secret: give its own (--secret-file)"
                             ) from None
        if info is None:
            raise NoSuchJob(f"this store is not an ftrun job's (no {keys.JOB})")
        return cls(store, info)

    @property
    def run_id(self) -> str:
        """The run's id, as `ftrun status` shows it."""
        return str(self.info.get("run_id"))

    def ranks(self) -> dict[int, int]:
        """The job's live ranks and the node running each, from a ping of every node's agent (a node that does
        not answer, lost in the run, runs none; UsageError when none answers)."""
        where, silent = {}, None
        for node in range(int(self.info["nnodes"])):
            try:
                answer = self.store.request(keys.node_box(node), {"cmd": protocol.PING})
            except UsageError as exc:
                silent = exc
                continue
            where.update({int(rank): node for rank in answer.get("ranks", {})})
        if not where and silent is not None:
            raise silent
        return where

    def inject(self, message: dict[str, Any], ranks: dict[int, int] | None = None) -> dict[str, Any]:
        """Deliver an ``inject`` command to the agent running its rank; its answer, or UsageError."""
        ranks = self.ranks() if ranks is None else ranks
        if message["rank"] not in ranks:
            known = ", ".join(str(r) for r in sorted(ranks)) or "none"
            raise UsageError(f"no live rank {message['rank']} in job {self.run_id} (its ranks: {known})")
        answer = self.store.request(keys.node_box(ranks[message["rank"]]), message)
        if not answer.get("ok"):
            raise UsageError(f"run {self.run_id}: {answer.get('error', 'the agent refused the drill')}")
        return answer

    def alive(self) -> bool:
        """Whether the job's store still answers: it lives in the leader agent, so a job whose agent is gone
        (killed, its host down) does not; a call waits at most the connection's timeout."""
        try:
            self.store.read_job(0.0)
        except RuntimeError:
            return False
        return True

    def pause(self, seconds: float) -> bool:
        """Wait ``seconds`` while the job lives; False as soon as it is gone."""
        deadline = time.monotonic() + seconds
        while (left := deadline - time.monotonic()) > 0:
            time.sleep(min(left, ALIVE_CHECK))
            if not self.alive():
                return False
        return True

    @property
    def events_path(self) -> Path:
        """The run's event log (readable on the node that launched it)."""
        return Path(self.info["run_dir"]) / "events.jsonl"


# ------------------------------------------------------------------------------------- chaos
@dataclass
class ChaosSchedule:
    """Random faults: exponential gaps of mean ``mtbf`` seconds, a kind and a rank drawn each time (seeded)."""

    mtbf: float
    kinds: tuple[str, ...]
    seed: int | None = None
    rng: random.Random = field(init=False)

    def __post_init__(self) -> None:
        self.rng = random.Random(self.seed)

    def next(self, ranks: Iterable[int]) -> tuple[float, str, int]:
        """(seconds of uptime before the fault, its kind, its rank among ``ranks``)."""
        return self.rng.expovariate(1.0 / self.mtbf), self.rng.choice(self.kinds), self.rng.choice(sorted(ranks))


def parse_kinds(text: str) -> tuple[str, ...]:
    """``kill,hang,xid`` -> the chaos kinds; UsageError for an unknown or empty one."""
    kinds = tuple(k.strip() for k in text.split(",") if k.strip())
    unknown = [k for k in kinds if k not in CHAOS_KINDS]
    if unknown or not kinds:
        raise UsageError(f"--kinds {text!r}: choose among {', '.join(CHAOS_KINDS)}")
    return kinds


def chaos_message(kind: str, rank: int) -> dict[str, Any]:
    """The ``inject`` command chaos sends for a fault of ``kind``."""
    return drill_message(kind, str(CHAOS_XID) if kind == "xid" else None, rank, None)


class EventFollower:
    """Reads the events appended to a run's events.jsonl since the last call: the lines that are events (a line
    that is none is skipped, as ``ftrun status`` skips it: ``ftrun.event_log.EventReader``)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.offset = 0
        self.reader = event_log.EventReader()

    def new(self) -> list[dict[str, Any]]:
        """Events written since the last call (a line still being written waits for the next call); none while
        there is no log; UsageError when it is not a regular file or cannot be read."""
        found = []
        try:
            for chunk in event_log.read_chunks(self.path, self.offset):
                self.offset += len(chunk)
                found += self.reader.feed(chunk)
        except Unreadable as exc:
            raise UsageError(f"the job's event log {self.path}: {exc}") from None
        return found


GONE = "gone"
"""What :func:`await_settled` returns as the ``event`` when the job went away without an ``end`` in its log."""


class JobGone(Exception):
    """The job's agent went away while chaos was waiting on it."""


def await_settled(follower: EventFollower, uid: int, alive: Callable[[], bool], poll: float = 0.1) -> dict[str, Any]:
    """The event that settles the loss of worker ``uid``: its ``recovery`` (once every worker started since,
    a respawned one, has joined or ended), a ``recovery_failed``, the ``end`` of the run, or ``{"event": GONE}``
    once ``alive()`` says the job is gone (its agent killed: no ``end`` will ever come)."""
    recovery = None
    joining: set[int] = set()
    next_check = time.monotonic() + ALIVE_CHECK
    while True:
        for event in follower.new():
            kind = event["event"]
            if kind == events.WORKER_START.name and event.get("joiner"):
                joining.add(event["uid"])
            elif kind in (events.WORKER_EXIT.name, events.JOINER_LOST.name):
                joining.discard(event["uid"])
            elif kind == events.RECOVERY.name:
                joining -= set(event.get("joiners", []))
                if uid in event.get("lost_uids", []):
                    recovery = event
            elif kind in (events.RECOVERY_FAILED.name, events.END.name):
                return event
        if recovery is not None and not joining:
            return recovery
        if time.monotonic() >= next_check:
            if not alive():
                return {"event": GONE, "reason": "its store no longer answers"}
            next_check = time.monotonic() + ALIVE_CHECK
        time.sleep(poll)  # polling a file another process appends to


def check_chaos(mtbf: float, duration: float) -> None:
    """UsageError unless --mtbf and --duration are numbers of seconds a flag may give (above 0)."""
    seconds("--mtbf", mtbf)
    seconds("--duration", duration)


def _say(line: str) -> None:
    print(line, flush=True)


def run_chaos(job: Job, mtbf: float, duration: float, kinds: tuple[str, ...], seed: int | None,
              say: Callable[[str], None] = _say) -> int:
    """Inject faults until ``duration`` seconds have passed; 0 when every one was recovered in place.

    MTBF is uptime: each gap is drawn from an exponential of mean ``mtbf`` and runs from the end of the
    previous recovery (and the return of a respawned worker), so a fault never lands in the middle of
    the previous one's recovery. The last live rank is never taken: chaos stops there. A job whose agent
    is gone (its store no longer answers) ends chaos with one line, and 1.
    """
    check_chaos(mtbf, duration)
    follower = EventFollower(job.events_path)
    if not job.events_path.exists():
        raise UsageError(f"chaos follows the run's event log, {job.events_path}: run it on the job's first node")
    follower.new()  # only what happens from now on
    schedule = ChaosSchedule(mtbf, kinds, seed)
    start = time.monotonic()
    say(f"chaos: run {job.run_id}, MTBF {mtbf:g} s for {duration:g} s, kinds {','.join(kinds)}, seed {seed}")
    injected = faults = recovered = 0
    try:
        while True:
            ranks = job.ranks()
            if len(ranks) < 2:
                say("chaos: one live rank left, which an in-place recovery needs; stopping")
                break
            gap, kind, rank = schedule.next(ranks)
            if time.monotonic() + gap - start > duration:
                break
            if not job.pause(gap):  # the drawn uptime before the next fault
                raise JobGone("its store no longer answers")
            answer = job.inject(chaos_message(kind, rank), ranks)
            injected += 1
            say(f"chaos +{time.monotonic() - start:.2f} s: {kind} -> {answer['message']}")
            if not answer["fault"]:
                continue
            faults += 1
            settled = await_settled(follower, answer["uid"], job.alive)
            if settled["event"] == GONE:
                raise JobGone(settled["reason"])
            if settled["event"] != events.RECOVERY.name:
                say(f"chaos +{time.monotonic() - start:.2f} s: not recovered in place ({settled['event']}: "
                    f"{settled.get('reason') or settled.get('outcome')}); stopping")
                break
            recovered += 1
            say(f"chaos +{time.monotonic() - start:.2f} s: recovered in {settled['latency']:.2f} s (world "
                f"{settled['world_before']} -> {settled['world_after']}, {settled['steps_lost']} steps lost)")
    except (JobGone, RuntimeError, UsageError) as exc:  # the store went away with the agent hosting it
        if isinstance(exc, UsageError) and job.alive():
            raise  # a drill the agent refused
        say(f"chaos +{time.monotonic() - start:.2f} s: the job is gone ({str(exc).splitlines()[0]}); stopping")
        return 1
    say(f"chaos: {injected} drills injected, {faults} faults, {recovered} recovered in place")
    return 0 if recovered == faults else 1
