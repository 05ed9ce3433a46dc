"""In-place recovery with real processes: 4 CPU workers on Gloo lose workers and carry on.

Each test runs `ftrun` over tests/workloads/faulty_train.py (or await_train.py, the same training with
waits on the event log where a joiner is involved) with faults planted at exact steps, and checks what
a user cares about: the job succeeds, no survivor was restarted, no step is lost or applied twice, the
loss of every step is the fault-free run's, and the recovery is recorded in the event log.
"""

from __future__ import annotations

import itertools
import json
import re
from dataclasses import dataclass
from pathlib import Path

import pytest

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
    logs = list(log_dir.glob("*/events.jsonl"))
    assert len(logs) == 1, f"expected one run directory in {log_dir}: {logs}\n{result.stderr}"
    events = [json.loads(line) for line in logs[0].read_text().splitlines() if line.strip()]
    return Run(result.returncode, result.stdout, result.stderr, events, logs[0].parent)


@pytest.fixture(scope="session")
def launch(run_ftrun, workload, tmp_path_factory):
    """Run ftrun with 4 workers over a training workload with FAULTS (and AWAIT); returns the Run."""

    def run(*ftrun_args: str, faults: str = "", wait: str = "", script: str = "faulty_train.py",
            training: list[str] = TRAINING, nproc: int = NPROC) -> Run:
        log_dir = tmp_path_factory.mktemp("run")
        result = run_ftrun("--nproc-per-node", nproc, "--log-dir", log_dir, *ftrun_args, workload(script),
                           *training, env={"FAULTS": faults, "AWAIT": wait}, timeout=TIMEOUT)
        return read_run(result, log_dir)

    return run


@pytest.fixture(scope="session")
def baseline(launch) -> dict[int, float]:
    """The fault-free run's loss per step (every rank prints the same, all-reduced loss)."""
    run = launch()
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


# ------------------------------------------------------------------------------------------ checks
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


# ---------------------------------------------------------------------------------- in-place faults
def test_sigkill_of_a_middle_rank_is_recovered_in_place(launch, baseline):
    run = launch(faults="kill:5:2")
    check_in_place(run, baseline, lost={2: -9}, fault_step=5)


def test_sigkill_of_rank_0_is_recovered_and_rank_1_becomes_rank_0(launch, baseline):
    run = launch(faults="kill:5:0")
    check_in_place(run, baseline, lost={0: -9}, fault_step=5)
    # the new rank 0 (uid 1) prints the example's per-step lines from the recovery on
    assert any("[default1]: commit uid=1 rank=0 world=3 step=5 " in line for line in run.stdout.splitlines())


def test_sigkill_inside_the_gradient_allreduce_discards_the_step_and_replays_it(launch, baseline):
    run = launch(faults="allreduce:5:1")
    check_in_place(run, baseline, lost={1: -9}, fault_step=5)


def test_exception_in_a_worker_is_recovered_in_place(launch, baseline):
    run = launch(faults="exception:5:3")
    check_in_place(run, baseline, lost={3: 1}, fault_step=5)
    assert "planted exception at step 5" in run.stderr


def test_two_workers_killed_at_once_are_recovered_in_one_recovery(launch, baseline):
    run = launch(faults="kill:5:1,kill:5:2")
    check_in_place(run, baseline, lost={1: -9, 2: -9}, fault_step=5)


def test_second_fault_during_recovery_is_folded_into_the_same_recovery(launch, baseline):
    # uid 1 dies before step 4; uid 2 dies while re-forming the group for the first new generation
    run = launch(faults="kill:4:1,recovery:4:2")
    recovery = check_in_place(run, baseline, lost={1: -9, 2: -9}, fault_step=4)
    assert [e["gen"] for e in run.of("generation")] == [1, 2] and recovery["gen"] == 2, run.explain()


def test_respawned_worker_rejoins_with_a_peers_state_and_world_returns_to_4(launch, baseline):
    # The survivors wait before step 8 until the joiner has been placed (an event in the log), so the
    # rejoin happens at a known step however long the new process takes to import torch.
    run = launch("--respawn", *NO_WATCHDOG, faults="kill:5:2", wait="8:joined", script="await_train.py")
    check_in_place(run, baseline, lost={2: -9}, fault_step=5, respawned=(4,))
    why = run.explain()
    joins = [r for r in run.of("recovery") if r["kind"] == "join"]
    assert len(joins) == 1, why
    join = joins[0]
    assert (join["world_before"], join["world_after"], join["joiners"]) == (3, 4, [4]), why
    assert join["steps_lost"] == 0 and join["resumed_at_step"] == 8, why
    assert set(join["phases"]) == PHASES and all(v >= 0 for v in join["phases"].values()), why
    generations = run.of("generation")
    assert [(g["members"], g["joiners"]) for g in generations] == [([0, 1, 3], []), ([0, 1, 3, 4], [4])], why
    respawned = [e for e in run.of("worker_start") if e["uid"] == 4]
    assert respawned[0]["joiner"] and respawned[0]["local_rank"] == 2, why
    assert {e["uid"]: e["exitcode"] for e in run.of("worker_exit")}[4] == 0, why
    # the joiner committed every step from the rejoin on, as rank 3 of 4, with the baseline's losses
    assert [c.step for c in run.commits()[4]] == list(range(8, STEPS)), why
    assert "recovered from joiner arriving" in run.stderr and "world 3 -> 4, 0 steps lost" in run.stderr, why


