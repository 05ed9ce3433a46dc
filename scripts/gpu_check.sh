#!/usr/bin/env bash
# GPU check, everything one GPU can show: real NVML through ftrun's health monitor; ftrun's two planes on NCCL
# (world size 1), its comm hook and commit on CUDA tensors and its state manifest of a CUDA model
# (scripts/gpu_check.py); then the example under ftrun on that GPU. Needs a GPU and `pip install -e '.[gpu]'`;
# prints what it measured.
#
# What one GPU cannot show: anything with two NCCL ranks (NCCL takes one rank per GPU). So not the abort of a
# communicator with a kernel waiting for a dead peer, not a survivor recovering in place, not the
# device-to-device transfer to a rank behind (it needs a source and a receiver), and not a rescue restore (the
# state is saved by the workers that survive a failed recovery; with one rank there are none): those need two
# GPUs or more.
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
python scripts/nvml_check.py --seconds "${NVML_CHECK_SECONDS:-5}"
python scripts/gpu_check.py
ftrun --nproc-per-node 1 examples/train_ddp.py --steps 20 2>&1 | tail -3

