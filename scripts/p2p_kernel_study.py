#!/usr/bin/env python3
"""What makes one p2p kernel faster than another: variants of backends/p2p/allreduce.cu, each one
change, measured by the sweep in the same run as the shipped kernels and the engines' kernels.

    python3 scripts/p2p_kernel_study.py prepare SITE_DIR
    PYTHONPATH=SITE_DIR python3 -m commbench sweep --nproc 8 --share-gpus --mps --mode graph \\
        --dtype bf16 --sizes 4K,8K --backends p2p:oneshot_lamport,$(python3 scripts/p2p_kernel_study.py specs) ...
    python3 scripts/p2p_kernel_study.py table RUN_DIR [RUN_DIR ...]

prepare writes into SITE_DIR one patched copy of allreduce.cu per study (each change is an exact
text replacement: a kernel file that no longer holds the text fails here, never silently), this
module, and a distribution's metadata that registers it as the backend plug-in family
`p2pstudy` (the `commbench.backends` entry-point group). `p2pstudy:STUDY.KERNEL` is the p2p
backend running the p2p variant KERNEL compiled from STUDY's copy: the sweep checks every timed
call of it as of any backend (the exact sums), next to the shipped `p2p:KERNEL` (the same code
as `p2pstudy:base.KERNEL`: their difference is the run's noise) and the engines' kernels.
table prints, per run, each study row's time as a ratio to `p2pstudy:base` of the same kernel
and size. Study code never ships: a change that wins is written into allreduce.cu itself.
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ENTRY_POINT = "p2pstudy"
HERE = Path(__file__).resolve()
KERNEL_FILE = "allreduce.cu"

# ---- the changes, as (text in allreduce.cu, its replacement) ----

_LL_POLL = 'asm volatile("ld.volatile.global.v4.u32 {%0, %1, %2, %3}, [%4];"'
_LL_STORE = 'asm volatile("st.volatile.global.v4.u32 [%0], {%1, %2, %3, %4};"'
_FLAG_POLL = "while ((int)(load_acquire_sys(mine) - count) < 0) {"
_LL_SHAPE = "  ll_oneshot<DT, N, {}>(L, in, out, units);"
# Shipped after the studies of 2026-12-03 (results/reference/h200-mps-p2p-tune/README.md), so no
# longer studies here: the graph one-shot's counter barrier (SGLang's barrier), the Lamport
# one-shot's two buffers, its push in rank order and its own slot up to LL_OWN_SLOT_UNITS (SGLang's
# push shape: push_fused, push_fixed, poll_all and sglang_shape in the file's history), the graph
# kernels' row loaded before the PDL wait (graph_early_row), bf16 packed by cvt.rn.bf16x2.f32
# (bf16_cvt), the Lamport one-shot's own small parameter (small_params), the graph kernels' call
# count read by one thread (call_thread0; noabort measured the vote without the abort word), the
# graph one-shot's first barrier without its block barrier (first_barrier_nosync) and its loop over
# two vectors at a time at 2 ranks (graph_unroll2, graph_unroll4, graph_lean), the own-slot
# Lamport one-shot's warps spread over the SMs (warp_spread). flag_oneshot, own_slot_*, bf16_int,
# graph_all_read, unroll_* and no_warp_spread measure shipped choices against what they replaced.
_UNROLL = "    constexpr u32 K = N == 2 ? 2 : 1;"
_GRAPH_BARE = ("      const u64 start = globaltimer_ns();\n      u32 polls = 0;\n"
               "      while (load_relaxed_sys(mine) - target < (u32)N) {\n"
               "        if ((++polls & 255u) != 0u) continue;\n"
               "        if (aborted(L) || globaltimer_ns() - start > L.timeout_ns) {",
               "      while (load_relaxed_sys(mine) - target < (u32)N) {\n"
               "        if (true) continue;\n"
               "        if (false) {")
_GRAPH_NOCOUNT = ("  call = begin_call<true>(L, ((Ctrl*)L.ctrl)->calls);\n  if (!kCounter)",
                  "  if (kCounter) call = Call{0u, false};\n"
                  "  else call = begin_call<true>(L, ((Ctrl*)L.ctrl)->calls);\n  if (!kCounter)")
STUDIES: dict[str, tuple[tuple[str, str], ...]] = {
    "base": (),
    # (c) the Lamport polls' and pushes' flavour: SGLang's relaxed system-scope loads and stores,
    # or acquire loads.
    "ll_relaxed": ((_LL_POLL, _LL_POLL.replace("ld.volatile.global", "ld.relaxed.sys.global")),
                   (_LL_STORE, _LL_STORE.replace("st.volatile.global", "st.relaxed.sys.global"))),
    "ll_acquire": ((_LL_POLL, _LL_POLL.replace("ld.volatile.global", "ld.acquire.sys.global")),),
    # The Lamport one-shot's own loop: reload every source on each poll, as SGLang does, not only
    # those still empty.
    "ll_reload_all": (("      if (s != (int)self && !ll_ready(v[s])) v[s] = load_volatile4(",
                       "      if (s != (int)self) v[s] = load_volatile4("),),
    # (c) the flag barrier's poll: relaxed or volatile instead of acquire.
    "flag_relaxed": ((_FLAG_POLL, _FLAG_POLL.replace("load_acquire_sys", "load_relaxed_sys")),),
    "flag_volatile": ((_FLAG_POLL, _FLAG_POLL.replace("load_acquire_sys(mine)", "load_volatile(mine)")),),
    # (b) the graph one-shot's barriers as flags (one per peer, N polling threads: the shipped
    # graph two-shot's) instead of its counter (one peer atomic per rank, one polling thread).
    "flag_oneshot": (("  if (graph_call_begin<N, true>(L, call, window)) {",
                      "  if (graph_call_begin<N, false>(L, call, window)) {"),
                     ("    counter_barrier<N>(L, window + N, call.count, PHASE_SECOND_BARRIER);",
                      "    barrier<N, false>(L, call.count, PHASE_SECOND_BARRIER);")),
    # The graph one-shot's reads of every rank's input as plain loads (SGLang's pull loads), not
    # ld.global.cg (L2 only).
    "graph_plain_loads": (("v[s] = load_cg((const uint4*)ins[s] + i);", "v[s] = ((const uint4*)ins[s])[i];"),
                          ("v[k][s] = load_cg((const uint4*)ins[s] + i + k * stride);",
                           "v[k][s] = ((const uint4*)ins[s])[i + k * stride];")),
    # PDL: let the next launch start only when this grid ends (SGLang triggers at its end).
    "pdl_late": (('  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");\n', ""),),
    "nopdl": (),     # the shipped source, launched without PDL
    # The Lamport one-shot without what SGLang's push does not have: no abort word, no vote, no
    # timeout in its polls (a missing peer hangs it); the block's count is published at the end,
    # after a block barrier, as SGLang flips its epoch. What the safety costs at small sizes.
    "ll_bare": (("  const Call call = begin_call(L, ((Ctrl*)L.ctrl)->ll_calls);\n  if (call.failed) return;\n",
                 "  u32* counters = ((Ctrl*)L.ctrl)->ll_calls;\n  Call call;\n"
                 "  call.count = load_volatile(counters + blockIdx.x) + 1;\n"),
                ("      if (s != (int)self) ((uint4*)(mine + s * slot))[i] = empty;\n  }\n}\n",
                 "      if (s != (int)self) ((uint4*)(mine + s * slot))[i] = empty;\n  }\n  __syncthreads();\n"
                 "  for (u32 b = blockIdx.x + threadIdx.x * gridDim.x; b < P2P_MAX_BLOCKS; b += blockDim.x * gridDim.x)\n"
                 "    counters[b] = call.count;\n}\n"),
                ("    if ((polls & 63u) == 0u) {", "    if (false) {")),
    # The shipped source launched with one warp per block (p2p_threads 32), as SGLang's push
    # spreads a small message over its grid, a warp per block (the host's only change).
    "warp_blocks": (),
    # The graph one-shot's thread 0 reserves its call's barrier window (one atomic on its own
    # memory) after its first arrival at the peers, not before: the atomic's round trip then
    # overlaps the peers' arrivals.
    "window_late": (("__device__ bool counter_barrier(const Layout& L, u32 target, u32 count, int phase) {",
                     "__device__ bool counter_barrier(const Layout& L, u32 target, u32 count, int phase,\n"
                     "                                u32* reserve = nullptr) {"),
                    ("    if (threadIdx.x == 0) {\n      const u32* mine = semaphore(L.flags[L.rank], blockIdx.x);",
                     "    if (threadIdx.x == 0) {\n      if (reserve != nullptr)\n"
                     "        target = *reserve = atomicAdd(semaphore(L.flags[L.rank], blockIdx.x, WINDOW_WORD), 2u * N);\n"
                     "      const u32* mine = semaphore(L.flags[L.rank], blockIdx.x);"),
                    ("  if (threadIdx.x == 0) window = atomicAdd(semaphore(L.flags[L.rank], blockIdx.x, WINDOW_WORD), 2u * N);\n"
                     "  return !call.failed && counter_barrier<N, false>(L, window, call.count, PHASE_FIRST_BARRIER);",
                     "  return !call.failed && counter_barrier<N, false>(L, 0u, call.count, PHASE_FIRST_BARRIER, &window);")),
    # The graph one-shot's counter barrier without its safety: thread 0 polls its semaphore and
    # nothing else (no abort word, no clock, no timeout; a missing peer hangs it), as SGLang's
    # pull waits. What the checks cost at the middle sizes.
    "graph_bare": (_GRAPH_BARE,),
    # The graph one-shot without its call count: no count read or published, no abort word
    # read (its barriers' window needs neither; a timeout would report call 0), as SGLang's pull
    # keeps no count. With graph_bare too (graph_lean): every check and record SGLang's pull
    # lacks, gone; what is left of the gap then is the data path.
    "graph_nocount": (_GRAPH_NOCOUNT,),
    "graph_lean": (_GRAPH_BARE, _GRAPH_NOCOUNT),
    # The shipped source in another launch shape (LAUNCH_SHAPES: the host's only change).
    "no_warp_spread": (),
    "grid_pull": (),
    "grid_narrow": (),
    # The graph kernels' call count and abort word read by every thread, voted on by the block
    # (the Lamport one-shot's way), not read by thread 0 alone.
    "graph_all_read": (("  call = begin_call<true>(L, ((Ctrl*)L.ctrl)->calls);",
                        "  call = begin_call<false>(L, ((Ctrl*)L.ctrl)->calls);"),),
    # The graph one-shot's loop over two vectors at a time at every world size, or at none.
    "unroll_every_world": ((_UNROLL, "    constexpr u32 K = 2;"),),
    "unroll_none": ((_UNROLL, "    constexpr u32 K = 1;"),),
    # The Lamport one-shot's own slot (SGLang's push shape) at every size and world size, or never
    # (each kernel then runs the other's shape): the measurement behind layout.LL_OWN_SLOT_UNITS
    # and the 2-rank exception.
    "own_slot_always": ((_LL_SHAPE.format("false"), _LL_SHAPE.format("true")),),
    "own_slot_never": ((_LL_SHAPE.format("true"), _LL_SHAPE.format("false")),),
    # bf16 rounded in integer code (the kernels before cvt.rn.bf16x2.f32 was shipped).
    "bf16_int": (("#if __CUDA_ARCH__ >= 800\n      if (DT == 2) {", "#if 0\n      if (DT == 2) {"),),
    # The shipped source compiled by nvcc into a cubin on the machine (CuPy's NVRTC options), not
    # by NVRTC: the compiler is the only change.
    "nvcc": (),
}


def no_warp_spread(units: int, cap_blocks: int, sms: int) -> tuple[int, int]:
    """The Lamport one-shot's own-slot form launched by the size rule of the other kernels
    (layout.size_dims: blocks of 128 threads or more, one per SM), not spread a warp per block
    (layout.warp_spread, shipped after the study of 20:27)."""
    from commbench.backends.p2p.layout import size_dims

    return size_dims(units, cap_blocks, sms)


def grid_pull(units: int, cap_blocks: int, sms: int) -> tuple[int, int]:
    """SGLang's 1shot_pull grid on SM90: 64 blocks whatever the size (those past the message
    only meet the barriers), each as wide as the shipped rule's (SGLang's choose_block_size,
    capped at THREADS_PER_BLOCK)."""
    from commbench.backends.p2p.layout import MAX_BLOCKS, spread_threads

    return min(cap_blocks, MAX_BLOCKS), spread_threads(units, sms)


def grid_narrow(units: int, cap_blocks: int, sms: int) -> tuple[int, int]:
    """Every block the grid may hold (up to MAX_BLOCKS, two per SM at 4 ranks under MPS), each
    narrowed to the whole warps that cover the message once."""
    from commbench.backends.p2p.layout import MAX_BLOCKS, THREADS_PER_BLOCK, WARP_THREADS

    blocks = min(cap_blocks, MAX_BLOCKS)
    return blocks, min(THREADS_PER_BLOCK, WARP_THREADS * -(-units // (WARP_THREADS * blocks)))


# study -> (the kernel whose launches it shapes, its shape from (vectors, grid cap, SMs)).
LAUNCH_SHAPES = {"no_warp_spread": ("oneshot_lamport", no_warp_spread), "grid_pull": ("oneshot_graph", grid_pull),
                 "grid_narrow": ("oneshot_graph", grid_narrow)}

# The p2p variants each study is measured with: the kernels its change touches.
LAMPORT, GRAPH = ("oneshot_lamport",), ("oneshot_graph", "twoshot_graph")
STUDY_KERNELS: dict[str, tuple[str, ...]] = {
    "base": LAMPORT + GRAPH, "ll_relaxed": LAMPORT, "ll_acquire": LAMPORT, "ll_reload_all": LAMPORT,
    "flag_relaxed": ("twoshot_graph",), "flag_volatile": ("twoshot_graph",), "flag_oneshot": ("oneshot_graph",),
    "graph_plain_loads": ("oneshot_graph",), "pdl_late": LAMPORT + GRAPH, "nopdl": LAMPORT + GRAPH,
    "graph_all_read": GRAPH, "ll_bare": LAMPORT, "warp_blocks": LAMPORT, "unroll_every_world": ("oneshot_graph",), "unroll_none": ("oneshot_graph",),
    "own_slot_always": LAMPORT, "own_slot_never": LAMPORT, "bf16_int": LAMPORT + GRAPH, "nvcc": LAMPORT + GRAPH,
    "window_late": ("oneshot_graph",), "graph_bare": ("oneshot_graph",), "graph_nocount": ("oneshot_graph",),
    "graph_lean": ("oneshot_graph",), **{study: (kernel,) for study, (kernel, _) in LAUNCH_SHAPES.items()}}


def patched(source: str, study: str) -> str:
    """allreduce.cu with one study's replacements, each made wherever its text occurs (both graph
    kernels, say); text that occurs nowhere stops the study."""
    for old, new in STUDIES[study]:
        if old not in source:
            raise SystemExit(f"p2p_kernel_study: {study}: the kernel file no longer holds "
                             f"{old.splitlines()[0]!r} (the study does not match allreduce.cu)")
        source = source.replace(old, new)
    return source


def specs() -> list[str]:
    return [f"{ENTRY_POINT}:{study}.{kernel}" for study, kernels in STUDY_KERNELS.items() for kernel in kernels]


def nvrtc_options(arch: str) -> tuple[str, ...]:
    """What CuPy's RawModule gives NVRTC for kernels.py, as nvcc flags (besides the include paths
    this headerless file never uses): --std=c++17 from kernels.py, -ftz=true from CuPy, the
    device's own sm_XY."""
    return (f"-arch={arch}", "-std=c++17", "-ftz=true")


