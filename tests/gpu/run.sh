#!/usr/bin/env bash
# Runs the GPU tests on a CUDA machine (the device tool's H200 among them):
#   bash tests/gpu/run.sh [pytest args...]        (e.g. tests/gpu/test_p2p_gpu.py -k exact)
# Installs commbench from this checkout without touching the network, then runs tests/gpu.
# Ranks that share a GPU run concurrently under a private MPS daemon started here (its own pipe
# and log directories; stopped on exit; no other daemon is touched), each test giving its ranks
# an equal share of the SMs. Without nvidia-cuda-mps-control, or with COMMBENCH_GPU_TEST_MPS=0,
# they take turns on the GPU (time slicing), which is slower and says so. The journeys
# (test_journeys_gpu.py) run without that daemon: their sweeps start their own, as a user's do.
# Logs go to $OUT (the device tool's return folder) when it is set, else to ./gpu-logs.
set -uo pipefail
cd "$(dirname "$0")/../.."
logs=${OUT:-$PWD/gpu-logs}
mkdir -p "$logs"
export PYTHONUNBUFFERED=1
# Multicast stays off unless a human allows it (docs/design.md, safety).
export NCCL_NVLS_ENABLE=${NCCL_NVLS_ENABLE:-0} TORCH_SYMM_MEM_DISABLE_MULTICAST=${TORCH_SYMM_MEM_DISABLE_MULTICAST:-1} \
       NVSHMEM_DISABLE_NVLS=${NVSHMEM_DISABLE_NVLS:-1} MSCCLPP_FORCE_DISABLE_NVLS=1
if ! python3 -c "import commbench.backends" 2>/dev/null; then
  python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . >"$logs/install.log" 2>&1 \
    || { echo "install failed"; cat "$logs/install.log"; exit 1; }
fi
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$logs/gpu.txt"

unset CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY CUDA_MPS_ACTIVE_THREAD_PERCENTAGE
pipe=""
start_mps() {   # the private daemon for the tests whose ranks share a GPU
  if [ "${COMMBENCH_GPU_TEST_MPS:-1}" != 1 ]; then
    echo "# MPS off (COMMBENCH_GPU_TEST_MPS=0): ranks sharing a GPU take turns on it (time slicing)" | tee -a "$logs/gpu.txt"
  elif ! command -v nvidia-cuda-mps-control >/dev/null; then
    echo "# nvidia-cuda-mps-control not found: ranks sharing a GPU take turns on it (time slicing)" | tee -a "$logs/gpu.txt"
  else
    pipe=$(mktemp -d /tmp/commbench-mps-pipe.XXXXXX)
    mkdir -p "$logs/mps"
    if CUDA_MPS_PIPE_DIRECTORY=$pipe CUDA_MPS_LOG_DIRECTORY=$logs/mps nvidia-cuda-mps-control -d; then
      export CUDA_MPS_PIPE_DIRECTORY=$pipe CUDA_MPS_LOG_DIRECTORY=$logs/mps
      echo "# private MPS daemon: pipe $pipe, log $logs/mps" | tee -a "$logs/gpu.txt"
    else
      echo "# MPS daemon did not start: ranks sharing a GPU take turns on it (time slicing)" | tee -a "$logs/gpu.txt"
      rm -rf "$pipe"
      pipe=""
    fi
  fi
}
stop_mps() {
  if [ -n "$pipe" ]; then
    echo quit | nvidia-cuda-mps-control
    rm -rf "$pipe"
    pipe=""
  fi
  unset CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY
}
trap stop_mps EXIT
# The journeys' sweeps start their own MPS daemon (`--mps`, as a user's would), so they run with
# none of ours beside it: named alone, with MPS off; in the whole suite, last, after ours has stopped.
journeys=tests/gpu/test_journeys_gpu.py
pytest=(python3 -m pytest -q -rs -p no:cacheprovider)
# Arguments go to pytest; when the first names a test file or node, only what they name runs.
if [ $# -gt 0 ] && [ -e "${1%%::*}" ]; then
  [ "${1%%::*}" = "$journeys" ] || start_mps
  "${pytest[@]}" "$@" 2>&1 | tee "$logs/pytest.log"
  exit "${PIPESTATUS[0]}"
fi
start_mps
"${pytest[@]}" tests/gpu --ignore "$journeys" "$@" 2>&1 | tee "$logs/pytest.log"
status=${PIPESTATUS[0]}
stop_mps
echo "# the journeys, with no MPS daemon of ours: their sweeps start their own" | tee -a "$logs/gpu.txt"
"${pytest[@]}" "$journeys" "$@" 2>&1 | tee "$logs/pytest-journeys.log"
journeys_status=${PIPESTATUS[0]}
[ "$journeys_status" -eq 5 ] && journeys_status=0   # pytest's "nothing selected": arguments that name no journey
[ "$status" -ne 0 ] && exit "$status"
exit "$journeys_status"
