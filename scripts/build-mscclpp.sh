#!/usr/bin/env bash
# Builds a microsoft/mscclpp checkout into (a) a Python wheel and (b) the NCCL shim
# libmscclpp_nccl.so, for commbench's `mscclpp` and `mscclpp:shim` backends.
#
#   scripts/build-mscclpp.sh SRC_DIR [OUT_DIR]        (OUT_DIR defaults to ./build/mscclpp)
#
# Offline when the dependencies that MSCCL++'s CMake would clone are given (docs/mscclpp.md):
#   MSCCLPP_JSON_DIR      nlohmann/json checkout        -> -DFETCHCONTENT_SOURCE_DIR_JSON
#   MSCCLPP_DLPACK_DIR    dmlc/dlpack checkout          -> -DFETCHCONTENT_SOURCE_DIR_DLPACK
#   MSCCLPP_NANOBIND_DIR  nanobind's CMake dir          -> -Dnanobind_DIR (default: python3 -m nanobind --cmake_dir)
#   MSCCLPP_NANOBIND_SRC  or a nanobind source checkout -> -DFETCHCONTENT_SOURCE_DIR_NANOBIND
#   MSCCLPP_WHEELS_DIR    wheels for missing build-time Python packages (setuptools-scm), unpacked
#                         into OUT_DIR/build/pydeps (your environment is not changed), and for
#                         MSCCLPP_INSTALL=1 the runtime ones (blake3)
#   LIBNUMA_ROOT          an unpacked libnuma-dev .deb (dpkg -x libnuma-dev_*.deb DIR) when numa.h is missing
#   LIBIBVERBS_ROOT       an unpacked libibverbs-dev .deb, for checkouts that include infiniband/verbs.h
#                         even with MSCCLPP_USE_IB=OFF (v0.9.0 and older; fixed upstream in c3ad7eff)
# Other settings: MSCCLPP_GPU_ARCHS (90), MSCCLPP_BUILD_TYPE (Release), MSCCLPP_USE_IB (OFF),
# MSCCLPP_STEPS (shim,wheel), MSCCLPP_JOBS (nproc), MSCCLPP_OFFLINE (auto|1|0),
# MSCCLPP_CMAKE_ARGS (extra CMake arguments for both builds), MSCCLPP_INSTALL (0|1),
# MSCCLPP_VERBOSE (0|1), PYTHON (python3), CUDACXX or CUDA_HOME (to find nvcc), MSCCLPP_CXX (the C++
# compiler; CXX, else c++, else one on PATH: it must link the shared libstdc++, docs/mscclpp.md).
# Exit status: 0 built, 1 a step failed (its log is named), 2 bad usage or a missing prerequisite.
set -euo pipefail

usage() { echo "usage: $0 SRC_DIR [OUT_DIR]   (a microsoft/mscclpp checkout; docs/mscclpp.md)" >&2; exit 2; }
[ $# -ge 1 ] && [ $# -le 2 ] || usage
case "$1" in -h|--help) usage ;; esac

say() { printf '%s\n' "$*"; }
now() { date +%s; }
abspath() { (cd "$1" && pwd -P); }

[ -d "$1" ] || { echo "build-mscclpp: SRC_DIR $1: no such directory" >&2; exit 2; }
SRC=$(abspath "$1")
OUT_ARG=${2:-build/mscclpp}
mkdir -p "$OUT_ARG" || { echo "build-mscclpp: cannot create OUT_DIR $OUT_ARG" >&2; exit 2; }
OUT=$(abspath "$OUT_ARG")

PY=${PYTHON:-python3}
ARCHS=${MSCCLPP_GPU_ARCHS:-90}
BUILD_TYPE=${MSCCLPP_BUILD_TYPE:-Release}
USE_IB=${MSCCLPP_USE_IB:-OFF}
STEPS=${MSCCLPP_STEPS:-shim,wheel}
JOBS=${MSCCLPP_JOBS:-$(nproc 2>/dev/null || echo 4)}
OFFLINE=${MSCCLPP_OFFLINE:-auto}
VERBOSE=${MSCCLPP_VERBOSE:-0}
INSTALL=${MSCCLPP_INSTALL:-0}
read -r -a EXTRA_ARGS <<<"${MSCCLPP_CMAKE_ARGS:-}"