def nvcc_cubin(source: Path, kernels: list[str], dtype_code: int, nranks: int, flags: tuple[str, ...],
               workdir: Path, nvcc: str = "nvcc") -> tuple[Path, dict[str, str]]:
    """The kernels named (templates of allreduce.cu) for one dtype and world size, compiled by
    nvcc with these flags into a cubin in workdir: the cubin and each kernel's mangled name, read
    from the PTX that nvcc writes first (nvcc -cubin from that PTX is its own ptxas step)."""
    unit, ptx, cubin = workdir / "kernels.cu", workdir / "kernels.ptx", workdir / "kernels.cubin"
    refs = ", ".join(f"(void*)&{name}<{dtype_code}, {nranks}>" for name in kernels)
    # Taking a kernel template's address instantiates it; no signature needs spelling out.
    unit.write_text(f'#include "{source.resolve()}"\nvoid* p2p_study_kernels[] = {{{refs}}};\n')
    for command in ([nvcc, "-ptx", *flags, "-o", str(ptx), str(unit)],
                    [nvcc, "-cubin", *flags, "-o", str(cubin), str(ptx)]):
        done = subprocess.run(command, capture_output=True, text=True, check=False)
        if done.returncode:
            raise RuntimeError(f"{' '.join(command)} exited {done.returncode}: {done.stderr.strip()[-400:]}")
    entries = re.findall(r"\.entry\s+(\w+)\(", ptx.read_text())
    return cubin, {name: next(e for e in entries if e.startswith(f"_Z{len(name)}{name}I")) for name in kernels}


