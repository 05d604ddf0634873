"""MSCCL++ allreduce (optional; not on PyPI: build it from source with scripts/build-mscclpp.sh).

Two ways in (facts from microsoft/mscclpp 0.9.0's Python package and NCCL shim):

- the Python API: ``CommGroup`` bootstrapped over the gloo control group, the default
  allreduce algorithms from ``ext.AlgorithmCollectionBuilder().build_default_algorithms``, one
  ``algorithm.execute`` per call. ``mscclpp:auto`` picks the algorithm per size with the rule
  MSCCL++'s own NCCL shim uses on one node without NVLS (``src/ext/nccl/algorithm_selector.cc``:
  <= 16 KiB allpair_packet, <= 1 MiB packet, else fullmesh); ``mscclpp:algo=NAME`` forces one.
  The algorithm that ran is recorded on every row.
- ``mscclpp:shim``: NCCL's API served by ``libmscclpp_nccl.so``, preloaded into a child
  torchrun (``--mscclpp-nccl-lib PATH``); the shim chooses its algorithm internally. It is not
  SGLang's ``--enable-mscclpp`` (that is the Python API): it prices an engine's NCCL path with the
  shim loaded in place of NCCL, which no engine flag selects (engines.nccl_path, preload).

Every default allreduce algorithm (DEFAULT_ALGORITHMS, the ten that 0.9.0's
``src/ext/collectives/algorithm_collection_builder.cc`` registers) is a variant of its own:
``mscclpp`` alone sweeps auto, each of them and the shim; ``mscclpp:each`` each of them.
NVLS (multicast) algorithms stay off unless multicast is allowed: MSCCLPP_FORCE_DISABLE_NVLS=1
is set before MSCCL++ is imported, and NVLS variants are skipped with the reason.

Before any rank sets up, ``software_reason`` runs MSCCL++'s TCP bootstrap once in a child
process (``bootstrap_reason``): a build whose bootstrap dies (SIGSEGV in ``create_unique_id`` on
the H200 image, docs/mscclpp.md) is then a skip naming the signal and MSCCL++'s last Python
frame, in the sweep and in ``probe``, instead of a crashed rank.
"""

from __future__ import annotations

import argparse
import functools
import importlib
import importlib.util
import os
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from commbench import engines
from commbench.backends.base import (Backend, BackendFactory, MakeOptions, ProcessGroupBackend, parse_variant_options,
                                     raise_unless_all_ranks_ok)
from commbench.backends.nccl.libs import PRELOAD_VAR
from commbench.backends.mscclpp.flags import add_arguments
from commbench.policy import multicast_policy_reason

if TYPE_CHECKING:
    from commbench.runtime.context import RunContext

