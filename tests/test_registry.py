"""Where ftrun keeps its runs and its registry of running jobs (ftrun/registry.py)."""

from __future__ import annotations

import json
import os

import psutil
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


def entry_of_this_process(**fields) -> dict:
    """A registry entry (as JSON reads it back) of a job whose launcher is this test's process: alive."""
    return {"run_id": "r1_abcdef12", "rdzv_id": "r1", "host": "127.0.0.1", "port": 29500, "pid": os.getpid(),
            "run_dir": "/tmp/r1_abcdef12", "started": psutil.Process().create_time(), "secret": "ab" * 32,
            "store_url": None, **fields}


@pytest.fixture
def registry_folder(tmp_path, monkeypatch):
    """This test's own registry folder (XDG_RUNTIME_DIR in the test's directory), made."""
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    return registry.private_dir(registry.registry_dir())


@pytest.mark.fast
@pytest.mark.parametrize("field, value", [
    ("pid", "1"), ("pid", -1), ("pid", 1e308), ("started", None), ("started", "yesterday"),
    ("run_dir", None), ("run_dir", 5), ("run_dir", ""), ("run_dir", "a\0b"),
    ("store_url", 5), ("store_url", ["etcd://h:1"]), ("host", "x" * 300), ("host", 7), ("port", 0), ("port", 65536),
    ("port", "29500"), ("secret", "é" * 40), ("secret", None), ("run_id", "\ud800"), ("rdzv_id", {}),
])
def test_an_entry_with_a_field_of_the_wrong_type_or_range_is_skipped_like_bad_json(registry_folder, field, value):
    """An entry is used without more checks (a pid given to psutil, a run_dir made a Path, a store_url parsed):
    one that holds something else must be skipped as a file of bad JSON is, not end `ftrun status` in a
    traceback. The same entry with sound fields is found."""
    path = registry_folder / "r1_abcdef12.json"
    path.write_text(json.dumps(entry_of_this_process(**{field: value})))
    assert registry.running() == []
    path.write_text(json.dumps(entry_of_this_process()))
    assert [entry.run_id for entry in registry.running()] == ["r1_abcdef12"]


@pytest.mark.fast
@pytest.mark.timeout(30)
def test_an_entry_that_is_a_fifo_a_device_or_too_big_is_skipped_not_waited_on_nor_read_whole(registry_folder):
    """A FIFO made a reader wait for ever; a link to /dev/zero, or a sparse file of a gigabyte, was read whole
    into memory: none of them is an entry (ftrun writes a few hundred bytes), and the others are still found."""
    (registry_folder / "a.json").write_text(json.dumps(entry_of_this_process(run_id="a")))
    os.mkfifo(registry_folder / "fifo.json", 0o600)
    (registry_folder / "zero.json").symlink_to("/dev/zero")
    with open(registry_folder / "sparse.json", "wb") as sparse:
        sparse.truncate(1 << 30)
    (registry_folder / "folder.json").mkdir()
    assert [entry.run_id for entry in registry.running()] == ["a"]
    assert (registry_folder / "fifo.json").exists()  # not a stale entry: left as it is
