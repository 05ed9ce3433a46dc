"""The worker API's pure parts (data sharding), and its plain-DDP behaviour under torchrun."""

from __future__ import annotations

import re
import subprocess
import sys

import psutil
import pytest

from conftest import EXAMPLE
import torch

from ftrun.worker.data import GlobalBatches

pytestmark = pytest.mark.compat  # every test here runs on torch's current release too (.ci/run)


# ----------------------------------------------------------------------------------- GlobalBatches
@pytest.mark.fast
@pytest.mark.parametrize("num_samples,global_batch", [(4096, 128), (100, 7), (10, 4), (3, 5)])
def test_shares_of_every_world_size_partition_the_same_global_batch(num_samples, global_batch):
    batches = GlobalBatches(num_samples, global_batch, seed=3)
    for step in (0, 1, 2, 9, 31):
        batch = batches.batch(step)
        assert batch.dtype == torch.int64 and batch.shape == (global_batch,)
        for world in range(1, 6):
            shares = [batches.share(step, rank, world) for rank in range(world)]
            # contiguous shares, in rank order: concatenated they are the global batch, each sample once
            assert torch.equal(torch.cat(shares), batch), (step, world)
            sizes = [len(s) for s in shares]
            assert max(sizes) - min(sizes) <= 1 and sum(sizes) == global_batch, (step, world, sizes)


@pytest.mark.fast
def test_global_batch_is_a_pure_function_of_seed_and_step():
    forward = GlobalBatches(50, 8, seed=1)
    expected = {step: forward.batch(step) for step in range(20)}  # crosses three epoch boundaries
    backward = GlobalBatches(50, 8, seed=1)
    for step in reversed(range(20)):  # another instance, another order: the cache must not matter
        assert torch.equal(backward.batch(step), expected[step]), step
    # a rank that joins late (a respawned worker) asks for one step out of the blue
    assert torch.equal(GlobalBatches(50, 8, seed=1).share(13, 2, 3), forward.share(13, 2, 3))
    assert torch.equal(forward.batch(5), expected[5])  # after other epochs were cached
    other = GlobalBatches(50, 8, seed=2)
    assert not all(torch.equal(other.batch(s), expected[s]) for s in range(20))


@pytest.mark.fast
@pytest.mark.parametrize("num_samples,global_batch", [(100, 10), (10, 4), (7, 3)])
def test_epochs_cover_every_sample_exactly_once(num_samples, global_batch):
    batches = GlobalBatches(num_samples, global_batch, seed=0)
    epochs = 4
    stream = torch.cat([batches.batch(step) for step in range(epochs * num_samples // global_batch + 1)])
    for epoch in range(epochs):
        seen = stream[epoch * num_samples:(epoch + 1) * num_samples]
        assert sorted(seen.tolist()) == list(range(num_samples)), epoch
    # and each epoch is shuffled differently
    assert not torch.equal(stream[:num_samples], stream[num_samples:2 * num_samples])


@pytest.mark.fast
def test_step_crossing_an_epoch_boundary_takes_the_end_of_one_epoch_and_the_start_of_the_next():
    batches = GlobalBatches(10, 4, seed=0)
    epoch0 = torch.cat([batches.batch(0), batches.batch(1)])  # positions 0..7 of epoch 0
    step2 = batches.batch(2)  # positions 8, 9 of epoch 0, then 0, 1 of epoch 1
    step3 = batches.batch(3)  # positions 2..5 of epoch 1
    assert sorted(torch.cat([epoch0, step2[:2]]).tolist()) == list(range(10))
    assert len(set(torch.cat([step2[2:], step3]).tolist())) == 6


@pytest.mark.fast
@pytest.mark.parametrize("num_samples,global_batch", [(0, 4), (4, 0), (-1, 4)])
def test_non_positive_sizes_are_rejected(num_samples, global_batch):
    with pytest.raises(ValueError):
        GlobalBatches(num_samples, global_batch)


# ---------------------------------------------------------------- plain DDP under torchrun
STEP_LINE = re.compile(r"(?:^|\]: )((?:final )?step=\d+ loss=\S+)$")


def example_lines(stdout: str) -> list[str]:
    """The example's `step=<n> loss=<x>` and `final ...` lines, without any launcher prefix."""
    return [m.group(1) for line in stdout.splitlines() if (m := STEP_LINE.search(line))]


def test_example_prints_the_same_losses_under_torchrun_and_ftrun(launcher_env, free_port):
    # Under plain torchrun ftrun.init() is an ordinary init_process_group and Session.steps/commit a
    # plain DDP loop; the losses must be those of ftrun's managed run to every printed digit.
    steps = ["--steps", "5"]
    commands = [
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(free_port()),
         EXAMPLE, *steps],
        [sys.executable, "-m", "ftrun", "--nproc-per-node", "2", EXAMPLE, *steps],
    ]
    procs = [subprocess.Popen(cmd, env=launcher_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for cmd in commands]
    results = []
    for proc in procs:
        try:
            out, err = proc.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            for p in [proc, *psutil.Process(proc.pid).children(recursive=True)]:
                p.kill()
            out, err = proc.communicate()
            pytest.fail(f"{proc.args} did not finish in 120 s:\n{out}\n{err}")
        results.append((proc.returncode, out, err))
    (t_code, t_out, t_err), (f_code, f_out, f_err) = results
    assert t_code == 0, t_err
    assert f_code == 0, f_err
    expected = [f"step={s} loss=" for s in range(5)] + ["final step=4 loss="]
    t_lines, f_lines = example_lines(t_out), example_lines(f_out)
    assert [re.sub(r"loss=\S+$", "loss=", line) for line in t_lines] == expected, t_out
    assert f_lines == t_lines, f"torchrun:\n{t_out}\nftrun:\n{f_out}"


def test_at_exit_the_session_joins_the_backends_threads_under_torchrun(launcher_env, free_port, workload):
    # a Gloo thread still running into the interpreter's teardown aborts a worker whose run succeeded
    # ("terminate called without an active exception"): the shut-down must free the default group, which
    # each DDP keeps alive through its reducer, logger, process group and comm hooks' state
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
               str(free_port()), workload("exit_threads.py"), "--steps", "3"]
    run = subprocess.run(command, env=launcher_env, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert sorted(re.findall(r"threads after shut-down: (\d+)", run.stdout)) == ["1", "1"], run.stdout + run.stderr
