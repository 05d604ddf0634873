#!/usr/bin/env bash
# The emulated reference run on ONE GPU: several ranks share it, concurrently under MPS.
#   bash scripts/mps-reference.sh OUT_DIR [--ranks 2,4,8] [--parts allreduce,fused,pcie,nopdl,mscclpp]
# Per world size N (default 2, 4 and 8), graph mode, bf16, through the crash-proof --nproc driver
# with --share-gpus --mps (a private MPS daemon, each rank 100/N % of the SMs), each part its own
# run dir OUT_DIR/worldN/PART (default every part; --ranks and --parts split the work into
# separate calls writing into the same OUT_DIR):
#   allreduce  plain allreduce 4K..8M: every p2p variant the registry offers (asked of the
#              factory), symm_mem one/two-shot, flashinfer trtllm one/two-shot;
#   fused      fused vs unfused on model shapes, --tokens 1..256 at --hidden 7168 and at 6144
#              (run dirs fused-h7168, fused-h6144): commbench's own fused kernel (p2p:fused, and
#              each of its forms, p2p:fused_oneshot and p2p:fused_twoshot), flashinfer fused
#              one/two-shot, unfused:best, and the plain backends unfused:best picks from
#              (p2p:auto, itself the fastest p2p kernel per size, and flashinfer trtllm
#              one/two-shot); fusion.json in each run dir, and scripts/fused-ratios.py's same-run
#              tables in OUT_DIR/fused-ratios.md;
#   pcie       flashinfer:pcie_ipc tuned per size bucket (FlashInfer's autotuner), beside p2p:auto,
#              on the sizes 8K..8M by factor 4: one hidden (4096) and six token buckets, because
#              a search that keeps no winner profiles every bucket again for each bucket (about
#              3 s a profile at 2 ranks under MPS, docs/backends.md); then pcie-seed, the same sizes with
#              FlashInfer's untuned seed configurations (--flashinfer-pcie-tune seed);
#   nopdl      flashinfer trtllm one-shot and p2p:auto with programmatic dependent launch off
#              (--flashinfer-pdl off --p2p-pdl off), 4K..8M: what PDL is worth against the
#              allreduce part;
#   mscclpp    every mscclpp variant (auto, each default algorithm, the shim) beside p2p:auto
#              (a peer measured in the same run), 4K..4M by factor 4, after every
#              other part of every world size, so that an MSCCL++ build started beside this
#              script has the most time to finish;
#   engines    (only when named) the engines' own kernels, every sglang and vllm variant (installed
#              beside commbench: docs/engine-kernels.md), beside p2p:auto and symm_mem one/two-shot,
#              4K..8M; ENGINE_KERNEL_BACKENDS=LIST replaces that list (add FlashInfer's TRT-LLM
#              one/two-shot once its JIT modules are built: docs/testing.md); then
#              scripts/engine-kernel-ratios.py writes the same-run ratio tables to
#              OUT_DIR/engine-ratios.md.
# Then `commbench report` on every run dir, and `commbench table` over all of them (every run
# under OUT_DIR, this call's and earlier ones') into OUT_DIR/README-table.md.
# Timing: --iters 10 graph replays per pass (of 128 calls each up to 2 MiB; the sweep's default
# is 20-50); MPS_REFERENCE_ITERS=N overrides it.
# MSCCLPP_NCCL_LIB=PATH passes --mscclpp-nccl-lib (the shim is still skipped with its reason:
# NCCL's API refuses ranks that share a GPU). NVLink multicast stays off for every process.
# These rows measure each backend's protocol with no fabric between the ranks (docs/emulation.md).
set -uo pipefail
usage="usage: scripts/mps-reference.sh OUT_DIR [--ranks 2,4,8] [--parts allreduce,fused,pcie,nopdl,mscclpp,engines]"
all_parts=allreduce,fused,pcie,nopdl,mscclpp   # the default
known_parts=$all_parts,engines
bad() { echo "mps-reference: $*" >&2; exit 2; }
[ $# -ge 1 ] || bad "needs OUT_DIR ($usage)"
case $1 in -*) bad "needs OUT_DIR first, got $1 ($usage)" ;; esac
out=$1
shift
ranks=2,4,8
parts=$all_parts
while [ $# -gt 0 ]; do
  case $1 in
    --ranks) [ $# -ge 2 ] || bad "--ranks needs a list, e.g. --ranks 2,4,8"; ranks=$2; shift 2 ;;
    --ranks=*) ranks=${1#--ranks=}; shift ;;
    --parts) [ $# -ge 2 ] || bad "--parts needs a list, e.g. --parts $known_parts"; parts=$2; shift 2 ;;
    --parts=*) parts=${1#--parts=}; shift ;;
    *) bad "unknown argument $1 ($usage)" ;;
  esac
