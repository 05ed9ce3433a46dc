"""Runs of ftrun over the training workloads, as the recovery tests read them: commits, events, checks.

Shared by the tests of in-place recovery, GPU health and drills (the fixtures that start such runs are in
conftest.py). A run's stdout carries one ``commit`` line per step per worker; its event log says the rest.
"""

from __future__ import annotations

import itertools
import json
import re
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest

from ftrun.launcher import handoff
from ftrun.worker import backends

STEPS = 12
TRAINING = ["--steps", str(STEPS), "--width", "256"]
NPROC = 4
PHASES = {"detect", "plan", "abort", "rendezvous", "agree", "transfer", "first_step"}
# Loss parity tolerance. Before a fault the computation is the baseline's, bit for bit (same world size,
# same Gloo reduction order), and is compared exactly. After it, 3 ranks (or a joiner's share) sum the
# float32 gradients in a different order than 4 do: ~1e-7 relative per step, growing slowly over a few
# steps of SGD with momentum; observed differences are ~2e-8. 1e-5 leaves a wide margin yet is ~1000x
# smaller than the change of the loss from one step to the next (~1e-2), so replaying a step, skipping
# one, or resuming with a stale model or optimizer state (momentum) would fail it.
RTOL = 1e-5
COMMIT = re.compile(r"commit uid=(\d+) rank=(\d+) world=(\d+) step=(\d+) loss=(\S+)$")
TIMEOUT = 150  # per ftrun run: nothing may hang
# Where workers wait on the event log for a joiner (seconds on a busy machine), the hang watchdog must
# not take the wait for a hang; the waits give up after 120 s anyway.
NO_WATCHDOG = ("--hang-timeout", "300")

HELD_STEPS = 200
HELD_TRAINING = ["--steps", str(HELD_STEPS), "--width", "256"]
"""tests/workloads/held_train.py's training: long enough to act on the job while it is held (0.2 s a step)."""

NATIVE = pytest.param("native", marks=pytest.mark.skipif(not backends.reconfigures_in_place("native"),
                                                         reason="this torch has no in-place reconfigure"))
"""--data-reconfigure native as a test parameter, where this torch has the in-place reconfigure."""


@dataclass(frozen=True)
class Commit:
    uid: int
    rank: int
    world: int
    step: int
    loss: float


@dataclass
class Run:
    """One finished ftrun run: its result, its event log, and the steps each worker committed."""

    returncode: int
    stdout: str
    stderr: str
    events: list[dict]
    run_dir: Path

    def of(self, kind: str) -> list[dict]:
        return [e for e in self.events if e["event"] == kind]

    def commits(self, attempt: int | None = None) -> dict[int, list[Commit]]:
        """Commit lines per worker uid, in the order each worker printed them (of one attempt: its logs)."""
        if attempt is None:
            text = self.stdout
        else:
            text = "".join(p.read_text() for p in sorted((self.run_dir / f"attempt_{attempt}").glob("*/stdout.log")))
        per_uid: dict[int, list[Commit]] = {}
        for line in text.splitlines():
            match = COMMIT.search(line)
            if match:
                uid, rank, world, step, loss = match.groups()
                per_uid.setdefault(int(uid), []).append(Commit(int(uid), int(rank), int(world), int(step), float(loss)))
        return per_uid

    def explain(self) -> str:
        return f"exit {self.returncode}\n--- stderr\n{self.stderr[-4000:]}\n--- events\n" + \
            "\n".join(json.dumps(e) for e in self.events)


def read_run(result, log_dir: Path) -> Run:
    """The one run ftrun wrote under ``log_dir``, with the finished process's ``result``."""
    logs = list(log_dir.glob("*/events.jsonl"))
    assert len(logs) == 1, f"expected one run directory in {log_dir}: {logs}\n{result.stderr}"
    events = [json.loads(line) for line in logs[0].read_text().splitlines() if line.strip()]
    return Run(result.returncode, result.stdout, result.stderr, events, logs[0].parent)


def communicate(proc: subprocess.Popen, timeout: float) -> tuple[str, str]:
    """``proc.communicate(timeout)`` for a process whose stdout was read in part, line by line: the rest is
    read through the same file object, since its buffer may hold lines already taken from the pipe (which
    Popen.communicate, reading the pipe itself, would lose)."""
    out: list[str] = []
    err: list[str] = []
    readers = [threading.Thread(target=lambda: out.append(proc.stdout.read()), daemon=True),
               threading.Thread(target=lambda: err.append(proc.stderr.read()), daemon=True)]
    for reader in readers:
        reader.start()
    deadline = time.monotonic() + timeout
    for reader in readers:
        reader.join(max(0.0, deadline - time.monotonic()))
    if any(reader.is_alive() for reader in readers):
        raise subprocess.TimeoutExpired(proc.args, timeout)
    proc.wait(max(0.0, deadline - time.monotonic()))
    return "".join(out), "".join(err)


