#!/usr/bin/env bash
# Set up and run commbench from a fresh clone, in one command each:
#
#   bash scripts/quickstart.sh sweep [SWEEP ARGS...]   # the sweep under torchrun (gloo on a CPU-only machine)
#   bash scripts/quickstart.sh test  [PYTEST ARGS...]  # the test suite (CPU; tests/gpu skips without CUDA)
#
# Set-up, done once and skipped on a repeat run:
#   - a virtual environment: the active one ($VIRTUAL_ENV) if there is one, else .venv in the
#     checkout (COMMBENCH_VENV=DIR picks another; PYTHON=python3.X the interpreter that makes it);
#   - torch, only if that environment has none: `pip install $COMMBENCH_TORCH` (default: torch,
#     PyTorch's default wheel, on Linux possibly a CUDA build of several GB). For the CPU-only
#     wheel: COMMBENCH_TORCH="torch --index-url https://download.pytorch.org/whl/cpu";
#   - commbench from this checkout, editable (`pip install -e .`, with the test extra for `test`).
#
# sweep starts one process per GPU (NPROC=N overrides; 8 without a GPU); extra arguments go to
# `commbench sweep`, e.g. `bash scripts/quickstart.sh sweep --sizes 4K,1M --backends nccl`.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
say() { printf 'quickstart: %s\n' "$*" >&2; }
die() { say "$*"; exit 2; }

usage="usage: bash scripts/quickstart.sh sweep|test [ARGS...]"
[[ $# -ge 1 ]] || die "$usage"
what="$1"; shift
case "$what" in
    sweep) extras="" ;;
    test) extras="[test]" ;;
    -h|--help|help) sed -n '2,16p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) die "unknown command '$what'; $usage" ;;
esac

export PIP_DISABLE_PIP_VERSION_CHECK=1

# --- the environment --------------------------------------------------------------------
VENV="${COMMBENCH_VENV:-${VIRTUAL_ENV:-$ROOT/.venv}}"
PY="$VENV/bin/python"
if [[ ! -x "$PY" ]]; then
    base="${PYTHON:-python3}"
    command -v "$base" >/dev/null || die "$base not found: install Python 3.10 or newer (or set PYTHON=...)"
    "$base" -c 'import sys; sys.exit(sys.version_info < (3, 10))' \
        || die "$base is Python $("$base" -c 'import platform; print(platform.python_version())'); commbench needs 3.10 or newer (set PYTHON=python3.X)"
    say "creating the virtual environment $VENV ($("$base" --version 2>&1))"
    "$base" -m venv "$VENV" \
        || die "'$base -m venv' failed: install your Python's venv module (Debian/Ubuntu: apt install python3-venv)"
fi

# --- torch ------------------------------------------------------------------------------
has_nvidia_gpu() {
    command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L 2>/dev/null | grep -q '^GPU '
}
gpu_count() {
    if has_nvidia_gpu; then nvidia-smi -L | grep -c '^GPU '; else echo 0; fi
}

if ! "$PY" -c 'import importlib.util, sys; sys.exit(importlib.util.find_spec("torch") is None)'; then
    read -r -a torch_req <<< "${COMMBENCH_TORCH:-torch}"
    if [[ -z "${COMMBENCH_TORCH:-}" ]] && ! has_nvidia_gpu && [[ "$(uname -s)" == Linux ]]; then
        say "no NVIDIA GPU found; installing PyTorch's default wheel, which on Linux can be a CUDA build of several GB. CPU-only wheel instead: COMMBENCH_TORCH=\"torch --index-url https://download.pytorch.org/whl/cpu\" bash scripts/quickstart.sh $what"
    fi
    say "installing ${torch_req[*]} into $VENV"
    "$PY" -m pip install "${torch_req[@]}"
elif has_nvidia_gpu && ! "$PY" -c 'import sys, torch; sys.exit(torch.version.cuda is None)' 2>/dev/null; then
    say "NVIDIA GPU found, but the torch in $VENV is not a CUDA build: the sweep will run on the CPU with gloo (replace it: $PY -m pip install --force-reinstall torch)"
fi

# --- commbench --------------------------------------------------------------------------
# Skipped when this checkout is already installed there with the same pyproject.toml and extras.
stamp="$VENV/.commbench-quickstart"
sha="$("$PY" -c 'import hashlib, sys; print(hashlib.sha256(open(sys.argv[1], "rb").read()).hexdigest())' "$ROOT/pyproject.toml")"
want="$ROOT$extras $sha"
installed_from_here() {
    (cd / && "$PY" -c 'import os, sys, commbench; sys.exit(os.path.dirname(os.path.realpath(commbench.__file__)) != os.path.realpath(sys.argv[1]))' "$ROOT/commbench") 2>/dev/null
}
if ! grep -qxF "$want" "$stamp" 2>/dev/null || ! installed_from_here; then
    say "installing commbench$extras from $ROOT (editable)"
    "$PY" -m pip install -q -e "$ROOT$extras"
    if [[ "$extras" == "[test]" ]]; then
        printf '%s\n' "$ROOT $sha" "$want" > "$stamp"   # the test extra covers sweep too
    else
        printf '%s\n' "$want" > "$stamp"
    fi
fi

# Compiled once here: where PYTHONDONTWRITEBYTECODE is set (many containers and CI images) every
# rank, and each of the hundreds of processes the tests start, would compile commbench's modules
# again (0.2-0.3 s of CPU each). Up-to-date files are skipped, so a repeat costs a fraction of a second.
"$PY" -m compileall -q -j 0 "$ROOT/commbench" "$ROOT/backends" "$ROOT/topology" "$ROOT/tests/plugins" >/dev/null \
    || say "compileall failed: the modules are compiled as each process imports them"

# --- the job ----------------------------------------------------------------------------
case "$what" in
    sweep)
        n="${NPROC:-$(gpu_count)}"
        [[ "$n" -gt 0 ]] || n=8
        say "torchrun --nproc-per-node $n -m commbench sweep $*"
        exec "$PY" -m torch.distributed.run --standalone --nproc-per-node "$n" -m commbench sweep "$@"
        ;;
    test)
        cd "$ROOT"
        say "pytest $*"
        # Plain pytest, as CI runs it: `python -m pytest` would also put the checkout on
        # sys.path and hide an import that only works from there.
        # Two workers, a test file each at a time (--dist loadfile keeps a file's shared launches in
        # one worker): most scenarios wait on child processes, so two cores run two files at
        # once. COMMBENCH_TEST_WORKERS=0 runs in one process; a later -n in the arguments wins.
        exec "$VENV/bin/pytest" -n "${COMMBENCH_TEST_WORKERS:-2}" --dist loadfile "$@"
        ;;
esac