done
[[ $ranks =~ ^[0-9]+(,[0-9]+)*$ ]] || bad "--ranks takes a comma-separated list such as 2,4,8, got '$ranks'"
seen=","
for n in ${ranks//,/ }; do
  case $n in 2|4|8) ;; *) bad "--ranks takes 2, 4 and 8 (the world sizes every backend here supports), got $n" ;; esac
  case $seen in *",$n,"*) bad "--ranks lists $n twice" ;; esac
  seen="$seen$n,"
done
[[ $parts =~ ^[a-z]+(,[a-z]+)*$ ]] || bad "--parts takes a comma-separated list such as $known_parts, got '$parts'"
seen=","
for part in ${parts//,/ }; do
  case ",$known_parts," in *",$part,"*) ;; *) bad "--parts takes $known_parts, got $part" ;; esac
  case $seen in *",$part,"*) bad "--parts lists $part twice" ;; esac
  seen="$seen$part,"
done
wants() { case ",$parts," in *",$1,"*) return 0 ;; esac; return 1; }
iters=${MPS_REFERENCE_ITERS:-10}
[[ $iters =~ ^[1-9][0-9]*$ ]] || bad "MPS_REFERENCE_ITERS must be a positive whole number, got '$iters'"
engines=${ENGINE_KERNEL_BACKENDS:-p2p:auto,symm_mem:one_shot,symm_mem:two_shot,sglang:custom_ar,vllm:custom_ar}
[[ $engines =~ ^[A-Za-z0-9_:,=.-]+$ ]] || bad "ENGINE_KERNEL_BACKENDS must be a comma-separated list of backends, got '$engines'"
[ ! -e "$out" ] || [ -d "$out" ] || bad "$out exists and is not a directory"
py=${PYTHON:-python3}
"$py" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" \
  || bad "needs a CUDA GPU (this run puts every rank on one GPU under MPS)"
command -v nvidia-cuda-mps-control >/dev/null || bad "needs nvidia-cuda-mps-control (the ranks share the GPU under MPS)"
mkdir -p "$out" 2>/dev/null && [ -w "$out" ] || bad "$out: cannot write there"
out=$(cd "$out" && pwd)
lib=${MSCCLPP_NCCL_LIB:-}
[ -z "$lib" ] || [ -f "$lib" ] || bad "MSCCLPP_NCCL_LIB=$lib: no such file"
[ -z "$lib" ] || lib=$(realpath "$lib")

cd "$(dirname "$0")/.."
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 MSCCLPP_FORCE_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1
if ! "$py" -c "import commbench.backends" 2>/dev/null; then
  "$py" -m pip install -q --no-deps --no-build-isolation --no-index -e . >"$out/install.log" 2>&1 \
    || { echo "mps-reference: installing commbench failed (see $out/install.log)" >&2; exit 1; }
fi

# Every variant the p2p family offers, from its own factory (the probe's list of it).
p2p=$("$py" -c "from commbench import backends; print(','.join(b.name for b in backends.probe_variants() if b.family == 'p2p'))")
[ -n "$p2p" ] || ! wants allreduce || { echo "mps-reference: the p2p family offers no variant here" >&2; exit 1; }
plain="$p2p,symm_mem:one_shot,symm_mem:two_shot,flashinfer:trtllm_oneshot,flashinfer:trtllm_twoshot"
shim=()
[ -z "$lib" ] || shim=(--mscclpp-nccl-lib "$lib")
start=$(date +%s)
log() { echo "# mps-reference: $*" | tee -a "$out/commands.txt"; }
status=0

sweep() {   # sweep DIR ARGS...: one run dir under DIR; its exit status joins the script's
  local dir=$1
  shift
  mkdir -p "$dir"
  log "python3 -m commbench sweep $* --out $dir  ($(( $(date +%s) - start )) s so far)"
  "$py" -m commbench sweep "$@" "${shim[@]}" --out "$dir" 2>&1 | tee "$dir/sweep.txt"
  local rc=${PIPESTATUS[0]}
  [ "$rc" -eq 0 ] || { log "exit status $rc (3: a backend hung or crashed; its rows say which)"; status=$rc; }
}

