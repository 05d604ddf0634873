#!/usr/bin/env bash
# One device call's batch on a GPU machine without a network (the device tool's H200): the
# carried packages installed, then the named steps in order, every log and run dir packed into
# $OUT as a few tarballs (the device tool brings back at most 8 files, 2 folders deep).
#   bash scripts/h200-batch.sh CARRY_DIR STEP [STEP ...]
# CARRY_DIR holds what the machine cannot download: wheels (*.whl, installed with --no-deps into
# /tmp/site) and unpacked package trees as *.tar.xz (FlashInfer's trimmed tree with its modules
# built ahead of time by scripts/flashinfer_aot.py, SGLang's Python files: unpacked into /tmp/site).
# Steps (each under what is left of BATCH_BUDGET_S, default 560 s, from the batch's start):
#   p2p        bash tests/gpu/run.sh tests/gpu/test_p2p_gpu.py -k "$P2P_TESTS" (the p2p kernels' checks, fused ones
#              too; P2P_TESTS unset: every test)
#   fused      scripts/mps-reference.sh --parts fused at --ranks $FUSED_RANKS (default 2,4,8, in that
#              order; skipped when p2p ran and failed: the reference of a kernel that fails its checks
#              would be void)
#   study      the p2p-tune README's study of the graph one-shot, 4 and 2 ranks, and its table
#   engines    scripts/mps-reference.sh --parts engines with FlashInfer's TRT-LLM rows, 2, 4 and 8 ranks
#   journeys   bash tests/gpu/run.sh tests/gpu/test_journeys_gpu.py
#   gpu        bash tests/gpu/run.sh (the whole of tests/gpu)
# NVLink multicast stays off in every process. Exit status: the last failed step's, else 0.
set -uo pipefail
usage="usage: scripts/h200-batch.sh CARRY_DIR STEP [STEP ...] (steps: p2p fused study engines journeys gpu)"
[ $# -ge 2 ] || { echo "h200-batch: $usage" >&2; exit 2; }
carry=$(cd "$1" && pwd) || { echo "h200-batch: $1: no such folder" >&2; exit 2; }
shift
for step in "$@"; do
  case $step in p2p|fused|study|engines|journeys|gpu) ;; *) echo "h200-batch: unknown step $step ($usage)" >&2; exit 2 ;; esac