BOOTSTRAP_DOC = "docs/mscclpp.md, 'SIGSEGV in MSCCL++'s TCP bootstrap'"
BUILD_HINT = "mscclpp not installed: build it from a checkout with scripts/build-mscclpp.sh (docs/mscclpp.md)"
DISABLE_NVLS_ENV = "MSCCLPP_FORCE_DISABLE_NVLS"
SCRATCH_BYTES = 1 << 27          # scratch for the packet algorithms, as SGLang sizes it
# (upper bound in bytes, algorithm) for one node without NVLS, from algorithm_selector.cc.
AUTO_RULE: tuple[tuple[int, str], ...] = (
    (1 << 14, "default_allreduce_allpair_packet"),
    (1 << 20, "default_allreduce_packet"),
)
AUTO_LARGE = "default_allreduce_fullmesh"
# buildDefaultNativeAlgorithms in 0.9.0, registration order; NVLS ones need multicast.
DEFAULT_ALGORITHMS = (
    "default_allreduce_allpair_packet", "default_allreduce_nvls_packet", "default_allreduce_nvls_warp_pipeline",
    "default_allreduce_nvls_block_pipeline", "default_allreduce_packet", "default_allreduce_nvls_zero_copy",
    "default_allreduce_fullmesh", "default_allreduce_rsag", "default_allreduce_rsag_pipeline",
    "default_allreduce_rsag_zero_copy",
)
# Algorithms whose kernel is instantiated for some ranks-per-node counts only: any other count
# throws InvalidUsage at every call (0.9.0 allreduce_rsag_zero_copy.cu; seen at 2 ranks on the
# H200, 2026-12-02). One node, so the ranks per node are the world size.
RANKS_PER_NODE = {"default_allreduce_rsag_zero_copy": (4, 8)}
# Algorithms whose kernel waits at a grid-wide barrier (mscclpp::DeviceSyncer, no timeout) for every
# block of its launch: (from bytes, blocks of 1024 threads) as 0.9.0 launches them by default
# (allreduce_rsag_zero_copy.cu:122-127, the barrier at :107). One block of 1024 threads per SM is
# all a GPU is sure to keep resident (registers decide whether a second fits; Ada and Blackwell
# workstation SMs hold 1,536 threads), so a launch with more blocks than the rank's SMs may wait
# for blocks that never start.
GRID_BARRIER_LAUNCH = {"default_allreduce_rsag_zero_copy": ((0, 64), (1 << 26, 128))}
BOOTSTRAP_TIMEOUT_S = 120

# Kernel names this family's allreduce leaves in a profiler trace, read by `commbench attribute`
# with ast, without importing this module (docs/attribute.md): (regex searched in the demangled
# name, library, regex over this family's run variants that are its floor, note).
# microsoft/mscclpp 0.9 src/ext/collectives (mscclpp::collective::allreduce*, DSL executionKernel)
# and SGLang sgl-kernel csrc/allreduce/mscclpp_allreduce.cuh (sglang::allreduce_1shotLL_*).
TRACE_KERNELS = (
    (r"\bmscclpp::collective::allreduce", "MSCCL++", r"^mscclpp", ""),
    (r"\bmscclpp::executionKernel\b", "MSCCL++ DSL", r"^mscclpp", "an execution plan: may run any collective"),
    (r"\bsglang::allreduce_1shotLL_\dnode\b", "SGLang MSCCL++ allreduce", r"^mscclpp", ""),
)
# One process, one rank: what docs/mscclpp.md's case 6 ran. Prints after each step, so the
# last line printed says how far it got.
BOOTSTRAP_CHECK = """
import faulthandler, sys
faulthandler.enable()
import mscclpp
print("imported", flush=True)
from mscclpp._mscclpp import CppTcpBootstrap
bootstrap = CppTcpBootstrap.create(0, 1)
print("created", flush=True)
bootstrap.create_unique_id()
print("create_unique_id ok", flush=True)
"""
MSCCLPP_DTYPES = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}


def auto_algorithm(message_bytes: int) -> str:
    for limit, name in AUTO_RULE:
        if message_bytes <= limit:
            return name
    return AUTO_LARGE


def grid_barrier_reason(algorithm: str, message_bytes: int, sms: int) -> str | None:
    """Why this algorithm must not run a message of this size on a rank that may count on `sms`
    SMs (runtime.context.own_sms), or None."""
    launch = GRID_BARRIER_LAUNCH.get(algorithm)
    if not launch:
        return None
    blocks = max(count for start_bytes, count in launch if message_bytes >= start_bytes)
    if blocks <= sms:
        return None
    return (f"{algorithm} waits at a grid-wide barrier for all {blocks} blocks of 1024 threads of its launch "
            f"(MSCCL++ 0.9.0), and this rank may count on {sms} SMs: with fewer SMs than blocks it can hang")


def import_mscclpp(allow_multicast: bool) -> Any:
    if not allow_multicast:
        # Read when MSCCL++ initialises: set before the first import.
        os.environ[DISABLE_NVLS_ENV] = "1"
    return importlib.import_module("mscclpp")


