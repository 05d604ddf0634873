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
_LL_PUSH = """#pragma unroll
    for (int k = 1; k < N; ++k) {  // start at the next rank so ranks spread over peers
      const u32 p = (rank + k) % N;
      uint4* dst = (uint4*)(L.ll[p] + cur * buffer + rank * slot);
      for (u32 i = first; i < units; i += stride) store_volatile4(dst + i, ll_map(i == first ? in_first : in[i]));
    }
"""
_LL_PUSH_FUSED = """    for (u32 i = first; i < units; i += stride) {{
      const uint4 v = ll_map(i == first ? in_first : in[i]);
#pragma unroll
      for ({loop}) {{
        {peer}{guard}
        store_volatile4((uint4*)(L.ll[p] + cur * buffer + rank * slot) + i, v);
      }}
    }}
"""
# poll_all's wait and emptying: every slot of this rank's buffer polled alike (self = N: no source
# is this rank's own input) and every slot emptied after it is read, this rank's own included (it
# now holds data: left full, call c + 2 would read it as arrived before this rank pushed).
_POLL_ALL = (("      if (!ll_wait<N>(v, ll_map(i == first ? in_first : in[i]), mine, slot, i, rank, L, call.count, PHASE_LL_ONESHOT))",
              "      if (!ll_wait<N>(v, empty, mine, slot, i, N, L, call.count, PHASE_LL_ONESHOT))"),
             ("        if (s != (int)rank) ((uint4*)(mine + s * slot))[i] = empty;",
              "        ((uint4*)(mine + s * slot))[i] = empty;"))
_LAYOUT_END = "  u64 rank;\n  u64 nranks;\n};\n"
# small_params' struct: SMALL_LAYOUT_FIELDS in this order (the host builds it from the Layout's words).
SMALL_LAYOUT_FIELDS = ("ll", "slot_bytes", "timeout_ns", "ctrl", "report", "rank")
_SMALL_LAYOUT = """
struct SmallLayout {
  u64 ll[P2P_MAX_RANKS];
  u64 slot_bytes;
  u64 timeout_ns;
  u64 ctrl;
  u64 report;
  u64 rank;
};
"""