want() { case ",$STEPS," in *",$1,"*) return 0 ;; *) return 1 ;; esac; }
for s in ${STEPS//,/ }; do
  case "$s" in shim|wheel) ;; *) echo "build-mscclpp: MSCCLPP_STEPS: unknown step '$s' (shim, wheel)" >&2; exit 2 ;; esac
done
case "$OFFLINE" in auto|0|1) ;; *) echo "build-mscclpp: MSCCLPP_OFFLINE must be auto, 0 or 1" >&2; exit 2 ;; esac
if [ "$INSTALL" = 1 ] && ! want wheel; then
  echo "build-mscclpp: MSCCLPP_INSTALL=1 needs the wheel step (MSCCLPP_STEPS)" >&2; exit 2
fi

T0=$(now)
say "== build-mscclpp: $SRC -> $OUT (steps: $STEPS; SM: $ARCHS; $BUILD_TYPE; IB: $USE_IB; $JOBS jobs)"

# ---------------------------------------------------------------- prerequisites
say "== [1] prerequisites"
missing=()
notes=()
miss() { missing+=("$*"); }

# The checkout itself.
for f in CMakeLists.txt pyproject.toml VERSION src/ext/nccl/CMakeLists.txt; do
  [ -f "$SRC/$f" ] || miss "source: $SRC/$f not found (not a microsoft/mscclpp checkout?)"
done
SHIM_TARGET=mscclpp_nccl
if [ -f "$SRC/src/ext/nccl/CMakeLists.txt" ] && ! grep -q "add_library(${SHIM_TARGET}[ )]" "$SRC/src/ext/nccl/CMakeLists.txt"; then
  miss "source: src/ext/nccl/CMakeLists.txt defines no '$SHIM_TARGET' library (this checkout names its NCCL shim otherwise)"
fi
VERSION=$(head -n1 "$SRC/VERSION" 2>/dev/null | tr -d '[:space:]' || true)

# CUDA compiler.
NVCC=${CUDACXX:-}
[ -n "$NVCC" ] || NVCC=$(command -v nvcc 2>/dev/null || true)
[ -n "$NVCC" ] || { [ -x "${CUDA_HOME:-/usr/local/cuda}/bin/nvcc" ] && NVCC=${CUDA_HOME:-/usr/local/cuda}/bin/nvcc; } || true
if [ -z "$NVCC" ] || ! [ -x "$NVCC" ]; then
  miss "nvcc: not found (PATH, \$CUDACXX, \$CUDA_HOME/bin or /usr/local/cuda/bin)"
else
  NVCC_VERSION=$("$NVCC" --version 2>/dev/null | sed -n 's/.*release \([0-9.]*\).*/\1/p' | head -n1)
  say "   nvcc $NVCC_VERSION ($NVCC)"
fi

# The C++ compiler must link the shared libstdc++. A library carrying a copy of its own (a
# compiler set up to link it statically) breaks C++ streams in a process that also has the
# shared one, as torch and CuPy do: MSCCL++'s TCP bootstrap then dies with SIGSEGV reading a
# number from /proc (docs/mscclpp.md). CMake and nvcc take CXX and CUDAHOSTCXX; both get the
# compiler chosen here (MSCCLPP_CXX, else CXX, else c++), or another one on PATH that passes.
needs_libstdcxx() { LC_ALL=C ldd "$1" 2>/dev/null | grep -q 'libstdc++'; }   # FILE: a shared library
links_shared_cxx() {  # COMPILER: does a shared library it links need libstdc++.so?
  local dir ok=1
  dir=$(mktemp -d)
  printf '#include <sstream>\nint parse() { std::istringstream s("60"); int i = 0; s >> i; return i; }\n' >"$dir/t.cc"
  if "$1" -shared -fPIC -o "$dir/t.so" "$dir/t.cc" >/dev/null 2>&1 && needs_libstdcxx "$dir/t.so"; then
    ok=0
  fi
  rm -rf "$dir"
  return $ok
}
CXX_ASKED=${MSCCLPP_CXX:-${CXX:-$(command -v c++ 2>/dev/null || command -v g++ 2>/dev/null || true)}}
CXX_USED=""
if [ -z "$CXX_ASKED" ] || ! command -v "$CXX_ASKED" >/dev/null 2>&1; then
  miss "C++ compiler: ${CXX_ASKED:-none} not found (set CXX or MSCCLPP_CXX)"
