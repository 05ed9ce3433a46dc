"""The NCCL line at start-up: which NCCL torch loaded, where there are GPUs, and a warning for a clashing wheel."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from ftrun.nccl import NcclFacts, nccl_notices, read_facts

CU13 = NcclFacts("2.14.1+cu130", "13.0", "2.30.7", {"nvidia-nccl-cu13": "2.30.7"})


@pytest.mark.fast
def test_one_dim_line_names_nccls_version_and_its_wheel_where_there_are_gpus():
    assert nccl_notices(CU13, gpus=8) == [
        ("ftrun: NCCL 2.30.7 (torch 2.14.1+cu130, CUDA 13.0, from nvidia-nccl-cu13 2.30.7)", "dim")]
    assert nccl_notices(CU13, gpus=0) == [] and nccl_notices(None, gpus=8) == []
    container = NcclFacts("2.6.0a0+ecf3bae40a.nv25.01", "12.8", "2.25.1", {})  # the system's NCCL, no wheel
    assert nccl_notices(container, gpus=1) == [
        ("ftrun: NCCL 2.25.1 (torch 2.6.0a0+ecf3bae40a.nv25.01, CUDA 12.8)", "dim")]


@pytest.mark.fast
def test_an_nccl_wheel_for_another_cuda_is_a_warning():
    both = NcclFacts("2.14.1+cu130", "13.0", "2.30.7", {"nvidia-nccl-cu12": "2.27.3", "nvidia-nccl-cu13": "2.30.7"})
    (_, (warning, style)) = nccl_notices(both, gpus=1)
    assert style == "bold yellow" and warning.startswith("ftrun: nvidia-nccl-cu12 is installed too")
    assert warning.endswith("pip uninstall nvidia-nccl-cu12")


def test_the_facts_are_the_loaded_torchs_and_reading_them_imports_nothing():
    facts = read_facts()
    if torch.version.cuda is None:
        assert facts is None
        return
    assert (facts.torch_version, facts.cuda) == (torch.__version__, torch.version.cuda)
    assert facts.nccl == ".".join(str(part) for part in torch.cuda.nccl.version()[:3])
    probe = "import sys; from ftrun.nccl import read_facts; print(read_facts(), 'torch' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
    assert done.stdout.split() == ["None", "False"], done.stderr


@pytest.mark.skipif(torch.version.cuda is None, reason="a CPU build of torch has no NCCL to report")
def test_a_launch_with_a_gpu_visible_reports_nccl_once(run_ftrun, workload):
    expected = f"ftrun: NCCL {read_facts().nccl} (torch {torch.__version__}, CUDA {torch.version.cuda}"
    shown = run_ftrun("--nproc-per-node", "1", workload("echo_lines.py"), env={"CUDA_VISIBLE_DEVICES": "0"})
    assert shown.returncode == 0 and shown.stderr.count(expected) == 1, shown.stderr
    hidden = run_ftrun("--nproc-per-node", "1", workload("echo_lines.py"), env={"CUDA_VISIBLE_DEVICES": ""})
    assert hidden.returncode == 0 and "ftrun: NCCL" not in hidden.stderr, hidden.stderr