# Shipped after the study of 2026-12-03 (results/reference/h200-mps-p2p-tune/README.md), so no
# longer studies here: the graph one-shot's counter barrier (SGLang's barrier) and the Lamport
# one-shot's two buffers. flag_oneshot measures the first against the flags it replaced.
STUDIES: dict[str, tuple[tuple[str, str], ...]] = {
    "base": (),
    # (a) the work before the first store: no abort word, no block-wide vote on it.
    "noabort": (("  call.failed = __syncthreads_or(load_volatile(&c->abort) != 0u) != 0;",
                 "  call.failed = false;\n  __syncthreads();"),),
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
    "flag_oneshot": (("  if (graph_call_begin<N, true>(L, row, ins, call, window)) {",
                      "  if (graph_call_begin<N, false>(L, row, ins, call, window)) {"),
                     ("    counter_barrier<N>(L, window + N, call.count, PHASE_SECOND_BARRIER);",
                      "    barrier<N, false>(L, call.count, PHASE_SECOND_BARRIER);")),
    # The graph one-shot's reads of every rank's input as plain loads (SGLang's pull loads), not
    # ld.global.cg (L2 only).
    "graph_plain_loads": (("v[s] = load_cg((const uint4*)ins[s] + i);", "v[s] = ((const uint4*)ins[s])[i];"),),
    # PDL: let the next launch start only when this grid ends (SGLang triggers at its end).
    "pdl_late": (('  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");\n', ""),),
    "nopdl": (),     # the shipped source, launched without PDL
    # The Lamport one-shot given only the Layout fields it reads (104 bytes by value, not 504;
    # SGLang's push parameter is 112): the helpers it calls take either struct; the host passes
    # the smaller value (StudyP2P). Nothing else changes.
    "small_params": ((_LAYOUT_END, _LAYOUT_END + _SMALL_LAYOUT),
                     ("__device__ __forceinline__ Call begin_call(const Layout& L,",
                      "template <class LayoutT> __device__ __forceinline__ Call begin_call(const LayoutT& L,"),
                     ("__device__ void record_timeout(const Layout& L,",
                      "template <class LayoutT> __device__ void record_timeout(const LayoutT& L,"),
                     ("__device__ __forceinline__ bool aborted(const Layout& L) {",
                      "template <class LayoutT> __device__ __forceinline__ bool aborted(const LayoutT& L) {"),
                     ("template <int N>\n__device__ __forceinline__ bool ll_wait(",
                      "template <int N, class LayoutT>\n__device__ __forceinline__ bool ll_wait("),
                     ("u32 i, u32 self, const Layout& L, u32 count, int phase,",
                      "u32 i, u32 self, const LayoutT& L, u32 count, int phase,"),
                     ("p2p_ll_oneshot(const __grid_constant__ Layout L,",
                      "p2p_ll_oneshot(const __grid_constant__ SmallLayout L,")),
    # The Lamport one-shot's push as SGLang orders it: per vector one load and one mapping, then
    # the N-1 stores back to back, not one loop per peer each loading and mapping again (in
    # program order 277 SASS instructions from the first push to the first poll at 8 ranks,
    # SGLang's 33: the static comparison in results/reference/h200-mps-p2p-tune/README.md).
    "push_fused": ((_LL_PUSH, _LL_PUSH_FUSED.format(peer="const u32 p = (rank + k) % N;", loop="int k = 1; k < N; ++k",
                                                    guard="")),),
    # push_fused with the peers in rank order, every rank alike: each peer's address a
    # compile-time field of the parameter (no constant load indexed by the rank).
    "push_fixed": ((_LL_PUSH, _LL_PUSH_FUSED.format(peer="", loop="int p = 0; p < N; ++p",
                                                    guard="if (p == (int)rank) continue;")),),
    # SGLang's path from the last push to the first poll: this rank pushes its mapped vector into
    # its own slot like a peer's (one more pass of the push loop, last), then polls all N slots of
    # its buffer uniformly, no "not this rank" predicate and no own vector mapped apart (in
    # program order 86 SASS instructions from the last push to the first poll at 8 ranks,
    # SGLang's 22: the static comparison). The sums are the same bits: the own slot holds
    # ll_map(in), which the shipped kernel adds in its place.
    "poll_all": ((_LL_PUSH, _LL_PUSH.replace("k < N; ++k) {  // start at the next rank so ranks spread over peers",
                                             "k <= N; ++k) {  // the next rank first, this rank's own slot last")),
                 *_POLL_ALL),
    # SGLang's one-shot push shape as a whole: push_fixed's loop pushing to every rank, itself
    # included, in rank order, and poll_all's wait and emptying.
    "sglang_shape": ((_LL_PUSH, _LL_PUSH_FUSED.format(peer="", loop="int p = 0; p < N; ++p", guard="")), *_POLL_ALL),
    # The graph one-shot's row as SGLang's graph pull reads its pointer table: every rank's input
    # and this rank's output loaded once, before the PDL wait (the host wrote the row before the
    # first replay; no kernel writes it), kept in registers. The shipped kernel loads the row after
    # the wait, and ptxas reloads half the inputs' addresses after the barrier, one dependent
    # global load ahead of the first peer read (the static comparison with SGLang's one-shot pull).
    # Plain loads: ptxas moves ld.global.nc past the wait and issues it again in the loop.
    "graph_early_row": (("  P2P_BEGIN\n  u64 ins[N];\n  uint4* out = (uint4*)row[P2P_MAX_RANKS + L.rank];\n",
                         "  u64 ins[N], out_word;\n#pragma unroll\n"
                         "  for (int s = 0; s < N; ++s)   // asm volatile: issued here once, never again\n"
                         '    asm volatile("ld.global.u64 %0, [%1];" : "=l"(ins[s]) : "l"(row + s));\n'
                         '  asm volatile("ld.global.u64 %0, [%1];" : "=l"(out_word) : "l"(row + P2P_MAX_RANKS + L.rank));\n'
                         "  P2P_BEGIN\n  uint4* out = (uint4*)out_word;\n"),
                        ("  load_row<N>(row, ins, 0);\n  call = begin_call(",
                         "  if (!kCounter) load_row<N>(row, ins, 0);   // the counter one-shot loaded its row\n"
                         "  call = begin_call(")),
    # bf16 packing in hardware, as SGLang's reduce packs: one cvt.rn.bf16x2.f32 (F2FP) per two
    # lanes instead of the shipped rounding in integer code (at 2 ranks 88 SASS instructions from
    # the graph one-shot's first peer read to its store, SGLang's graph pull 41: the static
    # comparison). Round to nearest even both; only a NaN's bits differ (canonical, not the
    # input's payload), never a finite sum. Every kernel's bf16 sums change alike.
    "bf16_cvt": (("      const u32 lo = DT == 1 ? float_to_half(f[2 * i]) : float_to_bf16(f[2 * i]);\n",
                  "      if (DT == 2) {\n"
                  '        asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(w[i]) : "f"(f[2 * i + 1]), "f"(f[2 * i]));\n'
                  "        continue;\n      }\n"
                  "      const u32 lo = DT == 1 ? float_to_half(f[2 * i]) : float_to_bf16(f[2 * i]);\n"),),
    # The shipped source compiled by nvcc into a cubin on the machine (CuPy's NVRTC options), not
    # by NVRTC: the compiler is the only change.
    "nvcc": (),
}

