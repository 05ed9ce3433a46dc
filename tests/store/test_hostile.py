"""Someone who reaches a running job's store but not its secret changes nothing: forged plans, forged and
malformed messages, and random values in every key the job reads, while a real two-node job trains.

Each job: 2 nodes x 2 workers in scheduler mode, both on this machine (as tests/launcher/test_multinode.py
starts them), running held_train.py, paced while the test writes to its store, then released. The job must
end as a fault-free run does: every worker of the first attempt commits every step with the fault-free
run's loss (same world size, same sums: bit for bit), no generation is ever planned, no node fenced or lost;
and each agent counts what it refused in its status record.
"""

from __future__ import annotations

import json
import queue
import random
import subprocess
import threading
import time
from pathlib import Path

import pytest

from conftest import FTRUN
from ftrun import protocol
from ftrun.errors import UsageError
from ftrun.protocol import Plan
from ftrun.store import keys
from ftrun.store.auth import Seal, new_secret
from ftrun.store.client import open_client
from ftrun.store.job import JobStore, MalformedValue
from runs import COMMIT, HELD_STEPS, HELD_TRAINING

DEADLINE = 120.0
"""Seconds any awaited thing may take on a busy machine."""
UIDS = [0, 1, protocol.UID_STRIDE, protocol.UID_STRIDE + 1]
FORGED_PLAN = Plan(1, [protocol.UID_STRIDE], "node 1 trains alone")
"""The plan of the issue's split brain: node 1's first worker, world 1."""
FAILURE = {"rank": 2, "local_rank": 0, "pid": 1, "exitcode": -9, "when": 0.0, "message": "", "traceback": ""}