def until(condition: Callable[[], bool], timeout: float = 10.0, what: str = "the condition") -> None:
    """Wait for another thread or process to make ``condition()`` true: a bounded wait on its state, not a
    timing; fails the test naming ``what`` when ``timeout`` seconds pass first."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"{what} did not hold within {timeout:g} s"
        time.sleep(0.01)


# ------------------------------------------------------------------------------------------ checks

def fault_free(run: Run) -> dict[int, float]:
    """A fault-free run's loss per step, checked: every rank committed every step with the same loss."""
    assert run.returncode == 0, run.explain()
    commits = run.commits()
    assert set(commits) == set(range(NPROC))
    losses = {c.step: c.loss for c in commits[0]}
    for uid, lines in commits.items():
        assert [c.step for c in lines] == list(range(STEPS)), f"uid {uid}"
        assert all(c.world == NPROC and c.rank == uid and c.loss == losses[c.step] for c in lines), lines
    # the parity checks below are only meaningful if the loss moves by much more than RTOL every step
    assert all(abs(losses[s + 1] - losses[s]) > 10 * RTOL * losses[s] for s in range(STEPS - 1)), losses
    return losses


def check_in_place(run: Run, baseline: dict[int, float], *, lost: dict[int, int], fault_step: int,
                   joiners: tuple[int, ...] = (), respawned: tuple[int, ...] = (),
                   world_after: int | None = None) -> dict:
    """Assert an in-place recovery from the loss of ``lost`` ({uid: its exit code}) at ``fault_step``.

    ``joiners`` (spares) fill the new generation at once; ``respawned`` workers start later and join
    afterwards. Returns the fault's recovery event.
    """
    survivors = [uid for uid in range(NPROC) if uid not in lost]
    members = survivors + list(joiners)
    world_after = len(members) if world_after is None else world_after
    why = run.explain()

    # the job succeeded in its first attempt, without any fallback to a group restart
    assert run.returncode == 0, why
    assert not run.of("recovery_refused") and not run.of("recovery_failed") and not run.of("group_failure"), why
    assert [(e["attempt"], e["succeeded"]) for e in run.of("attempt_end")] == [(0, True)], why
    assert [e["outcome"] for e in run.of("end")] == ["succeeded"], why

    # no survivor restarted: one process per uid, which ended with exit code 0; the lost ones died as planted
    starts: dict[int, list[dict]] = {}
    for event in run.of("worker_start"):
        assert event["attempt"] == 0, why
        starts.setdefault(event["uid"], []).append(event)
    assert {uid: len(s) for uid, s in starts.items()} == {uid: 1 for uid in [*range(NPROC), *joiners, *respawned]}, why
    exits = {e["uid"]: e for e in run.of("worker_exit")}
    for uid in members:
        assert (exits[uid]["pid"], exits[uid]["exitcode"]) == (starts[uid][0]["pid"], 0), f"uid {uid}\n{why}"
    for uid, code in lost.items():
        assert (exits[uid]["pid"], exits[uid]["exitcode"]) == (starts[uid][0]["pid"], code), f"uid {uid}\n{why}"
    for uid in joiners:
        assert starts[uid][0]["joiner"] is True, why

    # the recovery is recorded, with every phase timed
    faults = [r for r in run.of("recovery") if r["kind"] == "fault"]
    assert len(faults) == 1, why
    recovery = faults[0]
    lost_ranks = sorted(lost)  # the uids are the initial ranks, and the fault hit generation 0
    assert sorted(recovery["lost_uids"]) == lost_ranks and sorted(recovery["lost_ranks"]) == lost_ranks, why
    assert (recovery["world_before"], recovery["world_after"]) == (NPROC, world_after), why
    assert recovery["steps_lost"] == 0 and recovery["resumed_at_step"] == fault_step, why
    assert set(recovery["phases"]) == PHASES and all(v >= 0 for v in recovery["phases"].values()), why
    assert 0 <= recovery["latency"] < 30, why
    generation = {e["gen"]: e for e in run.of("generation")}[recovery["gen"]]
    assert generation["members"] == members and generation["joiners"] == list(joiners), why  # order kept
    ranks = "|".join(", ".join(map(str, order)) for order in itertools.permutations(lost_ranks))  # fault order
    notice = (rf"ftrun: recovered from loss of ranks? ({ranks}) in \d+\.\d\d s: "
              rf"world {NPROC} -> {world_after}, 0 steps lost")
    assert re.search(notice, run.stderr), why
    # each fault was announced as it was seen (faults seen apart, apart), and the run's last line sums it up
    announced = re.findall(r"^ftrun: ranks? ([\d, ]+) lost \((?:signal SIGKILL|exit code \d+)(?:; [^)]*)?\): "
                           r"recovering in place, world (\d+) -> \d+$", run.stderr, re.M)
    assert sorted(int(r) for ranks_seen, _ in announced for r in ranks_seen.split(", ")) == lost_ranks, why
    assert announced and int(announced[0][1]) == NPROC, why
    summary = re.search(rf"^ftrun: succeeded: {STEPS} steps in \S+ s; (\d+) faults?, (\d+) recover(y|ies) in place "
                        r"\(median \S+ s\), 0 group restarts; \S+ s lost to them, goodput (\S+)$", run.stderr, re.M)
    assert summary and int(summary[1]) == len(lost) and 0 < float(summary[4]) <= 1, why

    check_steps(run, baseline, lost)
    return recovery