# The p2p variants each study is measured with: the kernels its change touches.
LAMPORT, GRAPH = ("oneshot_lamport",), ("oneshot_graph", "twoshot_graph")
STUDY_KERNELS: dict[str, tuple[str, ...]] = {
    "base": LAMPORT + GRAPH, "noabort": LAMPORT + GRAPH, "ll_relaxed": LAMPORT, "ll_acquire": LAMPORT,
    "ll_reload_all": LAMPORT, "flag_relaxed": ("twoshot_graph",), "flag_volatile": ("twoshot_graph",),
    "flag_oneshot": ("oneshot_graph",), "graph_plain_loads": ("oneshot_graph",), "graph_early_row": ("oneshot_graph",),
    "bf16_cvt": LAMPORT + GRAPH, "pdl_late": LAMPORT + GRAPH, "nopdl": LAMPORT + GRAPH,
    "small_params": LAMPORT, "push_fused": LAMPORT, "push_fixed": LAMPORT, "poll_all": LAMPORT,
    "sglang_shape": LAMPORT, "nvcc": LAMPORT + GRAPH}


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


def small_layout(layout: Any) -> Any:
    """small_params' parameter: the SmallLayout words picked from the Layout value the p2p backend
    built (layout.layout_parameter), or the value itself when it is small already."""
    import numpy
    from commbench.backends.p2p.layout import LAYOUT_AREAS, LAYOUT_SCALARS, LAYOUT_WORDS, MAX_RANKS

    words = layout["words"][0]
    if len(words) != LAYOUT_WORDS:
        return layout
    areas = words[:len(LAYOUT_AREAS) * MAX_RANKS].reshape(len(LAYOUT_AREAS), MAX_RANKS)
    scalars = words[len(LAYOUT_AREAS) * MAX_RANKS:]
    picked = [*areas[LAYOUT_AREAS.index(SMALL_LAYOUT_FIELDS[0])],
              *(scalars[LAYOUT_SCALARS.index(field)] for field in SMALL_LAYOUT_FIELDS[1:])]
    value = numpy.zeros(1, dtype=numpy.dtype([("words", numpy.uint64, (len(picked),))]))
    value["words"][0] = picked
    return value


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
    from commbench.backends.p2p.layout import DTYPE_CODES
    from commbench.backends.p2p.rules import P2POptions
    from commbench.errors import UsageError

    class StudyP2P(P2PAllreduce):
        family = ENTRY_POINT

        def __init__(self, study: str, kernel: str):
            super().__init__(kernel, P2POptions(pdl=study != "nopdl"))
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
            if self.study == "small_params":
                self._area.layout = small_layout(self._area.layout)

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
