"""The open files a launch needs: the soft limit raised to them, or one line where the hard limit is too low."""

from __future__ import annotations

import resource

import pytest

from ftrun import open_files
from ftrun.errors import UsageError

INFINITY = resource.RLIM_INFINITY


@pytest.mark.fast
@pytest.mark.parametrize("soft, hard, set_to", [
    (1024, 4096, None),  # enough already
    (INFINITY, INFINITY, None),
    (64, 4096, 1000),
    (64, INFINITY, 1000),
])
def test_the_soft_limit_is_raised_only_as_far_as_needed(soft, hard, set_to):
    assert open_files.soft_limit_for(1000, soft, hard) == set_to


@pytest.mark.fast
def test_a_hard_limit_below_the_need_is_refused_with_both_numbers():
    with pytest.raises(UsageError, match=r"needs about 1000 open files and this machine allows 999 \(`ulimit -Hn`\)"):
        open_files.soft_limit_for(1000, 64, 999)


def limited(soft: int, hard: int | None = None):
    """A preexec_fn that gives the launch these open-file limits (the hard one unchanged if None)."""
    def apply() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard if hard is not None else
                                                    resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
    return apply


@pytest.fixture
def hello(tmp_path):
    script = tmp_path / "hello.py"
    script.write_text('import os\nprint("hello from rank", os.environ["RANK"])\n')
    return script


def test_more_workers_than_the_soft_limit_allows_start_once_it_is_raised(run_ftrun, hello):
    # 8 workers hold about 60 files in the agent: with 40 allowed, the 4th start failed with a traceback
    # (OSError: Too many open files) and the job with it
    result = run_ftrun("--nproc-per-node", "8", hello, preexec_fn=limited(40), timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.count("hello from rank") == 8


@pytest.mark.parametrize("args, what", [
    (["--nproc-per-node", "20"], "20 workers on this node"),
    (["-H", ",".join(f"127.0.0.{host}:1" for host in range(2, 32))], "30 hosts"),
])
def test_a_hard_limit_too_low_for_the_launch_is_one_line_before_anything_starts(run_ftrun, hello, args, what):
    result = run_ftrun(*args, hello, preexec_fn=limited(64, 100))
    assert result.returncode == 2, result.stderr
    (line,) = [line for line in result.stderr.splitlines() if "open files" in line]
    assert line.startswith(f"ftrun: error: {what}: this launch needs about ") and "allows 100" in line
    assert "Traceback" not in result.stderr and "hello" not in result.stdout