def check_steps(run: Run, baseline: dict[int, float], lost: dict[int, int]) -> None:
    """Every step committed once, by the group of its generation, with the baseline's loss.

    A rank that had not committed the step in flight when a peer died (while another rank had) takes
    the state from a peer at recovery, so that step, and only that step, may be missing from its own
    lines; no step may ever be committed twice by one worker (that would apply its update twice).
    """
    why = run.explain()
    commits = run.commits()
    recoveries = sorted(run.of("recovery"), key=lambda r: r["resumed_at_step"])
    gens = {e["gen"]: e["members"] for e in run.of("generation")}
    timeline = [(0, list(range(NPROC)))] + [(r["resumed_at_step"], gens[r["gen"]]) for r in recoveries]
    final = timeline[-1][1]

    def members_at(step: int) -> list[int]:
        return [m for start, m in timeline if start <= step][-1]

    may_skip = {r["resumed_at_step"] - 1 for r in recoveries}
    loss_of: dict[int, float] = {}
    for uid, lines in commits.items():
        steps = [c.step for c in lines]
        assert steps == sorted(set(steps)), f"uid {uid} committed a step twice or out of order: {steps}\n{why}"
        if uid in final:
            first = 0 if uid < NPROC else steps[0]
            assert set(range(first, STEPS)) - set(steps) <= may_skip and steps[-1] == STEPS - 1, \
                f"uid {uid} lost steps: {steps}\n{why}"
        for c in lines:
            group = members_at(c.step)
            assert (c.world, c.rank) == (len(group), group.index(uid)), f"{c}: expected generation {group}\n{why}"
            assert loss_of.setdefault(c.step, c.loss) == c.loss, f"ranks disagree on step {c.step}\n{why}"
    assert set(loss_of) == set(range(STEPS)), why
    for step in range(STEPS):
        if step < recoveries[0]["resumed_at_step"]:  # computed by generation 0: bit for bit
            assert loss_of[step] == baseline[step], f"step {step}\n{why}"
        else:
            assert loss_of[step] == pytest.approx(baseline[step], rel=RTOL), f"step {step}\n{why}"
    # the survivors went on with the new generation: every step after the recovery by all of them
    for step in range(timeline[-1][0], STEPS):
        assert {uid for uid, lines in commits.items() if any(c.step == step for c in lines)} == set(final), \
            f"step {step}\n{why}"
    for uid in lost:
        assert all(c.step < recoveries[0]["resumed_at_step"] for c in commits.get(uid, [])), why


def agent_of_node(node: int, log_dir: Path) -> psutil.Process:
    """The agent process of ``node`` of the --hostfile launch writing under ``log_dir`` (on this machine, directly
    or over ssh; other tests' launches run beside it): its node rank is in the hand-off in its environment."""
    for proc in psutil.process_iter(["cmdline"]):
        if (proc.info["cmdline"] or [])[1:4] == ["-m", "ftrun", "_agent"]:
            try:
                config = handoff.decode(proc.environ()[handoff.VARIABLE])
            except psutil.NoSuchProcess:  # another test's agent, ended since the listing
                continue
            if config.node_rank == node and config.log_dir == log_dir:
                return proc
    raise AssertionError(f"no agent for node {node}")
