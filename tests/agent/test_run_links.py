"""A node's run directory linked under node 0's, where `--resume-from <node 0's run dir>` looks for its state."""

from __future__ import annotations

from pathlib import Path

import pytest

from ftrun.agent.run_links import link_path, link_under_leader

pytestmark = pytest.mark.fast


def test_the_link_is_node_n_under_node_0s_run_directory_unless_it_is_there_already():
    mine = Path("/logs/run_b/node1")
    assert link_path({"run_dir": "/logs/run_a"}, 1, mine) == Path("/logs/run_a/node1")
    assert link_path({"run_dir": "/logs/run_b"}, 1, mine) is None  # --hostfile: one run name for every node


@pytest.mark.parametrize("job", [None, [], {}, {"run_dir": 7}, {"run_dir": "relative/run"}, {"run_dir": "/a\0b"}])
def test_a_description_that_names_no_absolute_directory_links_nothing(job):
    assert link_path(job, 1, Path("/logs/run_b/node1")) is None


def test_the_link_is_made_once_and_what_is_in_its_way_is_said_not_replaced(tmp_path):
    mine = tmp_path / "run_b" / "node1"
    mine.mkdir(parents=True)
    link = tmp_path / "run_a" / "node1"  # node 0's run directory is on another host: made here
    assert link_under_leader(link, mine) is None and link.resolve() == mine
    assert link_under_leader(link, mine) is None  # already there
    other = tmp_path / "run_c" / "node1"
    other.mkdir(parents=True)
    assert link_under_leader(other, mine) is not None and not other.is_symlink()