def test_spare_takes_over_a_lost_worker_and_world_stays_4(launch, baseline):
    # every worker waits before step 5 until the spare is ready, so the fault finds it ready
    run = launch("--spares", "1", *NO_WATCHDOG, faults="kill:5:2", wait="5:joiner_ready", script="await_train.py")
    recovery = check_in_place(run, baseline, lost={2: -9}, fault_step=5, joiners=(4,))
    assert recovery["joiners"] == [4], run.explain()
    assert [c.step for c in run.commits()[4]] == list(range(5, STEPS)), run.explain()
    assert len(run.of("recovery")) == 1 and len(run.of("generation")) == 1, run.explain()


# ------------------------------------------------------------------------------------------ fallback
def test_script_without_the_worker_api_falls_back_to_a_group_restart(launch, tmp_path):
    run = launch("--max-restarts", "1", script="fail_rank1.py", training=[str(tmp_path)], nproc=2)
    why = run.explain()
    assert run.returncode == 1, why  # rank 1 fails in both attempts
    refused = run.of("recovery_refused")
    assert len(refused) == 2, why
    assert all(re.search(r"does not use the (ftrun )?worker API", e["reason"]) for e in refused), why
    assert [e["attempt"] for e in run.of("worker_start")] == [0, 0, 1, 1], why
    assert [e["attempt"] for e in run.of("attempt_end")] == [0, 1], why
    assert not run.of("generation") and not run.of("recovery"), why
    assert "restarting the group (restart 1 of 1)" in run.stderr, why


def test_recovery_that_cannot_reach_min_nproc_falls_back_and_the_restart_completes(launch, baseline):
    # A respawned worker could bring the world back to --min-nproc 4, so the survivors wait for it; it
    # is held back (it waits for "recovery_failed" in the log) so --join-timeout expires deterministically.
    # Faults fire in attempt 0 only, so the restarted group trains from scratch without one.
    run = launch("--respawn", "--min-nproc", "4", "--join-timeout", "2", "--max-restarts", "1",
                 faults="kill:5:2", wait="joiner:recovery_failed", script="await_train.py")
    why = run.explain()
    assert run.returncode == 0, why
    failed = run.of("recovery_failed")
    assert len(failed) == 1 and "--join-timeout 2 s" in failed[0]["reason"], why
    assert not run.of("generation") and not run.of("recovery"), why
    notice = [line for line in run.stderr.splitlines() if "restarting the group (restart 1 of 1)" in line]
    assert len(notice) == 1 and "no joiner came within --join-timeout 2 s to reach --min-nproc 4" in notice[0], why
    assert [(e["attempt"], e["succeeded"]) for e in run.of("attempt_end")] == [(0, False), (1, True)], why
    second = [e for e in run.of("worker_start") if e["attempt"] == 1]
    assert [e["uid"] for e in second] == [0, 1, 2, 3], why
    assert all(e["exitcode"] == 0 for e in run.of("worker_exit") if e["pid"] in {e["pid"] for e in second}), why
    # The restart trains to the end, from scratch or from the state the survivors saved before it
    # (then nothing committed is lost: they had committed steps 0..4), with the baseline's losses.
    rescues = [e["best_step"] for e in run.of("rescue") if e["best_step"] >= 0]
    assert rescues in ([], [4]), why
    start = rescues[0] + 1 if rescues else 0
    first = run.commits(attempt=0)
    assert all([c.step for c in first[uid]] == list(range(5)) for uid in range(NPROC)), why
    restarted = run.commits(attempt=1)
    assert set(restarted) == set(range(NPROC)), why
    for uid, lines in restarted.items():
        assert [c.step for c in lines] == list(range(start, STEPS)), why
        assert all(c.world == NPROC and c.rank == uid for c in lines), why
        for c in lines:
            assert c.loss == pytest.approx(baseline[c.step], rel=RTOL), f"{c}\n{why}"


def test_no_recovery_flag_gives_a_plain_group_failure_like_torchrun(launch):
    run = launch("--no-recovery", faults="kill:5:2")
    why = run.explain()
    assert run.returncode == 1, why
    for kind in ("fault", "generation", "recovery", "recovery_refused", "recovery_failed"):
        assert not run.of(kind), why
    assert len(run.of("group_failure")) == 1 and "rank 2" in run.of("group_failure")[0]["reason"], why
    assert [e["outcome"] for e in run.of("end")] == ["failed"], why
    assert len(run.of("worker_start")) == NPROC, why  # nothing restarted
    exits = {e["uid"]: e["exitcode"] for e in run.of("worker_exit")}
    assert exits[2] == -9 and all(exits[uid] != 0 for uid in (0, 1, 3)), why  # the others were stopped
    assert max(c.step for lines in run.commits().values() for c in lines) == 4, why  # no step after the fault
    assert "recovered" not in run.stderr and "ended with signal SIGKILL" in run.stderr, why


# ----------------------------------------------------------------------------------- late joiner
def test_joiner_ready_when_the_survivors_have_finished_does_not_fail_the_job(launch, baseline):
    # The survivors finish all their steps, then wait (after the loop, e.g. saving a checkpoint) until
    # the respawned worker is ready to join. Training is complete: the late joiner is not placed, and
    # must not turn the run into a failure (nor, with --max-restarts, into a restart from scratch).
    run = launch("--respawn", "--recovery-timeout", "5", *NO_WATCHDOG, faults="kill:5:2",
                 wait="end:joiner_ready", script="await_train.py")
    why = run.explain()
    assert run.returncode == 0, why
    assert not run.of("recovery_failed"), why
    assert not any(g["joiners"] for g in run.of("generation")), why
    check_steps(run, baseline, {2: -9})