def import_reason() -> str | None:
    """Why the mscclpp package cannot be used here, or None (imported with NVLS off)."""
    if importlib.util.find_spec("mscclpp") is None:
        return BUILD_HINT
    try:
        import_mscclpp(allow_multicast=False)
    except Exception as exc:  # a missing dependency or a broken build: say which
        return f"mscclpp is installed but does not import: {type(exc).__name__}: {exc}"
    return bootstrap_reason()


def last_python_frame(stderr: str) -> str | None:
    """The innermost frame of a faulthandler dump ('File "...", line N in f'), shortened."""
    frames = [line.strip() for line in stderr.splitlines() if line.strip().startswith("File ")]
    if not frames:
        return None
    # faulthandler lists the innermost frame first
    return frames[0].replace("File ", "", 1)


def _ldd(library: Path | str) -> str | None:
    """ldd's list of what the loader maps for a shared library; None when ldd cannot say."""
    try:
        done = subprocess.run(["ldd", str(library)], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout if done.returncode == 0 else None


def links_shared_libstdcxx(library: Path) -> bool | None:
    """Whether a shared library needs libstdc++.so; None when ldd cannot say."""
    listing = _ldd(library)
    return None if listing is None else "libstdc++" in listing


def unresolved_libraries(library: str) -> list[str]:
    """What the loader would not find for a shared library (ldd's "not found"); [] when unknown."""
    return [line.split()[0] for line in (_ldd(library) or "").splitlines() if "not found" in line]


def static_runtime_libraries() -> list[str]:
    """The installed package's libmscclpp*.so that carry a C++ runtime of their own."""
    spec = importlib.util.find_spec("mscclpp")
    folders = list(spec.submodule_search_locations or []) if spec else []
    found = sorted({lib for folder in folders for lib in Path(folder, "lib").glob("libmscclpp*.so")})
    return [lib.name for lib in found if links_shared_libstdcxx(lib) is False]


def describe_bootstrap_failure(returncode: int, stdout: str, stderr: str,
                               static_runtime: list[str] | None = None) -> str | None:
    """The child's outcome as a reason, or None when the bootstrap worked. static_runtime: the
    package's libraries that link libstdc++ statically (the known cause of a SIGSEGV here)."""
    reached = (stdout.strip().splitlines() or ["nothing"])[-1]
    if returncode == 0 and reached == "create_unique_id ok":
        return None
    if returncode < 0:
        how = f"died with {signal.Signals(-returncode).name}"
    else:
        lines = [line for line in stderr.strip().splitlines() if line.strip()]
        how = f"failed: {lines[-1].strip() if lines else f'exit status {returncode}'}"
    frame = last_python_frame(stderr)
    where = f" at {frame}" if frame else ""
    head = (f"MSCCL++'s TCP bootstrap {how}{where} after '{reached}' "
            "(one process: CppTcpBootstrap.create(0, 1).create_unique_id()); ")
    if static_runtime:
        return head + (f"{', '.join(static_runtime)} link libstdc++ statically, and a second C++ runtime beside "
                       "torch's breaks C++ streams: rebuild with scripts/build-mscclpp.sh, or preload the shared "
                       f"libstdc++ (LD_PRELOAD) ({BOOTSTRAP_DOC})")
    return head + f"needs an MSCCL++ build whose bootstrap runs on this machine ({BOOTSTRAP_DOC})"


@functools.lru_cache(maxsize=None)
def bootstrap_reason() -> str | None:
    """Run MSCCL++'s bootstrap in a child once per process; None when it works."""
    env = dict(os.environ, **{DISABLE_NVLS_ENV: os.environ.get(DISABLE_NVLS_ENV, "1")})
    try:
        done = subprocess.run([sys.executable, "-c", BOOTSTRAP_CHECK], capture_output=True, text=True,
                              timeout=BOOTSTRAP_TIMEOUT_S, env=env)
    except subprocess.TimeoutExpired:
        return (f"MSCCL++'s TCP bootstrap did not finish within {BOOTSTRAP_TIMEOUT_S} s "
                "(one process: CppTcpBootstrap.create(0, 1).create_unique_id())")
    static = static_runtime_libraries() if done.returncode < 0 else None
    return describe_bootstrap_failure(done.returncode, done.stdout, done.stderr, static)


def engine_settings(name: str, stand_in: bool = False) -> engines.Settings:
    """stand_in: a forced algorithm, where SGLang picks its own by size."""
    return engines.Settings(name, sglang_flags=[engines.SGLANG_MSCCLPP], sglang_env=dict(engines.MSCCLPP_NO_NVLS_ENV),
                            vllm_supported=False, notes=[engines.MSCCLPP_NO_VLLM, engines.MSCCLPP_SGLANG],
                            engine_paths=engines.claim(engines.MSCCLPP, engines.SGLANG, stand_in=stand_in))


class MscclppAllreduce(Backend):
    family = "mscclpp"
    min_world_size = 2

    def __init__(self, algorithm: str | None):
        self.algorithm = algorithm          # None = auto
        self.name = "mscclpp:auto" if algorithm is None else f"mscclpp:algo={algorithm}"
        self._mscclpp: Any = None
        self._comm: Any = None
        self._scratch: Any = None
        self._algorithms: dict[str, Any] = {}
        self._dtype: Any = None
        self._accum_dtype: Any = None
        self._last_algorithm: str | None = None
        self._sms: int | None = None      # resident_sms, set at setup

    @property
    def needs(self) -> tuple[str, ...]:  # type: ignore[override]
        nvls = self.algorithm is not None and "nvls" in self.algorithm
        return ("cuda", "node", "p2p", "ipc", "multicast") if nvls else ("cuda", "node", "p2p", "ipc")

    def world_size_reason(self, world_size: int) -> str | None:
        reason = super().world_size_reason(world_size)
        allowed = RANKS_PER_NODE.get(self.algorithm or "")
        if reason is None and allowed and world_size not in allowed:
            return (f"{self.algorithm} runs {' or '.join(map(str, allowed))} ranks per node "
                    f"(MSCCL++ 0.9.0), this run has {world_size}")
        return reason

    def software_reason(self) -> str | None:
        return import_reason()

    def check(self, ctx: "RunContext") -> str | None:
        reason = super().check(ctx)
        if reason is None and self.algorithm in GRID_BARRIER_LAUNCH:
            reason = grid_barrier_reason(self.algorithm, 0, ctx.resident_sms)   # its smallest launch
        return reason

    def engine_settings(self, world_size: int | None) -> engines.Settings:
        return engine_settings(self.name, stand_in=self.algorithm is not None)

    def setup(self, ctx: "RunContext", max_bytes: int, dtype: torch.dtype) -> None:
        mscclpp = import_mscclpp(ctx.multicast_reason is None)
        self._mscclpp = mscclpp
        self._sms = ctx.resident_sms
        self._dtype = getattr(mscclpp.DataType, MSCCLPP_DTYPES[dtype])
        # Algorithm.execute (0.9.0) hands int(accum_dtype) to C++, defaulting it to dtype; an enum
        # of a nanobind 2+ build refuses int() (TypeError), its value does not.
        self._accum_dtype = enum_number(self._dtype)
        if self._comm is None:
            # CommGroup bootstraps over TCP and broadcasts its id as a CPU tensor: the gloo group.
            self._comm = mscclpp.CommGroup(torch_group=ctx.control_group)
            self._scratch = mscclpp.RawGpuBuffer(SCRATCH_BYTES)
            collection = importlib.import_module("mscclpp.ext").AlgorithmCollectionBuilder() \
                .build_default_algorithms(scratch_buffer=self._scratch.data(),
                                          scratch_buffer_size=SCRATCH_BYTES, rank=ctx.rank)
            self._algorithms = {a.name: a for a in collection if a.collective == "allreduce"}
        wanted = {self.algorithm} if self.algorithm else {name for _, name in AUTO_RULE} | {AUTO_LARGE}
        missing = sorted(wanted - set(self._algorithms))
        error = f"no default allreduce algorithm {', '.join(missing)} (has: {', '.join(sorted(self._algorithms))})" \
            if missing else None
        raise_unless_all_ranks_ok(ctx, error, "MSCCL++ algorithm lookup")

    def _pick(self, message_bytes: int) -> str:
        return self.algorithm or auto_algorithm(message_bytes)

    def supports(self, message_bytes: int, dtype: torch.dtype) -> str | None:
        reason = super().supports(message_bytes, dtype)
        if reason or not self._algorithms:
            return reason
        name = self._pick(message_bytes)
        low, high = self._algorithms[name].message_size_range
        if not low <= message_bytes <= high:
            return f"{name} handles {low}..{high} bytes"
        return grid_barrier_reason(name, message_bytes, self._sms) if self._sms is not None else None

    def allreduce(self, x: torch.Tensor, out: torch.Tensor) -> None:
        assert self._comm is not None, "setup() first"
        nbytes = x.numel() * x.element_size()
        name = self._pick(nbytes)
        result = self._algorithms[name].execute(
            self._comm.communicator, x.data_ptr(), out.data_ptr(), nbytes, nbytes, self._dtype,
            op=self._mscclpp.ReduceOp.SUM, stream=torch.cuda.current_stream().cuda_stream,
            accum_dtype=self._accum_dtype)
        if enum_number(result) != 0:    # CommResult (or a plain int in older builds); 0 is success
            raise RuntimeError(f"MSCCL++ {name} returned {result}")
        self._last_algorithm = name

    def row_fields(self) -> dict[str, Any]:
        return {"extra": {"mscclpp_algorithm": self._last_algorithm or self.algorithm or "auto",
                          "mscclpp_auto_rule": None if self.algorithm else "algorithm_selector.cc, one node, no NVLS"}}

    def close(self) -> None:
        self._algorithms = {}
        self._comm = None
        self._scratch = None


def enum_number(value: Any) -> int:
    """The number of an MSCCL++ enum member: nanobind 2+ makes enums Python Enums, which refuse
    int() (MSCCL++ pins nanobind 1.9, whose enums take it); plain ints pass through."""
    return int(getattr(value, "value", value))


def shim_preloaded(path: str) -> bool:
    """Is libmscclpp_nccl.so mapped into this process (i.e. this is the child torchrun)?"""
    real = os.path.realpath(path)
    try:
        with open("/proc/self/maps", encoding="utf-8") as maps:
            return any(line.rstrip().endswith(real) for line in maps)
    except OSError:
        return False


class MscclppShim(ProcessGroupBackend):
    """NCCL's API from libmscclpp_nccl.so. In the parent process check() says that the sweep's
    driver has to start a child torchrun with ``process_env``; in that child (the library is
    preloaded) it reduces through a new NCCL group, which the shim serves."""

    family = "mscclpp"
    name = "mscclpp:shim"
    needs = ("cuda", "own_gpu", "node", "p2p", "ipc")   # NCCL's API refuses two ranks on one GPU
    min_world_size = 2

    def __init__(self, library: str | None):
        self.library = library

    def process_env(self, allow_multicast: bool) -> dict[str, str] | None:
        """Environment of the child torchrun that loads the shim in place of NCCL; None when the
        library cannot be preloaded (the rows then give software_reason's words)."""
        if not self.library or self.software_reason() is not None:
            return None
        return self._preload_env(self.library, allow_multicast)

    @staticmethod
    def _preload_env(library: str, allow_multicast: bool) -> dict[str, str]:
        env = {PRELOAD_VAR: os.path.realpath(library)}
        if multicast_policy_reason(allow_multicast):
            env[DISABLE_NVLS_ENV] = "1"
        return env

    def software_reason(self) -> str | None:
        if not self.library:
            return "needs the MSCCL++ NCCL shim: pass --mscclpp-nccl-lib PATH (build/lib/libmscclpp_nccl.so)"
        if not os.path.isfile(self.library):
            return f"--mscclpp-nccl-lib {self.library}: no such file"
        missing = unresolved_libraries(self.library)
        if missing:
            # A preload that fails stops python itself from starting: no row would say why.
            return (f"--mscclpp-nccl-lib {self.library}: the loader finds no {', '.join(missing)} for it (use the "
                    "shim from scripts/build-mscclpp.sh's shim step, whose RPATH finds its neighbours)")
        return None

    def check(self, ctx: "RunContext") -> str | None:
        reason = super().check(ctx)
        if reason is None and not shim_preloaded(self.library):
            # software_reason (in super().check) passed: the library is there and loads.
            env = " ".join(f"{k}={v}" for k, v in self._preload_env(self.library, ctx.allow_multicast).items())
            return f"runs in a child torchrun with {env} (started by the sweep's driver)"
        return reason

    def setup(self, ctx: "RunContext", max_bytes: int, dtype: torch.dtype) -> None:
        if self.group is None:
            self.group = dist.new_group(ranks=list(range(ctx.world_size)), backend="nccl")

    def engine_settings(self, world_size: int | None) -> engines.Settings:
        # Not SGLang's --enable-mscclpp (MSCCL++'s Python API): the shim serves any engine's NCCL path.
        return engines.nccl_path(self.name, notes=[engines.MSCCLPP_SHIM],
                                 preload=os.path.realpath(self.library) if self.library else "")

    def row_fields(self) -> dict[str, Any]:
        return {"extra": {"mscclpp_nccl_lib": self.library,
                          "mscclpp_algorithm": "chosen inside libmscclpp_nccl.so (not reported by the shim)"}}


@dataclass(frozen=True)
class MscclppOptions:
    nccl_lib: str | None = None    # --mscclpp-nccl-lib: libmscclpp_nccl.so for mscclpp:shim


def read_options(args: argparse.Namespace) -> MscclppOptions:
    return MscclppOptions(nccl_lib=args.mscclpp_nccl_lib)


def make(variant: str | None, options: MakeOptions[MscclppOptions]) -> list[Backend]:
    library = options.own.nccl_lib
    each: list[Backend] = [MscclppAllreduce(name) for name in DEFAULT_ALGORITHMS]
    if variant is None:
        return [MscclppAllreduce(None), *each, MscclppShim(library)]
    opts = parse_variant_options(variant)
    if variant == "auto":
        return [MscclppAllreduce(None)]
    if variant == "each":
        return each
    if variant == "shim":
        return [MscclppShim(library)]
    if set(opts) == {"algo"} and opts["algo"] != "algo":
        return [MscclppAllreduce(opts["algo"])]
    from commbench.errors import UsageError

    raise UsageError(f"mscclpp: unknown variant {variant!r}; choose auto, each, shim or algo=NAME")


FACTORY = BackendFactory(
    family="mscclpp",
    make=make,
    native=True,
    summary="MSCCL++ default allreduce algorithms (Python API) and its NCCL shim (optional, built from source)",
    variants_help=[
        "mscclpp:auto        per size: allpair_packet <= 16K, packet <= 1M, else fullmesh (no NVLS)",
        "mscclpp:algo=NAME   one default algorithm, e.g. algo=default_allreduce_packet",
        "mscclpp:each        every default allreduce algorithm, one variant each (NVLS ones need multicast)",
        "mscclpp:shim        libmscclpp_nccl.so in place of NCCL (--mscclpp-nccl-lib PATH)",
    ],
    packages=("mscclpp",),
    add_arguments=add_arguments, read_options=read_options,
)