elif links_shared_cxx "$CXX_ASKED"; then
  CXX_USED=$CXX_ASKED
elif [ -z "${MSCCLPP_CXX:-}" ]; then
  for c in g++ c++ /usr/bin/g++ /usr/bin/c++; do
    alt=$(command -v "$c" 2>/dev/null || true)
    if [ -n "$alt" ] && [ "$(realpath "$alt")" != "$(realpath "$(command -v "$CXX_ASKED")")" ] && links_shared_cxx "$alt"; then
      CXX_USED=$alt
      notes+=("C++ compiler: $CXX_ASKED links libstdc++ statically; building with $alt, which links the shared one (MSCCLPP_CXX chooses)")
      break
    fi
  done
fi
if [ -n "$CXX_ASKED" ] && [ -z "$CXX_USED" ] && command -v "$CXX_ASKED" >/dev/null 2>&1; then
  why="C++ compiler: $CXX_ASKED links libstdc++ statically (or cannot link a shared library)"
  if [ -n "${MSCCLPP_CXX:-}" ]; then
    miss "$why: set MSCCLPP_CXX to one that links the shared libstdc++"
  else
    miss "$why, and no other on PATH links the shared one: set MSCCLPP_CXX to one that does"
  fi
fi
if [ -n "$CXX_USED" ]; then
  export CXX=$CXX_USED CUDAHOSTCXX=$CXX_USED
  say "   C++ $("$CXX_USED" --version 2>/dev/null | head -n1) ($CXX_USED, shared libstdc++)"
fi

# CMake >= 3.25 and ninja.
if ! command -v cmake >/dev/null 2>&1; then
  miss "cmake: not found (need >= 3.25)"
else
  CMAKE_VERSION=$(cmake --version | sed -n '1s/[^0-9]*\([0-9][0-9.]*\).*/\1/p')
  if [ "$(printf '%s\n3.25\n' "$CMAKE_VERSION" | sort -V | head -n1)" != 3.25 ]; then
    miss "cmake: version $CMAKE_VERSION is too old (need >= 3.25)"
  else
    say "   cmake $CMAKE_VERSION ($(command -v cmake))"
  fi
fi
if command -v ninja >/dev/null 2>&1; then
  say "   ninja $(ninja --version) ($(command -v ninja))"
else
  miss "ninja: not found on PATH"
fi