NVCC_MISSING = "nvcc is not on PATH (the nvcc study compiles allreduce.cu with it)"


def prepare(site: Path) -> None:
    repo = HERE.parent.parent
    source = (repo / "backends" / "p2p" / KERNEL_FILE).read_text()
    sources = site / "p2p_kernel_study_sources"
    sources.mkdir(parents=True, exist_ok=True)
    for study in STUDIES:
        (sources / f"{study}.cu").write_text(patched(source, study))
    shutil.copy(HERE, site / "p2p_kernel_study.py")
    dist = site / "p2p_kernel_study-0.dist-info"
    dist.mkdir(exist_ok=True)
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: p2p-kernel-study\nVersion: 0\n")
    (dist / "entry_points.txt").write_text(f"[commbench.backends]\n{ENTRY_POINT} = p2p_kernel_study:FACTORY\n")
    print(f"p2p_kernel_study: {len(STUDIES)} sources in {sources}; backends: {','.join(specs())}")


# ---- the plug-in (imported by commbench in every rank, from SITE_DIR) ----

def _factory() -> Any:
    from commbench.backends.base import BackendFactory, voted
    from commbench.backends.p2p import kernels as p2p_kernels
    from commbench.backends.p2p.backend import P2PAllreduce
    from commbench.backends.p2p.layout import DTYPE_CODES, WARP_THREADS, LaunchShape
    from commbench.backends.p2p.rules import P2POptions
    from commbench.errors import UsageError

    class StudyP2P(P2PAllreduce):
        family = ENTRY_POINT

        def __init__(self, study: str, kernel: str):
            shape = LaunchShape(threads=WARP_THREADS) if study == "warp_blocks" else LaunchShape()
            super().__init__(kernel, P2POptions(pdl=study != "nopdl", shape=shape))
            self.study = study
            self.name = f"{ENTRY_POINT}:{study}.{kernel}"
            self.kernel_source = HERE.parent / "p2p_kernel_study_sources" / f"{study}.cu"

        def check(self, ctx: Any) -> str | None:
            if self.study == "nvcc" and shutil.which("nvcc") is None:
                return NVCC_MISSING
            return super().check(ctx)

        def setup(self, ctx: Any, max_bytes: int, dtype: Any) -> None:
            if self.study == "nvcc":
                # kernels.kernel_functions' process cache, keyed by this study's own source path:
                # filled here, it hands the backend nvcc's kernels instead of compiling with NVRTC.
                key = (ctx.device.index, DTYPE_CODES[dtype], ctx.world_size, self.kernel_source)
                if key not in p2p_kernels._FUNCTIONS:
                    p2p_kernels._FUNCTIONS[key] = voted(ctx, "nvcc compilation (p2p kernel study)",
                                                        lambda: _nvcc_functions(ctx, dtype, self.kernel_source))
            super().setup(ctx, max_bytes, dtype)

        def _launch_dims(self, algorithm: str, units: int, dtype: Any) -> tuple[int, int]:
            kernel, shape = LAUNCH_SHAPES.get(self.study, (None, None))
            dims = shape(units, *self._grids[dtype]) if shape and algorithm == kernel else None
            return dims or super()._launch_dims(algorithm, units, dtype)

        def row_fields(self) -> dict[str, Any]:
            fields = super().row_fields()
            fields["extra"]["p2p_study"] = self.name.partition(":")[2].partition(".")[0]
            return fields

    def make(variant: str | None, options: Any) -> list[Any]:
        names = specs() if variant is None else [f"{ENTRY_POINT}:{variant.strip()}"]
        made = []
        for name in names:
            study, _, kernel = name.partition(":")[2].partition(".")
            if kernel not in STUDY_KERNELS.get(study, ()):
                raise UsageError(f"unknown study backend {name!r}: choose from {', '.join(specs())}")
            made.append(StudyP2P(study, kernel))
        return made

    return BackendFactory(family=ENTRY_POINT, make=make, on_gpu_by_default=False,
                          summary="study variants of commbench's p2p kernels (scripts/p2p_kernel_study.py)",
                          native=False, trace_kernels_of="p2p")


