"""ftrun's console without a terminal: worker lines as they are, and each kind of wait said once."""

from __future__ import annotations

import pytest

from ftrun.console import STDOUT, Console

pytestmark = pytest.mark.fast


def test_progress_without_a_terminal_prints_each_kind_of_wait_once(capsys):
    console = Console()
    console.progress("waiting for joiners to reach --min-nproc 4: 2 of 4, 50 s left")
    console.progress("waiting for joiners to reach --min-nproc 4: 3 of 4, 49 s left")
    console.line(STDOUT, "[default0]: ", "cyan", "step=3 loss=0.5")
    console.progress(None)
    console.progress("waiting for joiners to reach --min-nproc 4: 3 of 4, 10 s left")  # a new wait
    out, err = capsys.readouterr()
    assert out == "[default0]: step=3 loss=0.5\n"
    assert err.splitlines() == ["ftrun: waiting for joiners to reach --min-nproc 4: 2 of 4, 50 s left",
                                "ftrun: waiting for joiners to reach --min-nproc 4: 3 of 4, 10 s left"]
