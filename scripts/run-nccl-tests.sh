#!/usr/bin/env bash
# nccl-tests' all_reduce_perf per setting, imported into one commbench results dir (docs/nccl-tests.md).
#
#   scripts/run-nccl-tests.sh --bin PATH/all_reduce_perf --out DIR [-b 4K] [-e 256M] [-f 2]
#       [--dtype bf16[,fp16,fp32]] [--mode graph,eager] [--nproc N] [--launch mpi|threads]
#       [--env NAME=V1,V2 ...] [--iters 20] [--graph-launches 100] [--warmup 1] [--check 1]
#       [--mpirun "mpirun ..."] [--timeout 900] [--allow-multicast] [--python python3] [-- more all_reduce_perf flags]
#
# Sizes and --env work as in `commbench sweep`: one all_reduce_perf run per combination of the
# --env values (NCCL reads such variables once per process), per dtype and per mode (graph: -G,
# eager: none). Every run is `-g 1 -a 3 -c 1` (one GPU per rank, the slowest rank's time, one
# checked call), one process per GPU under mpirun (all_reduce_perf built with MPI=1) or one process
# with a thread per GPU (--launch threads). Raw stdout and -J JSON are kept in DIR/nccl-tests-raw/,
# then `python -m commbench import-nccl-tests` appends the rows to DIR, tagged with the setting.
# It never builds anything: build nccl-tests first (docs/nccl-tests.md).
# Without --allow-multicast it runs with NCCL_NVLS_ENABLE=0, as scripts/reference-run.sh does.
# Exit status: 0 all runs imported; 1 some run failed (its complete rows are imported); 2 bad usage.
set -uo pipefail

die() { echo "run-nccl-tests: $*" >&2; exit 2; }

bin="" out="" min=4K max=256M factor=2 dtypes=bf16 modes=graph,eager nproc="" launch=mpi iters=20
graph_launches=100 warmup=1 check=1 mpirun=mpirun timeout_s=900 allow_multicast=0 python=${PYTHON:-python3}
envs=() extra=()
while [ $# -gt 0 ]; do
  case "$1" in
    --bin) bin=${2:-}; shift 2 ;;
    --out) out=${2:-}; shift 2 ;;
    -b|--min-bytes) min=${2:-}; shift 2 ;;
    -e|--max-bytes) max=${2:-}; shift 2 ;;
    -f|--step-factor) factor=${2:-}; shift 2 ;;
    --dtype) dtypes=${2:-}; shift 2 ;;
    --mode) modes=${2:-}; shift 2 ;;
    --nproc) nproc=${2:-}; shift 2 ;;
    --launch) launch=${2:-}; shift 2 ;;
    --env) envs+=("${2:-}"); shift 2 ;;
    --iters) iters=${2:-}; shift 2 ;;
    --graph-launches) graph_launches=${2:-}; shift 2 ;;
    --warmup) warmup=${2:-}; shift 2 ;;
    --check) check=${2:-}; shift 2 ;;
    --mpirun) mpirun=${2:-}; shift 2 ;;
    --timeout) timeout_s=${2:-}; shift 2 ;;
    --allow-multicast) allow_multicast=1; shift ;;
    --python) python=${2:-}; shift 2 ;;
    --) shift; extra=("$@"); break ;;
    -h|--help) sed -n '2,17p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) die "unknown argument $1 (see --help)" ;;
  esac
done

# ---------------------------------------------------------------- checks, before anything runs
[ -n "$bin" ] || die "--bin PATH/all_reduce_perf is required"
[ -n "$out" ] || die "--out DIR is required"
{ [ -f "$bin" ] && [ -x "$bin" ]; } || die "$bin: no such executable; build nccl-tests first (docs/nccl-tests.md)"
size_re='^[0-9]+[KMGkmg]?$'
[[ $min =~ $size_re && $max =~ $size_re ]] || die "malformed size in -b $min / -e $max: a number with K, M or G"
for n in "$factor" "$iters" "$graph_launches" "$warmup" "$check" "$timeout_s"; do
  [[ $n =~ ^[0-9]+$ ]] || die "malformed number $n"
done
case "$launch" in mpi|threads) ;; *) die "--launch is mpi or threads, not $launch" ;; esac
if [ -z "$nproc" ]; then
  nproc=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU') || true
  [ "${nproc:-0}" -gt 0 ] || die "no GPU found by nvidia-smi -L; pass --nproc N"
fi
[[ $nproc =~ ^[1-9][0-9]*$ ]] || die "malformed --nproc $nproc"
if [ "$launch" = mpi ] && command -v ldd >/dev/null && ! ldd "$bin" 2>/dev/null | grep -q libmpi; then
  die "$bin is not linked with MPI: under mpirun it would run $nproc separate one-GPU jobs; rebuild with MPI=1 or use --launch threads"