class TwoNodeJob:
    """A held two-node job: its processes, their output, its store."""

    def __init__(self, env: dict[str, str], tmp_path: Path, port: int, script: str) -> None:
        self.port = port
        self.secret = Path(env["FTRUN_SECRET_FILE"]).read_text().strip()
        self.hold = tmp_path / "hold"
        self.hold.touch()
        self.logs = [tmp_path / "node0", tmp_path / "node1"]
        self.output: list[list[str]] = [[], []]
        self.commits: queue.Queue[tuple[int, int]] = queue.Queue()  # (uid, step) as node 0's workers print them
        self.procs: list[subprocess.Popen] = []
        for node in (1, 0):  # the follower first: it waits for the leader's store
            proc = subprocess.Popen([*FTRUN, "--nnodes", "2", "--node-rank", str(node), "--rdzv-endpoint",
                                     f"localhost:{port}", "--nproc-per-node", "2", "--log-dir", str(self.logs[node]),
                                     script, *HELD_TRAINING], env={**env, "HOLD": str(self.hold)},
                                    stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            self.procs.insert(0, proc)
            threading.Thread(target=self._read, args=(node, proc), daemon=True).start()

    def _read(self, node: int, proc: subprocess.Popen) -> None:
        for line in proc.stdout:
            self.output[node].append(line)
            match = COMMIT.search(line.rstrip())
            if match:
                self.commits.put((int(match[1]), int(match[4])))

    def reach(self, step: int) -> None:
        """Wait until worker 0 committed ``step``."""
        deadline = time.monotonic() + DEADLINE
        while True:
            uid, done = self.commits.get(timeout=max(0.1, deadline - time.monotonic()))
            if uid == 0 and done >= step:
                return

    def store(self, secret: str | None = None) -> JobStore:
        """A client of the job's store, sealing with ``secret`` (default: the job's own)."""
        return JobStore(open_client("127.0.0.1", self.port, 30), Seal(secret or self.secret))

    def await_dropped(self, store: JobStore, node: int, at_least: int) -> None:
        """Wait until node ``node``'s agent says, in its status record, that it refused ``at_least`` mailbox
        values (what is in the record's key may be someone else's for a moment: it is skipped)."""
        deadline = time.monotonic() + DEADLINE
        dropped = None
        while time.monotonic() < deadline:
            try:
                record = store.read_node_status(node)
            except MalformedValue:
                record = None
            dropped = (record or {}).get("dropped")
            if dropped is not None and dropped["mail"] >= at_least:
                return
            self.commits.get(timeout=DEADLINE)  # a step later: the agents publish every second
        raise AssertionError(f"node {node} refused fewer than {at_least} values: {dropped}")

    def finish(self) -> list[int]:
        """Release the hold; both nodes' exit codes."""
        self.hold.unlink()
        return [proc.wait(timeout=DEADLINE) for proc in self.procs]

    def events(self, node: int) -> list[dict]:
        (log,) = self.logs[node].glob("**/events.jsonl")
        return [json.loads(line) for line in log.read_text().splitlines() if line.strip()]

    def stop(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


@pytest.fixture
def two_nodes(launcher_env, tmp_path, secret_file, free_port, workload):
    """Start the held two-node job once training is under way; it is killed at the end of the test if need be."""
    jobs: list[TwoNodeJob] = []

    def start() -> TwoNodeJob:
        env = {**launcher_env, "FTRUN_SECRET_FILE": secret_file}
        job = TwoNodeJob(env, tmp_path, free_port(), workload("held_train.py"))
        jobs.append(job)
        job.reach(3)
        return job

    yield start
    for job in jobs:
        job.stop()


def check_untouched(job: TwoNodeJob, codes: list[int], baseline: dict[int, float]) -> None:
    """The job ran as a fault-free run: same processes throughout, every step, the fault-free losses."""
    why = f"exit codes {codes}\n" + "".join(f"node {node}: {line}" for node in (0, 1) for line in job.output[node]
                                            if not COMMIT.search(line.rstrip()))
    assert codes == [0, 0], why
    commits: dict[int, list[tuple[int, int, float]]] = {}
    for line in job.output[0] + job.output[1]:
        match = COMMIT.search(line.rstrip())
        if match:
            commits.setdefault(int(match[1]), []).append((int(match[4]), int(match[3]), float(match[5])))
    assert sorted(commits) == UIDS, why
    for uid, lines in commits.items():
        assert [step for step, _, _ in lines] == list(range(HELD_STEPS)), f"uid {uid}\n{why}"
        assert all(world == 4 and loss == baseline[step] for step, world, loss in lines), f"uid {uid}\n{why}"
    leader, follower = job.events(0), job.events(1)
    for event in leader + follower:
        assert event["event"] not in ("generation", "fault", "recovery", "node_lost", "fenced", "inject"), \
            f"{event}\n{why}"
    assert sorted(e["uid"] for e in leader if e["event"] == "worker_start") == UIDS  # started once, never again


def test_forged_and_malformed_control_changes_nothing_on_two_nodes(two_nodes, held_baseline):
    job = two_nodes()
    attacker, trusted = job.store(new_secret()), job.store()
    relay = {"t": protocol.RELAY, "uid": protocol.UID_STRIDE, "data": json.dumps(FORGED_PLAN.message()) + "\n"}
    # the split brain of the issue: a plan for node 1 alone, as the leader would relay it, and as a command
    for index in range(1, 4):
        attacker.send(keys.node_box(1), keys.LEADER_BOX, index, relay)
    attacker.post(keys.node_box(1), relay)
    attacker.post(keys.node_box(1), {"t": protocol.STOP, "reason": "forged"})
    # node 1 lost, its workers dead, a drill: all forged, to the leader
    attacker.post(keys.LEADER_BOX, {"t": protocol.NODE_GONE, "node": 1, "reason": "forged", "since": time.time()})
    for index in range(1, 300):  # ahead of node 1's own messages: each is refused, then overwritten by node 1
        attacker.kv.compare_set(keys.sent_item(keys.LEADER_BOX, keys.node_box(1), index), "",
                                attacker.seal.seal(keys.sent_item(keys.LEADER_BOX, keys.node_box(1), index),
                                                   json.dumps({"t": protocol.WORKER_EXITED, "uid": UIDS[2],
                                                               "code": -9, "failure": FAILURE}).encode()))
    with pytest.raises(UsageError, match="did not answer"):
        attacker.request(keys.LEADER_BOX, {"cmd": protocol.INJECT, "kind": "kill", "rank": 0}, timeout=3)
    attacker.evict(1)
    attacker.kv.set(keys.lease(1), b"0" * 64 + b'{"renewals": 1000000}')
    # sealed with the run's secret but malformed, as a buggy or other version's agent could send them
    malformed = [{"t": "x"}, {"t": protocol.STOP}, {"t": protocol.RELAY, "uid": UIDS[2], "data": "not json"},
                 {"t": protocol.WORKER_EXITED, "uid": UIDS[2], "code": "x"}, {"t": protocol.WORKER_STARTED},
                 {"t": protocol.SIGNAL, "uid": UIDS[2], "sig": -5}, {"cmd": ["ping"]}, {"cmd": protocol.INJECT},
                 {"t": protocol.NODE_GONE, "node": "1", "reason": "", "since": 0}]
    for box in (keys.LEADER_BOX, keys.node_box(1)):
        for message in malformed:
            trusted.post(box, message)
        index = trusted.kv.add(keys.mail_count(box), 1)
        trusted.kv.set(keys.mail_item(box, index), trusted.seal.seal(keys.mail_item(box, index), b"[1, 2]"))
    refused = len(malformed) + 1 + 2 + 1  # per box: the malformed ones, the list, 2 forged commands, a forged lane
    job.await_dropped(trusted, 0, refused)
    job.await_dropped(trusted, 1, refused)
    check_untouched(job, job.finish(), held_baseline)


FUZZ_SEED = 13
FUZZ_WRITES = 3000
FUZZ_SECONDS = 30.0
"""The fuzz is bounded in writes and in time; with its seed, what it writes where is the same every run."""


def fuzzed_keys() -> tuple[list[str], list[str]]:
    """(keys any writer overwrites: records, leases, marks, plans, counters, barriers, answers; mailbox keys,
    written only where nothing is yet): every key of ftrun.store.keys the job's agents or workers read."""
    boxes = [keys.node_box(0), keys.node_box(1)]
    records = [keys.JOB, keys.STATUS_JOB, keys.status_node(0), keys.status_node(1), keys.lease(1), keys.evicted(0),
               keys.evicted(1), keys.current_gen(0), *(keys.plan(0, gen) for gen in range(3)),
               *(keys.mail_count(box) for box in boxes), keys.reply("0" * 32),
               *(keys.arrived(0, gen, uid) for gen in range(3) for uid in UIDS)]
    mail = [keys.mail_item(box, index) for box in boxes for index in range(1, 40)]
    mail += [keys.sent_item(keys.LEADER_BOX, keys.node_box(1), index) for index in range(1, 400)]
    mail += [keys.sent_item(keys.node_box(1), keys.LEADER_BOX, index) for index in range(1, 40)]
    return records, mail


def junk(rng: random.Random, key: str, genuine: bytes) -> bytes:
    """A value for ``key`` its reader must refuse: random bytes, JSON of any shape, a forged seal, a genuine
    sealed value of another key (``genuine``), large or deeply nested data."""
    stranger = Seal(new_secret())
    shapes = [[1, 2], "text", 42, None, {"t": "x"}, {"t": protocol.STOP, "reason": "forged"},
              {"t": protocol.RELAY, "uid": UIDS[2], "data": json.dumps(FORGED_PLAN.message())},
              {"cmd": protocol.INJECT, "kind": "kill", "rank": 0}, {"renewals": 10**9}, {"evicted": True}]
    kind = rng.randrange(7)
    if kind == 0:
        return rng.randbytes(rng.randrange(300))
    if kind == 1:
        return json.dumps(rng.choice(shapes)).encode()
    if kind == 2:
        return stranger.seal(key, json.dumps(rng.choice(shapes)).encode())
    if kind == 3:
        return genuine
    if kind == 4:
        return b"0" * 64 + json.dumps(rng.choice(shapes)).encode()  # the right length, a made-up seal
    if kind == 5:
        return b"{" * rng.randrange(1, 50_000)
    return rng.randbytes(64).hex().encode() + rng.randbytes(rng.randrange(20_000))


def test_random_values_in_every_key_the_job_reads_change_nothing_on_two_nodes(two_nodes, held_baseline):
    job = two_nodes()
    store = job.store(new_secret())
    records, mail = fuzzed_keys()
    genuine = store.kv.get(keys.STATUS_JOB)  # sealed by the leader, for another key
    rng = random.Random(FUZZ_SEED)
    deadline = time.monotonic() + FUZZ_SECONDS
    for _ in range(FUZZ_WRITES):
        if time.monotonic() > deadline:
            break
        key = rng.choice(records + mail)
        value = junk(rng, key, genuine)
        if key in records:
            store.kv.set(key, value)
        else:
            store.kv.compare_set(key, "", value)  # only where nothing is: a message written later replaces it
    for box in (keys.node_box(0), keys.node_box(1)):  # as any writer can: each reader looks now, not at its
        store.ring(box)                               # idle wait's end (20 s)
    trusted = job.store()
    job.await_dropped(trusted, 0, 1)
    job.await_dropped(trusted, 1, 1)
    check_untouched(job, job.finish(), held_baseline)
