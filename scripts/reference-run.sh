#!/usr/bin/env bash
# The multi-GPU reference run, in one command (plan it for at most 10 minutes):
#   bash scripts/reference-run.sh [OUT_DIR]
# On every GPU of this host: probe (bandwidth, JSON, plot); sweep at TP = 8, 4 and 2 where that
# many GPUs exist (subsets through CUDA_VISIBLE_DEVICES), bf16, eager and graph, 4K..256M, every
# backend that can run here (nccl4py among them, skipped with its reason when not installed) plus
# the NCCL protocol x algorithm matrix and nccl:symm (symmetric windows: the rows say which
# symmetric kernel NCCL ran, or why none); FlashInfer (trtllm one/two-shot, pcie_ipc tuned per
# size, mnnvl skipped: multicast stays off) and MSCCL++ (auto, each default algorithm, and the
# shim when MSCCLPP_NCCL_LIB=PATH names libmscclpp_nccl.so) where installed, else skipped with
# the reason; then fused vs unfused allreduce + residual + RMSNorm on model shapes (--tokens
# 1..256 at --hidden 7168 and 6144: flashinfer fused one/two-shot against unfused:best, fusion.json
# in each run dir); then report, floor (DeepSeek-V3 and GLM-5), recommend and qualify (NVSwitch
# spec) on each plain sweep, report on each fused one, and `commbench table` over all of them.
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
mscclpp_args=()
if [ -n "${MSCCLPP_NCCL_LIB:-}" ]; then
  [ -f "$MSCCLPP_NCCL_LIB" ] || { echo "reference-run: MSCCLPP_NCCL_LIB=$MSCCLPP_NCCL_LIB: no such file" >&2; exit 2; }
  mscclpp_args=(--mscclpp-nccl-lib "$(realpath "$MSCCLPP_NCCL_LIB")")
fi
start=$(date +%s)
log() { echo "# reference-run: $*" | tee -a "$out/commands.txt"; }

nvidia-smi topo -m >"$out/nvidia-smi-topo.txt" 2>&1
log "torchrun --nproc-per-node $gpus -m commbench probe --bandwidth --json probe.json --plot probe.png"
torchrun --standalone --nproc-per-node "$gpus" -m commbench probe --bandwidth --json "$out/probe.json" \
  --plot "$out/probe.png" 2>&1 | tee "$out/probe.txt"

tps="8 4 2"
sizes=()
runs=()
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
  log "CUDA_VISIBLE_DEVICES=$devices python3 -m commbench sweep --nproc $tp --nccl-proto LL,LL128,Simple --nccl-algo Ring,Tree --nccl-symm ${lib_args[*]} ${mscclpp_args[*]} --timeout 60"
  # The driver (--nproc) launches torchrun (one more per --nccl-lib, and one for the MSCCL++
  # shim, each with its library preloaded) and resumes it without a backend that hangs or crashes.
  CUDA_VISIBLE_DEVICES=$devices python3 -m commbench sweep --nproc "$tp" \
    --nccl-proto LL,LL128,Simple --nccl-algo Ring,Tree --nccl-symm "${lib_args[@]}" "${mscclpp_args[@]}" \
    --timeout 60 "${sizes[@]}" --out "$dir" 2>&1 | tee "$dir/sweep.txt"
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
  runs+=("${run%/}")
  [ "$tp" -ge 2 ] || continue
  for hidden in 7168 6144; do
    fdir="$out/tp$tp-fused-h$hidden"
    mkdir -p "$fdir"
    log "CUDA_VISIBLE_DEVICES=$devices python3 -m commbench sweep --nproc $tp --tokens 1,2,4,8,16,32,64,128,256 --hidden $hidden --backends nccl,p2p,symm_mem,flashinfer,unfused:best"
    # unfused:best is the fastest correct plain allreduce of the same run at each size, so the
    # plain backends it may pick run on these shapes too.
    CUDA_VISIBLE_DEVICES=$devices python3 -m commbench sweep --nproc "$tp" --tokens 1,2,4,8,16,32,64,128,256 \
      --hidden "$hidden" --backends nccl,p2p,symm_mem,flashinfer,unfused:best --timeout 60 --out "$fdir" 2>&1 \
      | tee "$fdir/sweep.txt"
    frun=$(ls -td "$fdir"/*/ | head -n 1)
    python3 -m commbench report "$frun" 2>&1 | tee "$fdir/report.txt"
    runs+=("${frun%/}")
  done
done
[ ${#runs[@]} -eq 0 ] || python3 -m commbench table "${runs[@]}" --out "$out/README-table.md"
log "wall time $(( $(date +%s) - start )) s on $gpus GPU(s)"
