#!/usr/bin/env bash
# Runs the GPU tests on a CUDA machine (the device tool's H200 among them):
#   bash tests/gpu/run.sh [pytest args...]
# Installs commbench from this checkout without touching the network, then runs tests/gpu.
# Logs go to $OUT (the device tool's return folder) when it is set, else to ./gpu-logs.
set -uo pipefail
cd "$(dirname "$0")/../.."
logs=${OUT:-$PWD/gpu-logs}
mkdir -p "$logs"
export PYTHONUNBUFFERED=1
# Multicast stays off unless a human allows it (DESIGN.md safety rules).
export NCCL_NVLS_ENABLE=${NCCL_NVLS_ENABLE:-0} TORCH_SYMM_MEM_DISABLE_MULTICAST=${TORCH_SYMM_MEM_DISABLE_MULTICAST:-1} \
       NVSHMEM_DISABLE_NVLS=${NVSHMEM_DISABLE_NVLS:-1} MSCCLPP_FORCE_DISABLE_NVLS=1
if ! python3 -c "import commbench.backends" 2>/dev/null; then
  python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . >"$logs/install.log" 2>&1 \
    || { echo "install failed"; cat "$logs/install.log"; exit 1; }
fi
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$logs/gpu.txt"
python3 -m pytest tests/gpu -q -rs -p no:cacheprovider "$@" 2>&1 | tee "$logs/pytest.log"
