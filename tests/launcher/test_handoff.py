"""The hand-off from a --hostfile launcher to each host's agent: the one configuration, versioned, as one line."""

from __future__ import annotations

import dataclasses
import json
import signal
from pathlib import Path

import pytest

from ftrun.agent.env import worker_env
from ftrun.config import Endpoint, LaunchConfig, RecoveryConfig
from ftrun.errors import UsageError
from ftrun.health.signals import Action
from ftrun.launcher import handoff
from ftrun.launcher.hosts import Host
from ftrun.store.etcd_config import EtcdOptions

pytestmark = pytest.mark.fast


def launcher_config() -> LaunchConfig:
    """A --hostfile launch of two hosts with unlike slot counts and most knobs away from their defaults."""
    return LaunchConfig(
        command=["/usr/bin/python3", "-u", "train.py", "--lr", "0.1"], script="train.py",
        script_args=["--lr", "0.1"], nproc_per_node=4, min_nodes=2, max_nodes=2, store=Endpoint("node0", 0),
        master_addr="node0", run_id="job7", rdzv_backend="c10d", monitor_interval=0.2, log_dir=Path("/logs"),
        redirects={0: 3, 1: 2}, tee={3: 1}, local_ranks_filter={0, 2}, signals_to_handle=[signal.SIGTERM],
        recovery=RecoveryConfig(respawn=True, spares=1, min_nproc=2, recovery_timeout=12.5, hang_timeout=40.0,
                                refresh_every=3),
        node_sizes=(4, 2), hosts=[Host("node0", 4), Host("node1", 2)], node_timeout=7.0,
        xid_table={13: (Action.EVICT_GPU, "graphics engine exception"), 79: (Action.EVICT_NODE, "fallen off")},
        resume_from=Path("/runs/job6_0123abcd"))


def test_each_agent_gets_the_launchers_configuration_with_its_own_part_filled_in():
    config = handoff.agent_config(launcher_config(), node_rank=1, node_name="node1", store=Endpoint("node0", 29511),
                                  run_name="job7_abcd1234")
    line = handoff.encode(config)
    assert "\n" not in line and json.loads(line)["ftrun_handoff"] == handoff.VERSION
    agent = handoff.decode(line)
    assert agent == config
    assert (agent.node_rank, agent.nproc_per_node, agent.sizes, agent.world_size) == (1, 2, (4, 2), 6)
    assert (agent.store, agent.master_addr, agent.node_name, agent.run_name) == (Endpoint("node0", 29511), "node0",
                                                                                  "node1", "job7_abcd1234")
    assert agent.hosts is None and not agent.host_store and agent.under_launcher and agent.multinode
    assert agent.xid_table[13] == (Action.EVICT_GPU, "graphics engine exception")
    env = worker_env(agent, rank=4, local_rank=0, uid=4, restart_count=0,
                     store=Endpoint("node0", 29511), run_dir="/runs/r")
    assert env["FTRUN_REFRESH_EVERY"] == "3"  # --refresh-every reaches every worker of every host


def test_with_etcd_node_0_serves_the_group_store_and_the_others_read_where_in_etcd():
    etcd = EtcdOptions((("e1", 2379), ("e2", 2380)), "job7", ca_cert="/ca.pem", user="ft", password_file="/pw")
    config = dataclasses.replace(launcher_config(), etcd=etcd, store=Endpoint("node0", 0), store_listen="")
    node0, node1 = (handoff.decode(handoff.encode(handoff.agent_config(config, node_rank=rank, node_name=f"node{rank}",
                                                                       store=config.store, run_name="job7_ab")))
                    for rank in (0, 1))
    assert node0.etcd == node1.etcd == etcd  # the cluster and its credentials' files, whole
    assert node0.host_store and node0.store == Endpoint("node0", 0) and node0.store_listen == ""  # resolved there
    assert not node1.host_store and node1.store.port == 0  # port 0: node 0 publishes its port in etcd


@pytest.mark.parametrize("line, message", [
    ('{"ftrun_handoff": 2, "config": {}}', "reads hand-off version 1, the launcher sent 2"),
    ('{"config": {}}', "the launcher sent None"),
    ("[1, 2]", "could not be read"),
    ("not json", "could not be read"),
    ('{"ftrun_handoff": 1, "config": {"command": []}}', "could not be read"),
])
def test_a_hand_off_of_another_version_or_shape_is_one_line(line, message):
    with pytest.raises(UsageError, match=message) as refused:
        handoff.decode(line)
    assert "\n" not in str(refused.value) and "same ftrun on every host" in str(refused.value)


def test_a_hand_off_too_long_for_one_variable_is_refused_at_the_launcher():
    config = launcher_config()
    config.script_args.append("x" * handoff.MAX_LENGTH)
    with pytest.raises(UsageError, match="characters"):
        handoff.encode(config)
