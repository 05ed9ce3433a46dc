"""Slurm node lists: Slurm's documented hostlist forms expand as scontrol expands them, with the right head node."""

from __future__ import annotations

import os
import shutil

import pytest

from ftrun.errors import UsageError
from ftrun.launcher.slurm import MAX_NODES, expand_nodelist, hostnames, scontrol_hostnames, slurm_node

pytestmark = pytest.mark.fast

# Slurm's documented forms (scontrol(1), the hostlist API): ranges, lists, zero padding, several
# bracket groups, text after a bracket, commas and spaces between hosts.
FORMS = {
    "tux[0-5,12,20-25]": ["tux0", "tux1", "tux2", "tux3", "tux4", "tux5", "tux12", "tux20", "tux21", "tux22",
                          "tux23", "tux24", "tux25"],
    "node1,node[2-5,12]": ["node1", "node2", "node3", "node4", "node5", "node12"],
    "linux[1-3,6] login1": ["linux1", "linux2", "linux3", "linux6", "login1"],
    "gpu[08-11]": ["gpu08", "gpu09", "gpu10", "gpu11"],
    "n[9-11]": ["n9", "n10", "n11"],
    "n[007-10]": ["n007", "n008", "n009", "n010"],
    "n[01,3]": ["n01", "n3"],
    "x[001-003],y": ["x001", "x002", "x003", "y"],
    "a,b,,c": ["a", "b", "c"],
    "rack[1-2]-node[01-02]": ["rack1-node01", "rack1-node02", "rack2-node01", "rack2-node02"],
    "node[1-2]-ib": ["node1-ib", "node2-ib"],
    "r[1-2]n[3-4]-ib,login": ["r1n3-ib", "r1n4-ib", "r2n3-ib", "r2n4-ib", "login"],
    "single": ["single"],
}


@pytest.mark.parametrize("nodelist", FORMS)
def test_documented_forms_expand_in_slurms_order(nodelist):
    assert expand_nodelist(nodelist) == FORMS[nodelist]


@pytest.mark.parametrize("nodelist", ["n[1-2", "n1-2]", "n[[1]]", "n[a-b]", "n[3-1]", "bgl[123x456]", "n[]", "n[\u0661]",
                                      "n[" + "9" * 5000 + "]"])
def test_malformed_lists_are_refused(nodelist):
    with pytest.raises(ValueError):
        expand_nodelist(nodelist)


@pytest.mark.parametrize("nodelist", ["n[0-9999999999]", "n[1-2000][1-2000][1-2000]", "a[1-60000],b[1-60000]"])
def test_a_list_of_more_hosts_than_any_cluster_is_refused_before_it_is_expanded(nodelist):
    """Expanded, these would fill the memory or take hours."""
    with pytest.raises(ValueError, match="names more than 100,000 hosts"):
        expand_nodelist(nodelist)
    assert len(expand_nodelist("n[1-100000]")) == MAX_NODES


def test_a_node_id_that_is_no_number_is_one_short_line():
    for node_id in ("9" * 5000, "\u0663", "-1"):
        with pytest.raises(UsageError, match="is not a node number") as refused:
            slurm_node({"SLURM_JOB_NODELIST": "n[1-2]", "SLURM_NODEID": node_id})
        assert len(str(refused.value)) < 200
    assert slurm_node({"SLURM_JOB_NODELIST": "n[1-2]", "SLURM_NODEID": ""}) is None  # not in a job step


def test_the_head_node_is_the_first_host_of_several_bracket_groups():
    node = slurm_node({"SLURM_JOB_NODELIST": "rack[1-2]-node[01-02]", "SLURM_NODEID": "3"})
    assert (node.node_rank, node.nnodes, node.head) == (3, 4, "rack1-node01")
    node = slurm_node({"SLURM_NODELIST": "node[1-2]-ib", "SLURM_NODEID": "0"})
    assert (node.nnodes, node.head) == (2, "node1-ib")


def test_an_unreadable_node_list_is_one_clear_usage_error():
    with pytest.raises(UsageError, match=r"SLURM_JOB_NODELIST='n\[1-' cannot be expanded"):
        slurm_node({"SLURM_JOB_NODELIST": "n[1-", "SLURM_NODEID": "0"})


@pytest.fixture
def scontrol_env(tmp_path, monkeypatch):
    """A minimal slurm.conf, enough for scontrol to expand host lists (skips where Slurm is not installed)."""
    if shutil.which("scontrol") is None:
        pytest.skip("scontrol is not installed (apt-get install slurm-client)")
    conf = tmp_path / "slurm.conf"
    conf.write_text("ClusterName=test\nSlurmctldHost=localhost\n")
    monkeypatch.setenv("SLURM_CONF", str(conf))


def test_the_parser_agrees_with_scontrol_wherever_scontrol_accepts_the_list(scontrol_env):
    agreed = 0
    for nodelist, expected in FORMS.items():
        real = scontrol_hostnames(nodelist)
        if real is not None:  # older Slurm releases refuse text after the last bracket
            assert real == expected, nodelist
            agreed += 1
    assert agreed >= len(FORMS) - 3


def _fake_scontrol(folder, body: str, monkeypatch) -> None:
    """An `scontrol` first on PATH that runs ``body`` (a shell script)."""
    script = folder / "scontrol"
    script.write_text(f"#!/bin/sh\n{body}\n")
    script.chmod(0o755)
    monkeypatch.setenv("PATH", f"{folder}{os.pathsep}{os.environ['PATH']}")


def test_scontrol_that_hangs_or_fails_falls_back_to_the_parser(tmp_path, monkeypatch):
    marker = tmp_path / "started"
    _fake_scontrol(tmp_path, f"touch {marker}; exec sleep 600", monkeypatch)
    assert scontrol_hostnames("n[1-2]", timeout=0.5) is None and marker.exists()
    _fake_scontrol(tmp_path, "echo 'Invalid hostlist: n[1-2]'; exit 0", monkeypatch)
    assert scontrol_hostnames("n[1-2]") is None
    assert hostnames("n[1-2]-ib") == ["n1-ib", "n2-ib"]


def test_scontrols_answer_is_used_where_it_works(tmp_path, monkeypatch):
    _fake_scontrol(tmp_path, 'echo "from-scontrol-1"; echo "from-scontrol-2"', monkeypatch)
    node = slurm_node({"SLURM_JOB_NODELIST": "n[1-2]", "SLURM_NODEID": "1"})
    assert (node.nnodes, node.head) == (2, "from-scontrol-1")