def _nvcc_functions(ctx: Any, dtype: Any, source: Path) -> dict[str, Any]:
    """kernels.kernel_functions' answer, from nvcc: every kernel of `source` for this device,
    dtype and world size, for the device's own architecture as CuPy asks NVRTC for it."""
    import torch
    from commbench.backends.p2p.kernels import cupy_module
    from commbench.backends.p2p.layout import DTYPE_CODES, KERNEL_NAMES

    cupy = cupy_module()
    major, minor = torch.cuda.get_device_capability(ctx.device)
    with tempfile.TemporaryDirectory(prefix="p2pstudy-nvcc-") as workdir, cupy.cuda.Device(ctx.device.index):
        cubin, mangled = nvcc_cubin(source, list(KERNEL_NAMES.values()), DTYPE_CODES[dtype], ctx.world_size,
                                    nvrtc_options(f"sm_{major}{minor}"), Path(workdir))
        module = cupy.RawModule(path=str(cubin))
        return {algo: module.get_function(mangled[name]).kernel for algo, name in KERNEL_NAMES.items()}


def __getattr__(name: str) -> Any:     # FACTORY is built on first use: `prepare` needs no torch
    if name == "FACTORY":
        return _factory()
    raise AttributeError(name)


# ---- the table ----

def table(run_dirs: list[Path]) -> list[str]:
    from commbench.results import OK, RunDir
    from commbench.units import format_bytes

    lines: list[str] = []
    for run_dir in run_dirs:
        rows = [r for r in RunDir(run_dir).rows() if r.status == OK and r.mode == "graph" and r.latency_us]
        by = {(r.backend, r.message_bytes): r.latency_us for r in rows}
        sizes = sorted({r.message_bytes for r in rows})
        world = rows[0].world_size if rows else "?"
        others = sorted({r.backend for r in rows if not r.backend.startswith(f"{ENTRY_POINT}:")})
        lines += [f"### {world} ranks (`{run_dir.name}`): us per call; study rows as a ratio to base", "",
                  "| backend | " + " | ".join(format_bytes(s) for s in sizes) + " |", "|---" * (len(sizes) + 1) + "|"]
        # Every study the run measured, in the order it ran (a study shipped since is still shown).
        studied_or_base = set(r.backend for r in rows)
        studied = [b for b in dict.fromkeys(r.backend for r in rows)
                   if b.startswith(f"{ENTRY_POINT}:") and not b.startswith(f"{ENTRY_POINT}:base.")]
        for name in others + studied:
            cells = []
            for size in sizes:
                us = by.get((name, size))
                base = by.get((f"{ENTRY_POINT}:base.{name.split('.', 1)[-1].split(':')[-1]}", size))
                if us is None:
                    cells.append("-")
                elif name.startswith(f"{ENTRY_POINT}:") and base:
                    cells.append(f"{us / base:.2f}x")
                else:
                    cells.append(f"{us:.2f}")
            lines.append(f"| {name} | " + " | ".join(cells) + " |")
        lines += [f"| {ENTRY_POINT}:base.{k} | " + " | ".join(
            f"{by[(f'{ENTRY_POINT}:base.{k}', s)]:.2f}" if (f"{ENTRY_POINT}:base.{k}", s) in by else "-"
            for s in sizes) + " |" for k in STUDY_KERNELS["base"] if f"{ENTRY_POINT}:base.{k}" in studied_or_base]
        lines.append("")
    return lines


