#!/usr/bin/env bash
# GPU check: real NVML through ftrun's health monitor (devices, event registration, ECC counters, the recovery
# action field, for a few seconds), NCCL through ftrun's recovery path on one GPU (form, abort, re-form), then
# the example under ftrun on that GPU. Needs a GPU and `pip install -e '.[gpu]'`; prints what it measured.
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
python scripts/nvml_check.py --seconds "${NVML_CHECK_SECONDS:-5}"
python scripts/gpu_check.py
ftrun --nproc-per-node 1 examples/train_ddp.py --steps 20 2>&1 | tail -3
