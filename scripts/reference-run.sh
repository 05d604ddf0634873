#!/usr/bin/env bash
# The multi-GPU reference run, in one command (plan it for at most 10 minutes):
#   bash scripts/reference-run.sh [OUT_DIR]
# On every GPU of this host: probe (bandwidth, JSON, plot); sweep at TP = 8, 4 and 2 where that
# many GPUs exist (subsets through CUDA_VISIBLE_DEVICES), bf16, eager and graph, 4K..256M, every
# backend that can run here (nccl4py among them, skipped with its reason when not installed) plus
# the NCCL protocol x algorithm matrix and nccl:symm (symmetric windows: the rows say which
# symmetric kernel NCCL ran, or why none); then report, floor (DeepSeek-V3 and GLM-5), recommend
# and qualify (NVSwitch spec) on each sweep.
# Other NCCL versions side by side: NCCL_LIBS="LABEL=PATH ..." (e.g. the libnccl.so.2 of an
# nvidia-nccl-cu13 wheel installed with pip install --target DIR) runs every nccl variant once
# more per library, in a child torchrun with it preloaded, and compares nccl with nccl:lib=LABEL.
# NVLink multicast stays off: the policy variables are set for every process, and
# --allow-multicast is never passed.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:-${OUT:-results/reference}/$(date +%Y%m%d-%H%M%S)-$(hostname -s)}
mkdir -p "$out"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 MSCCLPP_FORCE_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1
if ! python3 -c "import commbench.backends" 2>/dev/null; then
  python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . >"$out/install.log" 2>&1 || exit 1
fi
gpus=$(python3 -c "import torch; print(torch.cuda.device_count())")
lib_args=() lib_labels=()
for entry in ${NCCL_LIBS:-}; do
  case "$entry" in
    *=*) lib_args+=(--nccl-lib "$entry"); lib_labels+=("${entry%%=*}") ;;
    *) echo "reference-run: NCCL_LIBS entries are LABEL=PATH, got $entry" >&2; exit 2 ;;
  esac
done
start=$(date +%s)
log() { echo "# reference-run: $*" | tee -a "$out/commands.txt"; }

nvidia-smi topo -m >"$out/nvidia-smi-topo.txt" 2>&1
log "torchrun --nproc-per-node $gpus -m commbench probe --bandwidth --json probe.json --plot probe.png"
torchrun --standalone --nproc-per-node "$gpus" -m commbench probe --bandwidth --json "$out/probe.json" \
  --plot "$out/probe.png" 2>&1 | tee "$out/probe.txt"

tps="8 4 2"
sizes=()
if [ "$gpus" -lt 2 ]; then
  # Dry run on a one-GPU machine: the whole flow at world size 1 on small sizes. Its rows are
  # `no_work` (nothing is communicated), so the analysis steps say they have nothing to rank.
  tps=1
  sizes=(-e 1M)
  log "dry run: only $gpus GPU here"
fi
for tp in $tps; do
  [ "$tp" -le "$gpus" ] || continue
  devices=$(seq -s, 0 $((tp - 1)))
  dir="$out/tp$tp"
  mkdir -p "$dir"
  log "CUDA_VISIBLE_DEVICES=$devices python3 -m commbench sweep --nproc $tp --nccl-proto LL,LL128,Simple --nccl-algo Ring,Tree --nccl-symm ${lib_args[*]} --timeout 60"
  # The driver (--nproc) launches torchrun (one more per --nccl-lib, with it preloaded) and
  # resumes it without a backend that hangs.
  CUDA_VISIBLE_DEVICES=$devices python3 -m commbench sweep --nproc "$tp" \
    --nccl-proto LL,LL128,Simple --nccl-algo Ring,Tree --nccl-symm "${lib_args[@]}" --timeout 60 "${sizes[@]}" \
    --out "$dir" 2>&1 | tee "$dir/sweep.txt"
  run=$(ls -d "$dir"/*/ | head -n 1)
  log "commbench report $run; floor deepseek-v3 / glm-5 at TP $tp; recommend; qualify nvswitch"
  python3 -m commbench report "$run" 2>&1 | tee "$dir/report.txt"
  for model in deepseek-v3 glm-5; do
    python3 -m commbench floor "$run" --model "$model" --tp "$tp" --json "$dir/floor-$model.json" 2>&1 \
      | tee "$dir/floor-$model.txt"
  done
  python3 -m commbench recommend "$run" --model deepseek-v3 2>&1 | tee "$dir/recommend.txt"
  for label in "${lib_labels[@]}"; do
    log "commbench compare $run $run --backend-a nccl --backend-b nccl:lib=$label"
    python3 -m commbench compare "$run" "$run" --backend-a nccl --backend-b "nccl:lib=$label" --out "$dir" \
      --json "$dir/compare-nccl-$label.json" 2>&1 | tee "$dir/compare-nccl-$label.txt"
  done
  python3 -m commbench qualify --spec commbench/specs/nvswitch-8x-h100-h200.toml "$run" \
    --junit "$dir/qualify.xml" 2>&1 | tee "$dir/qualify.txt"
done
log "wall time $(( $(date +%s) - start )) s on $gpus GPU(s)"
