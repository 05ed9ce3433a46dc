"""Where ftrun keeps its runs and its registry of running jobs (ftrun/registry.py)."""

from __future__ import annotations

import pytest

from ftrun import registry


@pytest.mark.fast
def test_relative_or_empty_xdg_directories_are_ignored_not_made_under_the_working_directory(tmp_path, monkeypatch):
    """The XDG specification has a relative path in its variables ignored: `XDG_RUNTIME_DIR=ftrun-x ftrun ...`
    must not make ./ftrun-x/ftrun/runs wherever the command runs (nor an empty value ./ftrun/...)."""
    work, home = tmp_path / "work", tmp_path / "home"
    (work / "relative").mkdir(parents=True)
    monkeypatch.chdir(work)
    monkeypatch.setenv("HOME", str(home))
    for runtime, cache in (("relative", "relative"), ("", "")):
        monkeypatch.setenv("XDG_RUNTIME_DIR", runtime)
        monkeypatch.setenv("XDG_CACHE_HOME", cache)
        assert registry.registry_dir() == home / ".cache" / "ftrun" / "registry"
        assert registry.default_runs_root() == home / ".cache" / "ftrun" / "runs"
    assert sorted(p.name for p in work.iterdir()) == ["relative"] and not any((work / "relative").iterdir())
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(work / "relative"))  # an absolute one is used as given
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    assert registry.registry_dir() == work / "relative" / "ftrun" / "runs"
    assert registry.default_runs_root() == tmp_path / "cache" / "ftrun" / "runs"


@pytest.mark.fast
def test_a_registry_folder_too_long_to_look_up_holds_no_running_job(tmp_path, monkeypatch):
    """`XDG_CACHE_HOME` naming a path past the system's 255 bytes: `ftrun status` finds no job, not a traceback."""
    monkeypatch.setenv("XDG_RUNTIME_DIR", "")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / ("c" * 300)))
    assert registry.running() == []