done
[ -n "${OUT:-}" ] || { echo "h200-batch: OUT must name the folder that comes back" >&2; exit 2; }
cd "$(dirname "$0")/.."
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 MSCCLPP_FORCE_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1 FLASHINFER_CUDA_ARCH_LIST=${FLASHINFER_CUDA_ARCH_LIST:-9.0a}
start=$(date +%s)
budget=${BATCH_BUDGET_S:-560}
work=/tmp/h200-batch-$start
mkdir -p "$work"
final_out=$OUT
log() { echo "# h200-batch $(( $(date +%s) - start )) s: $*" | tee -a "$work/batch.log"; }
pack() {   # every step's folder as one tarball, plus the batch log
  for dir in "$work"/*/; do
    [ -d "$dir" ] && tar -czf "$final_out/$(basename "$dir").tar.gz" -C "$work" "$(basename "$dir")"
  done
  cp "$work/batch.log" "$final_out/batch.log"
}
trap pack EXIT

site=/tmp/site
if [ ! -f "$site/.installed" ]; then
  mkdir -p "$site"
  wheels=("$carry"/*.whl)
  if [ -e "${wheels[0]}" ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" "${wheels[@]}" \
      >>"$work/batch.log" 2>&1 || log "installing the carried wheels failed"
  fi
  for tree in "$carry"/*.tar.xz; do
    [ -e "$tree" ] && { tar -xJf "$tree" -C "$site" || log "unpacking $tree failed"; }
  done
  touch "$site/.installed"
fi
export PYTHONPATH=$site${PYTHONPATH:+:$PYTHONPATH}
python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . >>"$work/batch.log" 2>&1 \
  || { log "installing commbench failed"; exit 1; }
log "code $(cat COMMIT 2>/dev/null || echo unknown); $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader)"
python3 - >>"$work/batch.log" 2>&1 <<'EOF'
import importlib.metadata as m
for name in ("torch", "cupy-cuda13x", "cuda-bindings", "flashinfer-python", "sglang", "apache-tvm-ffi"):
    try:
        print(f"{name} {m.version(name)}")
    except m.PackageNotFoundError:
        print(f"{name} not installed")
EOF

# The engine-kernel reference's backends: the engines' kernels beside ours, torch's and FlashInfer's TRT-LLM.
engine_backends=p2p:auto,p2p:oneshot_graph,p2p:twoshot_graph,symm_mem:one_shot,symm_mem:two_shot,sglang:custom_ar
engine_backends+=,vllm:custom_ar,flashinfer:trtllm_oneshot,flashinfer:trtllm_twoshot
status=0
p2p_failed=0
run_step() {   # run_step NAME COMMAND...: in its own folder, bounded by what is left of the budget
  local name=$1 left=$(( budget - ($(date +%s) - start) ))
  shift
  if [ "$left" -lt 30 ]; then
    log "$name: not run ($left s of the budget left)"
    status=1
    return 1
  fi
  mkdir -p "$work/$name"
  log "$name: $* (up to $left s)"
  OUT=$work/$name timeout "$left" "$@" >"$work/$name/console.log" 2>&1
  local rc=$?
  log "$name: exit status $rc after $(( $(date +%s) - start )) s; last lines:"
  tail -n 15 "$work/$name/console.log" | tee -a "$work/batch.log"
  [ "$rc" -eq 0 ] || status=$rc
  return "$rc"
}

for step in "$@"; do
  case $step in
    p2p) run_step p2p bash tests/gpu/run.sh tests/gpu/test_p2p_gpu.py -k "${P2P_TESTS:-}" || p2p_failed=1 ;;
    fused)
      if [ "$p2p_failed" = 1 ]; then
        log "fused: not run (the p2p checks failed in this call)"
      else
        run_step fused bash scripts/mps-reference.sh "$work/fused/ref" --ranks "${FUSED_RANKS:-2,4,8}" --parts fused
      fi ;;
    study)
      python3 scripts/p2p_kernel_study.py prepare "$work/study-site" >>"$work/batch.log" 2>&1
      studies=sglang:1shot_pull,p2pstudy:base.oneshot_graph,p2pstudy:window_late.oneshot_graph,p2pstudy:graph_bare.oneshot_graph,p2pstudy:graph_nocount.oneshot_graph,p2pstudy:graph_lean.oneshot_graph
      # shellcheck disable=SC2016
      run_step study bash -c 'for n in 4 2; do
          PYTHONPATH=$0:$PYTHONPATH python3 -m commbench sweep --nproc $n --share-gpus --mps --mode graph --dtype bf16 \
            --iters 10 --timeout 30 --setup-timeout 120 --sizes 64K,128K,256K,512K,1M,2M,4M --backends $1 \
            --out $OUT/world$n || exit $?
        done
        PYTHONPATH=$0:$PYTHONPATH python3 scripts/p2p_kernel_study.py table $OUT/world*/* | tee $OUT/tables.md' \
        "$work/study-site" "$studies" ;;
    engines)
      run_step engines env ENGINE_KERNEL_BACKENDS=$engine_backends \
        bash scripts/mps-reference.sh "$work/engines/ref" --ranks 2,4,8 --parts engines ;;
    journeys) run_step journeys bash tests/gpu/run.sh tests/gpu/test_journeys_gpu.py ;;
    gpu) run_step gpu bash tests/gpu/run.sh ;;
  esac
done
log "done, exit status $status"
exit "$status"