def winners(run_dirs: list[Path], margin: float = 0.03) -> list[str]:
    """Studies faster than base by `margin` at some size of some run, in no row wrong or failed,
    best first."""
    from commbench.results import OK, RunDir

    best: dict[str, float] = {}
    failed: set[str] = set()
    for run_dir in run_dirs:
        rows = [r for r in RunDir(run_dir).rows() if r.backend.startswith(f"{ENTRY_POINT}:") and r.mode == "graph"]
        base = {(r.backend.split(".", 1)[1], r.message_bytes): r.latency_us for r in rows
                if r.backend.startswith(f"{ENTRY_POINT}:base.") and r.status == OK}
        for r in rows:
            study, kernel = r.backend.partition(":")[2].split(".", 1)
            if r.status != OK:
                failed.add(study)
            elif (kernel, r.message_bytes) in base and r.latency_us:
                ratio = r.latency_us / base[(kernel, r.message_bytes)]
                best[study] = min(best.get(study, ratio), ratio)
    return [s for s in sorted(best, key=best.get) if s != "base" and s not in failed and best[s] < 1 - margin]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("prepare").add_argument("site", type=Path)
    sub.add_parser("specs")
    sub.add_parser("table").add_argument("run_dirs", type=Path, nargs="+")
    sub.add_parser("winners").add_argument("run_dirs", type=Path, nargs="+")
    args = parser.parse_args(argv)
    if args.command == "prepare":
        prepare(args.site)
    elif args.command == "specs":
        print(",".join(specs()))
    else:
        for run_dir in args.run_dirs:
            if not (run_dir / "measurements.jsonl").is_file():
                print(f"p2p_kernel_study: {run_dir}: no measurements.jsonl", file=sys.stderr)
                return 2
        print("\n".join(table(args.run_dirs) if args.command == "table" else winners(args.run_dirs)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