fi
"$python" -c "import commbench.analysis.nccl_tests_import" 2>/dev/null || die "$python cannot import commbench (pip install -e . first, or --python)"

declare -A nccl_type=([bf16]=bfloat16 [fp16]=half [fp32]=float)
IFS=, read -ra dtype_list <<<"$dtypes"
IFS=, read -ra mode_list <<<"$modes"
for d in "${dtype_list[@]}"; do [ -n "${nccl_type[$d]:-}" ] || die "unknown dtype $d: choose from bf16, fp16, fp32"; done
for m in "${mode_list[@]}"; do case "$m" in graph|eager) ;; *) die "unknown mode $m: graph or eager" ;; esac; done

# Every combination of the --env values, each as "NAME=V NAME2=W" (values without spaces).
combos=("")
for spec in "${envs[@]}"; do
  name=${spec%%=*} values=${spec#*=}
  [[ $spec == *=* && $name =~ ^[A-Za-z_][A-Za-z0-9_]*$ && -n $values && $values != *" "* ]] \
    || die "malformed --env $spec: expected NAME=V1,V2 (no spaces)"
  if [ "$name" = NCCL_NVLS_ENABLE ] && [ "$allow_multicast" = 0 ] && [[ ,$values, != ,0, ]]; then
    die "--env $spec would let NCCL use NVLink multicast: needs --allow-multicast"
  fi
  IFS=, read -ra vals <<<"$values"
  next=()
  for c in "${combos[@]}"; do for v in "${vals[@]}"; do next+=("${c:+$c }$name=$v"); done; done
  combos=("${next[@]}")
done
if [ "$allow_multicast" = 0 ]; then
  [ "${NCCL_NVLS_ENABLE:-0}" = 0 ] || die "NCCL_NVLS_ENABLE=$NCCL_NVLS_ENABLE is set: pass --allow-multicast to run with it"
  export NCCL_NVLS_ENABLE=0
fi

raw="$out/nccl-tests-raw/$(date +%Y%m%d-%H%M%S)"
mkdir -p "$raw" || die "$raw: cannot create"
log() { echo "# run-nccl-tests: $*" | tee -a "$raw/commands.txt"; }

# ---------------------------------------------------------------- one run per setting, dtype and mode
failed=0
run_one() {  # $1 = setting ("NAME=V ..."), $2 = dtype, $3 = mode
  local setting=$1 dtype=$2 mode=$3 tag cmd=() launcher=() settings=() assign name
  tag="$mode-$dtype${setting:+-${setting// /-}}"
  local flags=(-b "$min" -e "$max" -f "$factor" -g 1 -d "${nccl_type[$dtype]}" -a 3 -c "$check" -n "$iters"
               -w "$warmup" -J "$raw/$tag.json")
  [ "$mode" = graph ] && flags+=(-G "$graph_launches")
  for assign in $setting; do settings+=(--setting "$assign"); done
  if [ "$launch" = mpi ]; then
    read -ra launcher <<<"$mpirun"
    launcher+=(-np "$nproc")
    [ "$(id -u)" = 0 ] && launcher+=(--allow-run-as-root)
    for assign in $setting; do launcher+=(-x "$assign"); done     # OpenMPI: set and export to every rank
    for name in NCCL_NVLS_ENABLE LD_LIBRARY_PATH; do [ -n "${!name+x}" ] && launcher+=(-x "$name"); done
    cmd=("${launcher[@]}" "$bin" "${flags[@]}" "${extra[@]}")
  else
    cmd=("$bin" -t "$nproc" "${flags[@]}" "${extra[@]}")
  fi
  log "${setting:+$setting }${cmd[*]} > $raw/$tag.txt"
  # shellcheck disable=SC2086  # $setting is NAME=V words on purpose
  env $setting timeout "$timeout_s" "${cmd[@]}" >"$raw/$tag.txt" 2>"$raw/$tag.stderr.txt"
  local rc=$?
  local import=("$python" -m commbench import-nccl-tests --out "$out" --expect-world-size "$nproc" "${settings[@]}")
  [ "$rc" = 0 ] || { import+=(--partial); failed=1; log "all_reduce_perf exited with $rc (124: timed out); importing what it finished"; }
  if [ -s "$raw/$tag.json" ]; then
    import+=("$raw/$tag.json" "$raw/$tag.txt")
  else
    import+=(--average 3 "$raw/$tag.txt")
  fi
  log "${import[*]}"
  "${import[@]}" 2>&1 | tee -a "$raw/commands.txt"
  [ "${PIPESTATUS[0]}" = 0 ] || failed=1
}

for setting in "${combos[@]}"; do
  for dtype in "${dtype_list[@]}"; do
    for mode in "${mode_list[@]}"; do run_one "$setting" "$dtype" "$mode"; done
  done
done
log "results in $out (report: $python -m commbench report $out)"
exit "$failed"
