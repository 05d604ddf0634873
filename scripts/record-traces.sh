#!/usr/bin/env bash
# One command for the GPU traces of `commbench attribute`'s tests (scripts/record-traces.py):
#   bash scripts/record-traces.sh [--skew]   traces + manifest.json into $OUT/traces (else ./traces),
#                                            logs into $OUT/record-logs (--skew: the 4-rank late-rank set)
# Ranks share GPU 0 concurrently under a private MPS daemon started here (its own pipe and log
# directories, stopped on exit; no other daemon is touched), as tests/gpu/run.sh does; without
# nvidia-cuda-mps-control they take turns (time slicing) and the manifest says mps: false.
# Copy the result into tests/data/traces/h200-mps/ to commit it (tests/data/traces/README.md).
set -uo pipefail
cd "$(dirname "$0")/.."
dest=${OUT:-$PWD}/traces
logs=${OUT:-$PWD}/record-logs
mkdir -p "$dest" "$logs"
export PYTHONUNBUFFERED=1
# Multicast stays off (docs/design.md, safety).
export NCCL_NVLS_ENABLE=${NCCL_NVLS_ENABLE:-0} TORCH_SYMM_MEM_DISABLE_MULTICAST=${TORCH_SYMM_MEM_DISABLE_MULTICAST:-1} \
       NVSHMEM_DISABLE_NVLS=${NVSHMEM_DISABLE_NVLS:-1} MSCCLPP_FORCE_DISABLE_NVLS=1 \
       TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES=1
if ! python3 -c "import commbench.backends" 2>/dev/null; then
  python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . >"$logs/install.log" 2>&1 \
    || { echo "install failed"; cat "$logs/install.log"; exit 1; }
fi
unset CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY CUDA_MPS_ACTIVE_THREAD_PERCENTAGE
if command -v nvidia-cuda-mps-control >/dev/null; then
  pipe=$(mktemp -d /tmp/commbench-mps-pipe.XXXXXX)
  mkdir -p "$logs/mps"
  if CUDA_MPS_PIPE_DIRECTORY=$pipe CUDA_MPS_LOG_DIRECTORY=$logs/mps nvidia-cuda-mps-control -d; then
    export CUDA_MPS_PIPE_DIRECTORY=$pipe CUDA_MPS_LOG_DIRECTORY=$logs/mps
    trap 'echo quit | nvidia-cuda-mps-control; rm -rf "$pipe"' EXIT
  else
    echo "# MPS daemon did not start: ranks take turns on the GPU"; rm -rf "$pipe"
  fi
else
  echo "# nvidia-cuda-mps-control not found: ranks take turns on the GPU"
fi
# Each backend gets 60 s at most; FlashInfer, last, what is left of 330 s (its first JIT build takes about 2.5 min): 6 minutes at most.
timeout 360 python3 scripts/record-traces.py --out "$dest" "$@" 2>&1 | grep -v '^USDT:' | tee "$logs/record.log"
status=${PIPESTATUS[0]}
ls -la "$dest"
exit "$status"
