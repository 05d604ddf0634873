#!/usr/bin/env bash
# A fleet on one CPU machine: deploy/slurm/commbench-node.sbatch run as N "nodes", srun replaced
# by tests/fakes/slurm/srun (one process per task, Slurm's task variables set), each node a 2-rank
# gloo sweep of testfaults:slow (tests/plugins), one node SLOW_US microseconds a call slower.
#
#   bash scripts/cpu-fleet.sh OUT [NODES=8] [SLOW_NODE=node-05] [SLOW_US=20000]
#
# OUT/<node>/<job>/<run> as on shared storage; then commbench fleet build OUT --out FLEET.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
out="${1:?usage: bash scripts/cpu-fleet.sh OUT [NODES] [SLOW_NODE] [SLOW_US]}"
nodes="${2:-8}" slow_node="${3:-node-05}" slow_us="${4:-20000}"
python="${PYTHON:-$(command -v python3)}"
mkdir -p "$out"
for ((i = 1; i <= nodes; i++)); do
    node=$(printf 'node-%02d' "$i")
    delay=0; [[ "$node" == "$slow_node" ]] && delay="$slow_us"
    PATH="$ROOT/tests/fakes/slurm:$PATH" PYTHONPATH="$ROOT/tests/plugins${PYTHONPATH:+:$PYTHONPATH}" \
    OMP_NUM_THREADS=1 COMMBENCH_RESULTS="$out" COMMBENCH_PYTHON="$python" SLURMD_NODENAME="$node" \
    SLURM_JOB_ID=4242 GPUS_PER_NODE=2 MASTER_PORT=$((29600 + i)) \
    COMMBENCH_SWEEP_ARGS="--backends testfaults:slow@$delay --sizes 1K,4K -d fp32 -n 10 -w 1 --no-probe" \
        bash "$ROOT/deploy/slurm/commbench-node.sbatch" | tail -1
done
