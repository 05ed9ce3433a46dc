"""The command line a new user meets: --version, -h at the top, help panels, shell completion."""

from __future__ import annotations

import subprocess
import sys

import pytest

import ftrun
from ftrun.cli import NODES_PANEL, RECOVERY_PANEL, TORCHRUN_PANEL, main

FTRUN = [sys.executable, "-m", "ftrun"]


def run(capsys: pytest.CaptureFixture, *args: str) -> tuple[int, str]:
    with pytest.raises(SystemExit) as exited:
        main(list(args))
    return exited.value.code, capsys.readouterr().out


@pytest.mark.fast
def test_version_and_help_at_the_top_level(capsys):
    assert run(capsys, "--version") == (0, f"ftrun {ftrun.__version__}\n")
    for flag in ("-h", "--help"):
        code, out = run(capsys, flag)
        assert code == 0 and "ftrun FLAGS script.py ARGS is short for ftrun run" in " ".join(out.split())
        assert all(command in out for command in ("run", "status", "inject"))


@pytest.mark.fast
def test_run_help_shows_ftruns_own_flags_first_then_torchruns(capsys):
    code, out = run(capsys, "run", "-h")
    assert code == 0
    panels = [out.index(title[:40]) for title in (RECOVERY_PANEL, NODES_PANEL, TORCHRUN_PANEL)]
    assert panels == sorted(panels)
    assert out.index("--respawn") < out.index(TORCHRUN_PANEL[:40]) < out.index("--nproc-per-node")


def test_shell_completion_completes_subcommands_and_flags(launcher_env):
    def complete(words: str) -> str:
        env = {**launcher_env, "_FTRUN_COMPLETE": "complete_bash", "COMP_WORDS": words,
               "COMP_CWORD": str(len(words.split()) - 1)}
        done = subprocess.run(FTRUN, env=env, capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stderr
        return done.stdout

    assert complete("ftrun sta").split() == ["status"]
    assert complete("ftrun run --resp").split() == ["--respawn"]
    script = subprocess.run([*FTRUN, "--print-completion", "bash"], env=launcher_env, capture_output=True,
                            text=True, timeout=60)
    assert script.returncode == 0 and "_FTRUN_COMPLETE=complete_bash" in script.stdout
