"""The command line a new user meets: --version, -h at the top, help panels, shell completion."""

from __future__ import annotations

import signal
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


def _default_signals() -> None:
    """In the child, before Python starts: the signals' default dispositions, as a terminal gives them (a test
    run in a shell's background job inherits SIGINT ignored, which ftrun rightly leaves ignored)."""
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, signal.SIG_DFL)


@pytest.mark.parametrize("sig", [2, 15, 1], ids=["SIGINT", "SIGTERM", "SIGHUP"])
def test_a_signal_while_the_command_line_is_imported_ends_ftrun_quietly(sig):
    """The ``ftrun`` command imports its command line with such a signal ending it at once: 128 + its number,
    nothing printed (before, Ctrl-C there printed a KeyboardInterrupt traceback)."""
    imports = ("import os, time; from ftrun.processes import quit_on_signals; quit_on_signals(); "
               f"os.kill(os.getpid(), {sig}); time.sleep(20)")
    res = subprocess.run([sys.executable, "-c", imports], capture_output=True, text=True, timeout=30,
                         preexec_fn=_default_signals)
    assert (res.returncode, res.stdout, res.stderr) == (128 + sig, "", "")


def test_a_signal_ignored_at_the_start_stays_ignored_while_the_command_line_is_imported():
    """As under ``nohup``, or a shell's background job and its SIGINT: ignored before ftrun, ignored by it."""
    imports = ("import os, signal; signal.signal(signal.SIGHUP, signal.SIG_IGN); "
               "from ftrun.processes import quit_on_signals; replaced = quit_on_signals(); "
               "os.kill(os.getpid(), signal.SIGHUP); print(sorted(replaced))")
    res = subprocess.run([sys.executable, "-c", imports], capture_output=True, text=True, timeout=30,
                         preexec_fn=_default_signals)
    assert (res.returncode, res.stdout, res.stderr) == (0, "[<Signals.SIGINT: 2>, <Signals.SIGTERM: 15>]\n", "")
