#!/usr/bin/env bash
# GPU check, everything one GPU can show: real NVML through ftrun's health monitor; ftrun's two planes on NCCL (world
# size 1), its comm hook and commit on CUDA tensors and the stream order of their results, its state manifest of a
# CUDA model and the hook's cost per bucket (scripts/gpu_check.py); both examples under ftrun on that GPU; then four
# workers sharing the GPU, one of them SIGKILLed and recovered in place, and again with --respawn, where the
# replacement receives the CUDA state from a peer (scripts/gpu_drill.py); a group restart of a plain NCCL script,
# whose second attempt forms its communicator in a store of its own (tests/workloads/allreduce.py); last, what
# torch's native in-place reconfigure does on both NCCL backends with one rank (scripts/reconfigure_probe.py: store
# use, reconfigure after ftrun's abort) and ftrun's planes re-formed by it (gpu_check.py --planes native), reported
# and never failing the check. Needs a GPU and ftrun's dependencies (`pip
# install -e '.[gpu]'`, or torch, typer, rich, psutil and nvidia-ml-py already there); prints what it measured and
# ends with "gpu check: all passed".
#
# What one GPU cannot show: anything with two NCCL ranks (NCCL takes one rank per GPU; the drill's workers
# share the GPU on Gloo for CUDA tensors, whose point-to-point goes through host memory). So not the abort of
# an NCCL communicator with a kernel waiting for a dead peer, and not the device-to-device transfer to a rank
# behind over NCCL (it needs a source and a receiver on two GPUs): those need two GPUs or more.
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
python -c 'import torch; print(f"torch {torch.__version__}, CUDA {torch.version.cuda}")'
python scripts/nvml_check.py --seconds "${NVML_CHECK_SECONDS:-5}"
python scripts/gpu_check.py
for example in train_ddp train_fsdp; do
  python -m ftrun --nproc-per-node 1 "examples/$example.py" --steps 20 2>&1 | tail -3
done
python scripts/gpu_drill.py
restart=$(python -m ftrun --nproc-per-node 1 --max-restarts 1 tests/workloads/allreduce.py --backend nccl \
  --crash-first-attempt 2>&1) || true  # its output says what went wrong
grep -qx "\[default0\]: attempt 1 store holds: left_by_attempt_0 False, ftrun/job False" <<<"$restart" \
  && grep -qx "\[default0\]: attempt 1 step 1 sum 1 world 1" <<<"$restart" \
  || { echo "$restart"; echo "group restart on NCCL: the second attempt did not form its group in a new store"; exit 1; }
echo "group restart on NCCL: attempt 1 formed its communicator in a new store"
for nccl2 in 0 1; do  # the old NCCL backend and the rewritten one (torch 2.15's default)
  TORCH_DIST_USE_NCCL2=$nccl2 timeout 120 python scripts/reconfigure_probe.py --backend nccl \
    || echo "reconfigure probe (TORCH_DIST_USE_NCCL2=$nccl2): exited with $? (a finding, not a failure)"
  TORCH_DIST_USE_NCCL2=$nccl2 timeout 120 python scripts/gpu_check.py --planes native \
    || echo "planes in place (TORCH_DIST_USE_NCCL2=$nccl2): exited with $? (--data-reconfigure native is experimental)"
done
echo "gpu check: all passed"