# libnuma: numa.h and a shared libnuma (system, or LIBNUMA_ROOT = an unpacked libnuma-dev .deb).
NUMA_ARGS=()
numa_inc="" numa_lib=""
if [ -n "${LIBNUMA_ROOT:-}" ]; then
  for d in "$LIBNUMA_ROOT/usr/include" "$LIBNUMA_ROOT/include"; do
    [ -f "$d/numa.h" ] && { numa_inc=$d; break; }
  done
  [ -n "$numa_inc" ] || miss "libnuma: LIBNUMA_ROOT=$LIBNUMA_ROOT has no usr/include/numa.h"
  for d in "$LIBNUMA_ROOT"/usr/lib/*-linux-gnu "$LIBNUMA_ROOT/usr/lib64" "$LIBNUMA_ROOT/usr/lib" "$LIBNUMA_ROOT/lib"; do
    # -e follows the link: the .deb's libnuma.so points at libnuma1's libnuma.so.1.0.0.
    [ -e "$d/libnuma.so" ] && { numa_lib=$d/libnuma.so; break; }
  done
else
  for d in /usr/include /usr/local/include; do
    [ -f "$d/numa.h" ] && { numa_inc=$d; break; }
  done
  [ -n "$numa_inc" ] || miss "libnuma: numa.h not found in /usr/include (install libnuma-dev, or set LIBNUMA_ROOT to an unpacked libnuma-dev .deb)"
  for d in /usr/lib/x86_64-linux-gnu /usr/lib/aarch64-linux-gnu /usr/lib64 /usr/lib /usr/local/lib; do
    [ -e "$d/libnuma.so" ] && { numa_lib=$d/libnuma.so; break; }
  done
fi
if [ -z "$numa_lib" ]; then
  # No libnuma.so link (no libnuma-dev): link against the runtime's libnuma.so.1 itself.
  numa_lib=$( { ldconfig -p 2>/dev/null || /sbin/ldconfig -p 2>/dev/null || true; } \
             | awk '/libnuma\.so\.1 .*(x86-64|AArch64)/ {print $NF; exit}')
  [ -n "$numa_lib" ] || for f in /usr/lib/x86_64-linux-gnu/libnuma.so.1 /lib/x86_64-linux-gnu/libnuma.so.1 /usr/lib64/libnuma.so.1; do
    [ -e "$f" ] && { numa_lib=$f; break; }
  done
  [ -n "$numa_lib" ] || miss "libnuma: no libnuma.so or libnuma.so.1 found (install libnuma1, or put it under LIBNUMA_ROOT)"
fi
if [ -n "$numa_inc" ] && [ -n "$numa_lib" ]; then
  NUMA_ARGS=(-DNUMA_INCLUDE_DIRS="$numa_inc" -DNUMA_LIBRARIES="$numa_lib")
  say "   libnuma $numa_inc/numa.h, $numa_lib"
fi

# infiniband/verbs.h: needed with MSCCLPP_USE_IB=ON, and with OFF too by checkouts whose
# src/core/ibverbs_wrapper.cc is not guarded by USE_IBVERBS (v0.9.0 and older).
wrapper=$SRC/src/core/ibverbs_wrapper.cc
IBV_ARGS=()
if [ "$USE_IB" = ON ] || { [ -f "$wrapper" ] && ! grep -q 'defined(USE_IBVERBS)' "$wrapper"; }; then
  why="MSCCLPP_USE_IB=ON"
  [ "$USE_IB" = ON ] || why="this checkout's src/core/ibverbs_wrapper.cc includes it even with MSCCLPP_USE_IB=OFF"
  if [ -n "${LIBIBVERBS_ROOT:-}" ]; then
    if [ -f "$LIBIBVERBS_ROOT/usr/include/infiniband/verbs.h" ]; then
      ibv_inc=$(abspath "$LIBIBVERBS_ROOT/usr/include")
      # Also on a re-run: a -D, not CXXFLAGS, which CMake reads at a build folder's first configure.
      IBV_ARGS=("-DCMAKE_CXX_FLAGS=${CXXFLAGS:+$CXXFLAGS }-isystem $ibv_inc")
      say "   infiniband/verbs.h: $ibv_inc (-isystem in CMAKE_CXX_FLAGS; $why)"
    else
      miss "libibverbs: LIBIBVERBS_ROOT=$LIBIBVERBS_ROOT has no usr/include/infiniband/verbs.h"
    fi
  elif [ -f /usr/include/infiniband/verbs.h ]; then
    say "   infiniband/verbs.h: /usr/include ($why)"
  else
    miss "libibverbs: infiniband/verbs.h not found ($why): install libibverbs-dev, set LIBIBVERBS_ROOT to an unpacked libibverbs-dev .deb, or use a checkout with upstream commit c3ad7eff"
  fi
fi

# Dependencies that CMake would otherwise clone from GitHub.
FC_ARGS=() FC_DEFINES=() online=()
dep_dir() {  # NAME ENVVAR CHECKFILE FETCHCONTENT_NAME URL
  local name=$1 var=$2 check=$3 fc=$4 url=$5 dir=${!2:-}
  if [ -n "$dir" ]; then
    if [ -f "$dir/$check" ]; then
      dir=$(abspath "$dir")
      FC_ARGS+=("-DFETCHCONTENT_SOURCE_DIR_$fc=$dir")
      FC_DEFINES+=("FETCHCONTENT_SOURCE_DIR_$fc=$dir")
      say "   $name: $dir"
    else
      miss "$name: $var=$dir has no $check"
    fi
  elif [ "$OFFLINE" = 1 ]; then
    miss "$name: $var not set (MSCCLPP_OFFLINE=1; CMake would clone $url)"
  else
    online+=("$name ($url)")
  fi
}
dep_dir nlohmann/json MSCCLPP_JSON_DIR single_include/nlohmann/json.hpp JSON "github.com/nlohmann/json"
if want wheel; then
  dep_dir dlpack MSCCLPP_DLPACK_DIR include/dlpack/dlpack.h DLPACK "github.com/dmlc/dlpack"
  NB_DEFINES=()
  if [ -n "${MSCCLPP_NANOBIND_SRC:-}" ]; then
    dep_dir nanobind MSCCLPP_NANOBIND_SRC cmake/nanobind-config.cmake NANOBIND "github.com/wjakob/nanobind"
  else
    nb_dir=${MSCCLPP_NANOBIND_DIR:-$("$PY" -m nanobind --cmake_dir 2>/dev/null || true)}
    if [ -n "$nb_dir" ] && [ -f "$nb_dir/nanobind-config.cmake" ]; then
      nb_dir=$(abspath "$nb_dir")
      nb_version=$("$PY" -c 'import nanobind; print(nanobind.__version__)' 2>/dev/null || echo "?")
      NB_DEFINES=("FETCHCONTENT_TRY_FIND_PACKAGE_MODE=ALWAYS" "nanobind_DIR=$nb_dir")
      say "   nanobind $nb_version (CMake dir $nb_dir; MSCCL++ pins its own version, this one is used instead)"
    elif [ -n "${MSCCLPP_NANOBIND_DIR:-}" ]; then
      miss "nanobind: MSCCLPP_NANOBIND_DIR=$MSCCLPP_NANOBIND_DIR has no nanobind-config.cmake"
    elif [ "$OFFLINE" = 1 ]; then
      miss "nanobind: not installed for $PY (python3 -m nanobind --cmake_dir) and neither MSCCLPP_NANOBIND_DIR nor MSCCLPP_NANOBIND_SRC set"
    else
      online+=("nanobind (github.com/wjakob/nanobind)")
    fi
  fi
fi

# Python side of the wheel: interpreter, headers, pip, scikit-build-core, setuptools-scm.
PYDEPS=$OUT/build/pydeps
SCM_WHEEL=""      # the setuptools-scm wheel to unpack into PYDEPS; empty: the installed one serves
if want wheel; then
  if ! command -v "$PY" >/dev/null 2>&1; then
    miss "python: $PY not found (set PYTHON)"
  else
    PY_VERSION=$("$PY" -c 'import sys; print("%d.%d.%d" % sys.version_info[:3])')
    py_inc=$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["include"])')
    [ -f "$py_inc/Python.h" ] || miss "python: $py_inc/Python.h not found (the Python development headers, e.g. python3-dev)"
    "$PY" -m pip --version >/dev/null 2>&1 || miss "python: pip not available for $PY"
    "$PY" -c 'import scikit_build_core' 2>/dev/null || miss "python: scikit-build-core not installed for $PY (pyproject's build backend)"
    # A checkout whose python/mscclpp/__init__.py imports __commit_id__ (0.9.0 does) needs
    # setuptools-scm 9 or newer: 8.x writes no __commit_id__ into _version.py, and the wheel
    # builds, then fails at `import mscclpp` (seen on the H200, 2026-12-02).
    scm_min=0
    grep -q '__commit_id__' "$SRC/python/mscclpp/__init__.py" 2>/dev/null && scm_min=9
    scm_ok() { [ -n "$1" ] && [ "${1%%.*}" -ge "$scm_min" ] 2>/dev/null; }
    scm_have=$("$PY" -c 'from importlib.metadata import version; print(version("setuptools-scm"))' 2>/dev/null || true)
    scm_whl=$(ls "${MSCCLPP_WHEELS_DIR:-/nonexistent}"/setuptools_scm-*.whl 2>/dev/null | sort -V | tail -n1 || true)
    scm_whl_version=$([ -z "$scm_whl" ] || basename "$scm_whl" | cut -d- -f2)
    if scm_ok "$scm_have"; then
      :
    elif scm_ok "$scm_whl_version"; then
      SCM_WHEEL=$scm_whl
      notes+=("setuptools-scm: from $SCM_WHEEL into $PYDEPS")
    elif [ -n "$scm_have$scm_whl" ]; then
      miss "python: setuptools-scm ${scm_have:+$scm_have (installed for $PY)}${scm_have:+${scm_whl:+ and }}${scm_whl:+$scm_whl_version ($scm_whl)}: this checkout's python/mscclpp/__init__.py imports __commit_id__, which setuptools-scm writes into _version.py only from version 9 on (put a newer setuptools_scm-*.whl in MSCCLPP_WHEELS_DIR)"
    else
      miss "python: setuptools-scm not installed for $PY and no setuptools_scm-*.whl in MSCCLPP_WHEELS_DIR (${MSCCLPP_WHEELS_DIR:-unset})"
    fi
    say "   python $PY_VERSION ($(command -v "$PY"))"
  fi
fi

if [ ${#missing[@]} -gt 0 ]; then
  for m in "${missing[@]}"; do echo "missing: $m" >&2; done
  exit 2
fi
for n in ${notes[@]+"${notes[@]}"}; do say "   note: $n"; done

# Offline: every dependency given -> CMake may not touch the network.
if [ ${#online[@]} -eq 0 ] && [ "$OFFLINE" != 0 ]; then
  FC_ARGS+=(-DFETCHCONTENT_FULLY_DISCONNECTED=ON)
  FC_DEFINES+=("FETCHCONTENT_FULLY_DISCONNECTED=ON")
  say "   offline: every dependency is local (FETCHCONTENT_FULLY_DISCONNECTED=ON)"
else
  for o in ${online[@]+"${online[@]}"}; do say "   note: not given, CMake will download $o"; done
fi

# No git metadata of its own (git archive, a tarball, a folder inside another repository):
# setuptools-scm gets the version from VERSION, and git is not asked about the parent repository.
if [ "$(git -C "$SRC" rev-parse --show-toplevel 2>/dev/null || true)" != "$SRC" ]; then
  GIT_CEILING_DIRECTORIES=$(dirname "$SRC")
  export GIT_CEILING_DIRECTORIES
  if [ -z "${SETUPTOOLS_SCM_PRETEND_VERSION:-}" ]; then
    export SETUPTOOLS_SCM_PRETEND_VERSION=$VERSION
  fi
  say "   no git metadata: SETUPTOOLS_SCM_PRETEND_VERSION=$SETUPTOOLS_SCM_PRETEND_VERSION"
fi
say "   prerequisites: $(( $(now) - T0 )) s"

# ---------------------------------------------------------------- steps
LOGS=$OUT/logs
mkdir -p "$LOGS"
COMMON=(-G Ninja -DCMAKE_BUILD_TYPE="$BUILD_TYPE" -DCMAKE_CUDA_COMPILER="$NVCC"
        -DCMAKE_CXX_COMPILER="$CXX_USED" -DCMAKE_CUDA_HOST_COMPILER="$CXX_USED"
        -DMSCCLPP_USE_CUDA=ON -DMSCCLPP_BYPASS_GPU_CHECK=ON -DMSCCLPP_USE_IB="$USE_IB"
        -DMSCCLPP_GPU_ARCHS="$ARCHS" -DMSCCLPP_BUILD_TESTS=OFF)

run_logged() {  # LOG CMD...: output to LOG (and the terminal with MSCCLPP_VERBOSE=1)
  local log=$1; shift
  printf '$' >"$log"; printf ' %q' "$@" >>"$log"; printf '\n' >>"$log"
  if [ "$VERBOSE" = 1 ]; then
    "$@" 2>&1 | tee -a "$log"
  else
    "$@" >>"$log" 2>&1
  fi
}
step() {  # NUMBER TITLE LOG CMD...
  local n=$1 title=$2 log=$3 t rc=0; shift 3
  say "== [$n] $title"
  t=$(now)
  run_logged "$log" "$@" || rc=$?
  if [ $rc -ne 0 ]; then
    say "   FAILED after $(( $(now) - t )) s (exit $rc); full log: $log"
    say "   first errors:"
    grep -m 12 -E 'FAILED:|error:|Error|fatal|missing|No such' "$log" | cut -c1-400 | sed 's/^/   | /' || true
    say "   last lines:"
    tail -n 12 "$log" | cut -c1-400 | sed 's/^/   | /'
    exit 1
  fi
  say "   done in $(( $(now) - t )) s (log: $log)"
}

shared_runtime_or_fail() {  # BUILD_DIR: the libmscclpp.so built there must need libstdc++.so
  local lib
  lib=$(find "$1" -name 'libmscclpp.so*' -type f -print -quit)
  [ -n "$lib" ] || { say "   no libmscclpp.so under $1"; exit 1; }
  if ! needs_libstdcxx "$lib"; then
    say "   FAILED: $lib carries its own C++ runtime (it does not link libstdc++.so.6): it would crash"
    say "   in C++ streams beside torch or CuPy. Build with a compiler that links the shared one (MSCCLPP_CXX)."
    exit 1
  fi
}
SHIM_LIB="" WHEEL=""
n=2
if want shim; then
  B=$OUT/build/shim
  SHIM_FC=()   # dlpack is for the Python bindings only
  for a in ${FC_ARGS[@]+"${FC_ARGS[@]}"}; do
    case "$a" in *_DLPACK=*) ;; *) SHIM_FC+=("$a") ;; esac
  done
  step $n "shim: configure (plain CMake, no Python bindings)" "$LOGS/shim-configure.log" \
    cmake -S "$SRC" -B "$B" "${COMMON[@]}" -DMSCCLPP_BUILD_PYTHON_BINDINGS=OFF \
      ${SHIM_FC[@]+"${SHIM_FC[@]}"} ${NUMA_ARGS[@]+"${NUMA_ARGS[@]}"} \
      ${IBV_ARGS[@]+"${IBV_ARGS[@]}"} ${EXTRA_ARGS[@]+"${EXTRA_ARGS[@]}"}
  n=$((n + 1))
  step $n "shim: build target $SHIM_TARGET" "$LOGS/shim-build.log" \
    cmake --build "$B" --target "$SHIM_TARGET" --parallel "$JOBS"
  n=$((n + 1))
  SHIM_LIB=$(ls "$B"/lib/lib${SHIM_TARGET}.so 2>/dev/null || find "$B" -name "lib${SHIM_TARGET}.so" -print -quit)
  [ -n "$SHIM_LIB" ] || { say "   no lib${SHIM_TARGET}.so under $B"; exit 1; }
  shared_runtime_or_fail "$B"
  unresolved=$(ldd "$SHIM_LIB" 2>/dev/null | awk '/not found/ {print $1}' | tr '\n' ' ' || true)
  [ -z "$unresolved" ] || say "   note: $SHIM_LIB: unresolved here: $unresolved(libcuda.so.1 comes with the driver)"
fi

if want wheel; then
  if [ -n "$SCM_WHEEL" ]; then
    # --upgrade: a re-run with another wheel replaces the copy an earlier run left in PYDEPS.
    step $n "setuptools-scm into $PYDEPS (build-time only)" "$LOGS/pydeps.log" \
      "$PY" -m pip install --no-index --no-deps --upgrade --disable-pip-version-check --target "$PYDEPS" "$SCM_WHEEL"
    n=$((n + 1))
    export PYTHONPATH=$PYDEPS${PYTHONPATH:+:$PYTHONPATH}
  fi
  # scikit-build-core runs CMake itself; the same settings go in as cmake.define, extra
  # arguments through CMAKE_ARGS, which scikit-build-core reads.
  CS=(-C "build-dir=$OUT/build/wheel" -C "cmake.build-type=$BUILD_TYPE")
  for d in "CMAKE_CUDA_COMPILER=$NVCC" "CMAKE_CXX_COMPILER=$CXX_USED" "CMAKE_CUDA_HOST_COMPILER=$CXX_USED" MSCCLPP_USE_CUDA=ON MSCCLPP_BYPASS_GPU_CHECK=ON \
           "MSCCLPP_USE_IB=$USE_IB" "MSCCLPP_GPU_ARCHS=$ARCHS" MSCCLPP_BUILD_TESTS=OFF \
           MSCCLPP_BUILD_PYTHON_BINDINGS=ON ${FC_DEFINES[@]+"${FC_DEFINES[@]}"} ${NB_DEFINES[@]+"${NB_DEFINES[@]}"} \
           ${NUMA_ARGS[@]+"${NUMA_ARGS[@]#-D}"} ${IBV_ARGS[@]+"${IBV_ARGS[@]#-D}"}; do
    CS+=(-C "cmake.define.$d")
  done
  mkdir -p "$OUT/dist"
  rm -f "$OUT"/dist/mscclpp-*.whl
  export CMAKE_ARGS="${MSCCLPP_CMAKE_ARGS:-}" CMAKE_BUILD_PARALLEL_LEVEL=$JOBS
  step $n "wheel: pip wheel (scikit-build-core, Python bindings; also builds the libraries it ships)" "$LOGS/wheel.log" \
    "$PY" -m pip wheel --no-deps --no-build-isolation --no-index --disable-pip-version-check -v \
      -w "$OUT/dist" "${CS[@]}" "$SRC"
  n=$((n + 1))
  WHEEL=$(ls "$OUT"/dist/mscclpp-*.whl 2>/dev/null | tail -n1 || true)
  [ -n "$WHEEL" ] || { say "   no mscclpp-*.whl in $OUT/dist"; exit 1; }
  shared_runtime_or_fail "$OUT/build/wheel"
  libs=$("$PY" -c 'import sys, zipfile; n = zipfile.ZipFile(sys.argv[1]).namelist()
print(", ".join(sorted(x for x in n if x.endswith(".so") or ".so." in x)) or "no shared libraries")' "$WHEEL")
  say "   wheel holds: $libs"
fi

if [ "$INSTALL" = 1 ]; then
  step $n "install the wheel into $PY's environment" "$LOGS/install.log" \
    "$PY" -m pip install --no-index --no-deps --force-reinstall --disable-pip-version-check "$WHEEL"
  n=$((n + 1))
  if ! "$PY" -c 'import blake3' 2>/dev/null; then
    if [ -n "${MSCCLPP_WHEELS_DIR:-}" ] && ls "$MSCCLPP_WHEELS_DIR"/blake3-*.whl >/dev/null 2>&1; then
      step $n "install blake3 (imported by mscclpp) from $MSCCLPP_WHEELS_DIR" "$LOGS/install-blake3.log" \
        "$PY" -m pip install --no-index --no-deps --disable-pip-version-check --find-links "$MSCCLPP_WHEELS_DIR" blake3
      n=$((n + 1))
    else
      say "   note: blake3 is not installed and MSCCLPP_WHEELS_DIR has no blake3 wheel: 'import mscclpp' will fail"
    fi
  fi
  # Import only: nothing that creates a multicast object runs (MSCCLPP_FORCE_DISABLE_NVLS=1 anyway).
  # mscclpp's __init__ asks CuPy for the device's architecture: this needs a GPU and its driver.
  say "== [$n] smoke: import mscclpp (outside the source tree; needs the GPU driver)"
  if run_logged "$LOGS/smoke.log" env -C / MSCCLPP_FORCE_DISABLE_NVLS=1 "$PY" -c \
       'import mscclpp, mscclpp.ext; print("mscclpp", mscclpp.__version__, "from", mscclpp.__file__)'; then
    sed -n '2,$p' "$LOGS/smoke.log" | sed 's/^/   /'
  else
    say "   FAILED: import mscclpp (log: $LOGS/smoke.log):"
    tail -n 8 "$LOGS/smoke.log" | cut -c1-300 | sed 's/^/   | /'
    ext=$("$PY" -c 'import glob, os, sysconfig; print(" ".join(glob.glob(os.path.join(sysconfig.get_paths()["platlib"], "mscclpp", "_mscclpp*.so"))))' 2>/dev/null || true)
    for f in $ext; do
      ldd "$f" 2>/dev/null | awk '/not found/ {print "   | unresolved: " $1}' || true
    done
    exit 1
  fi
fi

say "== done in $(( $(now) - T0 )) s"
[ -z "$WHEEL" ] || say "   wheel: $WHEEL"
[ -z "$WHEEL" ] || say "          install: $PY -m pip install --no-index --no-deps $WHEEL  (+ blake3 at run time)"
[ -z "$SHIM_LIB" ] || say "   shim:  $SHIM_LIB"
[ -z "$SHIM_LIB" ] || say "          use:     python -m commbench sweep --nproc N --backends mscclpp:shim --mscclpp-nccl-lib $SHIM_LIB"
say "   logs:  $LOGS"