unfused_from="p2p:auto,flashinfer:trtllm_oneshot,flashinfer:trtllm_twoshot"
fused_ours="p2p:fused,p2p:fused_oneshot,p2p:fused_twoshot"
# A row here takes well under a second: a hung one (FlashInfer's one-shot at 8 ranks) costs 30 s,
# not the default 120, before the driver resumes without it.
common=(--share-gpus --mps --mode graph --dtype bf16 --iters "$iters" --timeout 30)
for n in ${ranks//,/ }; do
  world=(--nproc "$n" "${common[@]}")
  ! wants allreduce || sweep "$out/world$n/allreduce" "${world[@]}" -b 4K -e 8M -f 2 --backends "$plain"
  if wants fused; then
    for hidden in 7168 6144; do
      sweep "$out/world$n/fused-h$hidden" "${world[@]}" --tokens 1,2,4,8,16,32,64,128,256 \
        --hidden "$hidden" --backends "$unfused_from,$fused_ours,flashinfer:fused_oneshot,flashinfer:fused_twoshot,unfused:best"
    done
  fi
  if wants pcie; then
    pcie_sizes=(-b 8K -e 8M -f 4)
    # Tuning at 2 ranks takes under a minute; a tune that hangs costs 300 s, not the default 900.
    sweep "$out/world$n/pcie" "${world[@]}" "${pcie_sizes[@]}" --backends flashinfer:pcie_ipc,p2p:auto \
      --setup-timeout 300
    sweep "$out/world$n/pcie-seed" "${world[@]}" "${pcie_sizes[@]}" --backends flashinfer:pcie_ipc \
      --flashinfer-pcie-tune seed
  fi
  ! wants nopdl || sweep "$out/world$n/nopdl" "${world[@]}" -b 4K -e 8M -f 2 \
    --backends flashinfer:trtllm_oneshot,p2p:auto --flashinfer-pdl off --p2p-pdl off
  # The engines' kernels build on first use (SGLang's JIT, FlashInfer's port of vLLM's kernel).
  ! wants engines || sweep "$out/world$n/engines" "${world[@]}" -b 4K -e 8M -f 2 --setup-timeout 120 \
    --backends "$engines"
done
if wants mscclpp; then
  for n in ${ranks//,/ }; do
    sweep "$out/world$n/mscclpp" --nproc "$n" "${common[@]}" -b 4K -e 8M -f 4 --backends mscclpp,p2p:auto
  done
fi

runs=()
for parent in "$out"/world*/*/; do
  run=$(ls -td "$parent"*/ 2>/dev/null | head -n 1)   # the newest run under each sweep's --out
  [ -n "$run" ] && [ -f "$run/run.json" ] || continue
  runs+=("${run%/}")
  log "commbench report $run"
  "$py" -m commbench report "$run" >"$parent/report.txt" 2>&1 || log "report of $run failed: $(tail -n 1 "$parent/report.txt")"
done
if [ ${#runs[@]} -gt 0 ]; then
  log "commbench table (${#runs[@]} runs) --out $out/README-table.md"
  "$py" -m commbench table "${runs[@]}" --out "$out/README-table.md" || status=1
fi
if wants fused; then
  fused_runs=()
  for parent in "$out"/world*/fused-h*/; do
    run=$(ls -td "$parent"*/ 2>/dev/null | head -n 1)
    [ -n "$run" ] && [ -f "$run/run.json" ] && fused_runs+=("${run%/}")
  done
  if [ ${#fused_runs[@]} -gt 0 ]; then
    log "scripts/fused-ratios.py (${#fused_runs[@]} runs) > $out/fused-ratios.md"
    "$py" scripts/fused-ratios.py "${fused_runs[@]}" >"$out/fused-ratios.md" || status=1
  fi
fi
if wants engines; then
  engine_runs=()
  for parent in "$out"/world*/engines/; do
    run=$(ls -td "$parent"*/ 2>/dev/null | head -n 1)
    [ -n "$run" ] && [ -f "$run/run.json" ] && engine_runs+=("${run%/}")
  done
  if [ ${#engine_runs[@]} -gt 0 ]; then
    log "scripts/engine-kernel-ratios.py (${#engine_runs[@]} runs) > $out/engine-ratios.md"
    "$py" scripts/engine-kernel-ratios.py "${engine_runs[@]}" >"$out/engine-ratios.md" || status=1
  fi
fi
log "wall time $(( $(date +%s) - start )) s, world sizes $ranks, parts $parts, --iters $iters"
exit "$status"
