#!/usr/bin/env python3
"""Our kernels against SGLang's kernels of the same algorithm, compiled and disassembled, no GPU:
static analysis (registers, parameter bytes, the instructions of the path), never a time.

    python3 scripts/p2p_kernel_static.py --sglang SGLANG_DIR --tvm-ffi-include DIR [--pair push|pull] \\
        [--cuobjdump PATH] [--nvrtc LIBNVRTC] [--worlds 2,4,8] [--keep DIR]

SGLANG_DIR is an installed or unpacked `sglang` package (it holds kernels/jit/); DIR is the
include folder of the apache-tvm-ffi that SGLang pins (its JIT kernels include tvm/ffi headers).
--pair push (the default): our Lamport one-shot (`p2p_ll_oneshot`) against SGLang's one-shot
push; --pair pull: our graph one-shot (`p2p_oneshot_graph`) against SGLang's one-shot pull as a
CUDA graph runs it (its pointer-table variant). Each build is bf16 at each world size:

- `p2p nvrtc`: backends/p2p/allreduce.cu through NVRTC (--nvrtc, the libnvrtc.so CuPy would
  load) with the options CuPy's RawModule gives it for kernels.py;
- `p2p nvcc`: the same source and options through nvcc (scripts/p2p_kernel_study.py's `nvcc`);
- `p2p nvcc+sglang flags`: the same source with the flags SGLang's JIT passes nvcc on an H200;
- `p2p STUDY`: a study variant's source (scripts/p2p_kernel_study.py; push: own_slot_always,
  own_slot_never; pull: graph_plain_loads, bf16_int, graph_all_read, unroll_every_world,
  unroll_none), NVRTC's options, through nvcc;
- `sglang 1shot_push` / `sglang 1shot_pull (graph)`: SGLang's kernel, built as SGLang's JIT
  builds its custom_all_reduce module (its wrapper unit, its flags), read from SGLANG_DIR.

The table is read from cuobjdump (`-res-usage` and `-sass`): registers, stack and local bytes,
constant bank 0 (the kernel parameter starts at c[0x0][0x210] on sm_90, so parameter bytes are
cmem[0] - 528), the SASS count, then in program order:

- push: the instructions before the first 16-byte system-scope store (the first push to a peer)
  with the loads, indexed constant loads, barriers and branches among them, from the first push
  to the last and from there to the first poll (16-byte system-scope load), then the pushes,
  polls, fences and atomics of the whole kernel;
- pull: the instructions before the first 16-byte load (the first peer read) with the global
  loads before and after the PDL wait, the barriers, atomics and 32-bit system-scope loads among
  them, the global loads from the last barrier to that read (on the path), the peer reads, the
  instructions from the first read to the 16-byte store with the bf16 packs (F2FP) among them,
  the store, from the store to the end (the second barrier), and where the PDL trigger sits.

A small call runs each loop once per thread, so program order is close to the path it takes;
code for cold paths (timeouts) is counted where the compiler placed it.
"""

from __future__ import annotations

import argparse
import ctypes
import importlib.util
import re
import shutil
import subprocess
import sys
import tempfile
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

HERE = Path(__file__).resolve()
KERNEL_SOURCE = HERE.parent.parent / "backends" / "p2p" / "allreduce.cu"
BF16 = 2                      # allreduce.cu's dtype code
PARAM_BASE = 0x210            # sm_90: c[0x0][0x210] is the first parameter byte
ARCH = "sm_90"                # what CuPy asks NVRTC for on an H100/H200 (compute capability 9.0)
# sglang/kernels/jit/utils: arch.get_default_target_flags, toolchain.target_flags/base_cuda_flags
SGLANG_FLAGS = ("-Xcompiler", "-fPIC", "-gencode=arch=compute_90a,code=sm_90a", "-DSGL_CUDA_ARCH=900",
                "-std=c++20", "-O3", "--expt-relaxed-constexpr")
# What SGLang's JIT prepends to its wrapper unit (sglang/kernels/jit/utils/compile/spec.py).
SGLANG_FFI_INCLUDES = ("tvm/ffi/container/tensor.h", "tvm/ffi/dtype.h", "tvm/ffi/error.h",
                       "tvm/ffi/extra/c_env_api.h", "tvm/ffi/function.h")
SGLANG_SOURCE = Path("kernels/jit/csrc/distributed/custom_all_reduce.cuh")
# The study variants of the Lamport one-shot shown (scripts/p2p_kernel_study.py).
STUDIES = ("own_slot_always", "own_slot_never")
# ... and of the graph one-shot.
GRAPH_STUDIES = ("graph_plain_loads", "bf16_int", "graph_all_read", "unroll_every_world", "unroll_none")
NVRTC_OPTIONS = ("--std=c++17", "-ftz=true", f"-arch={ARCH}", "--device-as-default-execution-space")

_INSTRUCTION = re.compile(r"/\*[0-9a-f]{4,}\*/\s+(.*?)\s*;")
PUSH, POLL = "STG.E.128.STRONG.SYS", "LDG.E.128.STRONG.SYS"
POLL_32 = "LDG.E.STRONG.SYS"   # a 32-bit system-scope load: a call count, an abort word, a barrier's poll


class BadInput(Exception):
    """One line for the user, exit 2."""


def _study():
    spec = importlib.util.spec_from_file_location("p2p_kernel_study_static", HERE.with_name("p2p_kernel_study.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@dataclass(frozen=True)
class SassCounts:
    instructions: int
    before_push: int               # instructions before the first push to a peer
    loads_before_push: int         # global loads (LDG) among them
    indexed_constants_before_push: int   # LDC c[0x0][Rn + x]: the address depends on a register
    barriers_before_push: int
    branches_before_push: int
    push_span: int                 # instructions from the first push to the last
    push_to_poll: int              # instructions from the last push to the first poll
    pushes: int
    polls: int
    fences: int
    atomics: int


def _opcodes(sass: str) -> list[str]:
    """One function's SASS opcodes with their operands, in program order, predicates and NOPs dropped."""
    ops = [re.sub(r"^@!?U?P\w+\s+", "", m.group(1)) for m in _INSTRUCTION.finditer(sass)]
    ops = [op for op in ops if not op.startswith("NOP")]
    if not ops:
        raise BadInput("no SASS instructions in the disassembly")
    return ops


def sass_counts(sass: str) -> SassCounts:
    """The counts of one push kernel's SASS text (cuobjdump -sass -fun), in program order."""
    opcode = _opcodes(sass)
    pushes = [i for i, op in enumerate(opcode) if op.startswith(PUSH)] or [len(opcode)]
    push, last_push = pushes[0], pushes[-1]
    poll = next((i for i, op in enumerate(opcode) if op.startswith(POLL)), len(opcode))
    head = opcode[:push]
    return SassCounts(
        instructions=len(opcode), before_push=push,
        loads_before_push=sum(op.startswith("LDG") for op in head),
        indexed_constants_before_push=sum(bool(re.match(r"U?LDC\S* \S+, c\[0x0\]\[U?R", op)) for op in head),
        barriers_before_push=sum(op.startswith("BAR") for op in head),
        branches_before_push=sum(op.startswith("BRA") for op in head),
        push_span=last_push - push, push_to_poll=max(0, poll - last_push), pushes=sum(op.startswith(PUSH) for op in opcode),
        polls=sum(op.startswith(POLL) for op in opcode), fences=sum(op.startswith("MEMBAR") for op in opcode),
        atomics=sum(op.startswith(("ATOM", "RED")) for op in opcode))


@dataclass(frozen=True)
class PullCounts:
    instructions: int
    before_load: int             # instructions before the first 16-byte load (the first peer read)
    loads_before_wait: int       # global loads before the PDL wait (ACQBULK)
    loads_after_wait: int        # global loads after it, before the first peer read
    barriers_before_load: int
    atomics_before_load: int
    strong_before_load: int      # 32-bit system-scope loads: call counts, the abort word, the barrier's polls
    loads_after_barrier: int     # global loads from the last barrier to the first peer read: on the path
    peer_loads: str              # the 16-byte loads of the kernel: count and opcode
    load_to_store: int           # instructions from the first peer read to the 16-byte store
    packs: int                   # F2FP: hardware float-to-bf16 packing
    store: str
    after_store: int             # instructions from the store to the end (the second barrier)
    atomics_after_store: int
    strong_after_store: int
    trigger: str                 # where the PDL trigger (PREEXIT) sits


def pull_counts(sass: str) -> PullCounts:
    """The counts of one pull kernel's SASS text (cuobjdump -sass -fun), in program order."""
    ops = _opcodes(sass)
    wide = [i for i, op in enumerate(ops) if re.match(r"LDG?\.E\.128\b", op)]
    stores = [i for i, op in enumerate(ops) if re.match(r"STG?\.E\.128\b", op)]
    if not wide or not stores:
        raise BadInput("no 16-byte load and store in the disassembly: not a pull kernel")
    load, store = wide[0], stores[0]
    wait = next((i for i, op in enumerate(ops) if op.startswith("ACQBULK")), 0)
    trigger = next((i for i, op in enumerate(ops) if op.startswith("PREEXIT")), None)

    def loads(lo: int, hi: int) -> int:
        return sum(bool(re.match(r"LDG?\.E\b", op)) and not op.startswith(POLL_32) and i not in wide
                   for i, op in enumerate(ops[lo:hi], lo))

    def count(lo: int, hi: int, prefixes: tuple[str, ...]) -> int:
        return sum(op.startswith(prefixes) for op in ops[lo:hi])

    return PullCounts(
        instructions=len(ops), before_load=load, loads_before_wait=loads(0, wait), loads_after_wait=loads(wait, load),
        barriers_before_load=count(0, load, ("BAR",)), atomics_before_load=count(0, load, ("ATOM", "RED")),
        strong_before_load=sum(op.split()[0] == POLL_32 for op in ops[:load]),
        loads_after_barrier=loads(max((i for i, op in enumerate(ops[:load]) if op.startswith("BAR")), default=0), load),
        peer_loads=", ".join(f"{n} {name}" for name, n in Counter(ops[i].split()[0] for i in wide).items()),
        load_to_store=store - load,
        packs=count(load, store, ("F2FP",)), store=ops[store].split()[0], after_store=len(ops) - store - 1,
        atomics_after_store=count(store, len(ops), ("ATOM", "RED")),
        strong_after_store=sum(op.split()[0] == POLL_32 for op in ops[store:]),
        trigger="none" if trigger is None else "before the peer reads" if trigger < load else "after the store")


def resource_usage(text: str, function: str) -> dict[str, int]:
    """REG, STACK, LOCAL and CONSTANT[0] of one function from `cuobjdump -res-usage`."""
    lines = text.splitlines()
    for i, line in enumerate(lines):
        if line.strip() == f"Function {function}:" and i + 1 < len(lines):
            return {k: int(v) for k, v in re.findall(r"(\w+(?:\[0\])?):(\d+)", lines[i + 1])}
    raise BadInput(f"cuobjdump names no function {function}")


def _run(command: list[str]) -> str:
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode:
        raise BadInput(f"{' '.join(command[:2])} ... exited {done.returncode}: {done.stderr.strip()[-300:]}")
    return done.stdout


def nvrtc_cubin(library: Path, source: Path, expression: str, out: Path) -> str:
    """NVRTC as CuPy drives it (one program, a name expression, CuPy's options): the cubin in
    `out` and the lowered name."""
    try:
        nvrtc = ctypes.CDLL(str(library))
    except OSError as exc:
        raise BadInput(f"--nvrtc {library}: {exc}") from None
    program = ctypes.c_void_p()
    nvrtc.nvrtcCreateProgram(ctypes.byref(program), source.read_bytes(), b"kern.cu", 0, None, None)
    nvrtc.nvrtcAddNameExpression(program, expression.encode())
    options = (ctypes.c_char_p * len(NVRTC_OPTIONS))(*(o.encode() for o in NVRTC_OPTIONS))
    size = ctypes.c_size_t()
    if nvrtc.nvrtcCompileProgram(program, len(NVRTC_OPTIONS), options):
        nvrtc.nvrtcGetProgramLogSize(program, ctypes.byref(size))
        log = ctypes.create_string_buffer(size.value)
        nvrtc.nvrtcGetProgramLog(program, log)
        raise BadInput(f"NVRTC failed: {log.value.decode(errors='replace').strip()[-300:]}")
    nvrtc.nvrtcGetCUBINSize(program, ctypes.byref(size))
    cubin = ctypes.create_string_buffer(size.value)
    nvrtc.nvrtcGetCUBIN(program, cubin)
    out.write_bytes(cubin.raw)
    lowered = ctypes.c_char_p()
    nvrtc.nvrtcGetLoweredName(program, expression.encode(), ctypes.byref(lowered))
    return lowered.value.decode()


def sglang_cubin(sglang: Path, tvm_include: Path, nranks: int, workdir: Path) -> Path:
    """SGLang's custom_all_reduce module for bf16 and this world size, as its JIT compiles it."""
    unit = workdir / f"sglang_all_reduce_{nranks}.cu"
    unit.write_text("".join(f"#include <{h}>\n" for h in SGLANG_FFI_INCLUDES)
                    + f'#include "{sglang / SGLANG_SOURCE}"\n'
                    + "namespace sglang {\nTVM_FFI_DLL_EXPORT_TYPED_FUNC(all_reduce, "
                    + f"(AllReduceKernel<bf16_t, {nranks}, true>::run));\n}}\n")
    cubin = unit.with_suffix(".cubin")
    dlpack = tvm_include.parent / "3rdparty" / "dlpack" / "include"
    _run(["nvcc", "-cubin", *SGLANG_FLAGS, f"-I{sglang / 'kernels/jit/include'}", f"-I{tvm_include}",
          f"-I{dlpack}", "-o", str(cubin), str(unit)])
    return cubin


def push_cells(sass: str) -> list[str]:
    counts = sass_counts(sass)
    return [f"{counts.instructions}", f"{counts.before_push}, {counts.loads_before_push}, "
            f"{counts.indexed_constants_before_push}, {counts.barriers_before_push}, {counts.branches_before_push}",
            f"{counts.push_span}", f"{counts.push_to_poll}", f"{counts.pushes}", f"{counts.polls}", f"{counts.fences}",
            f"{counts.atomics}"]


def pull_cells(sass: str) -> list[str]:
    c = pull_counts(sass)
    return [f"{c.instructions}", f"{c.before_load}, {c.loads_before_wait}, {c.loads_after_wait}, {c.barriers_before_load}, "
            f"{c.atomics_before_load}, {c.strong_before_load}", f"{c.loads_after_barrier}", c.peer_loads,
            f"{c.load_to_store}, {c.packs}", c.store, f"{c.after_store}, {c.atomics_after_store}, {c.strong_after_store}",
            c.trigger]


@dataclass(frozen=True)
class Pair:
    """One of our kernels against SGLang's kernel of the same algorithm."""
    kernel: str                 # the allreduce.cu template
    studies: tuple[str, ...]    # scripts/p2p_kernel_study.py's variants of it shown
    sglang: str                 # SGLang's row
    sglang_function: str        # a pattern its mangled name in SGLang's module matches
    columns: str                # the header's cells from the SASS count on
    cells: Callable[[str], list[str]]


PAIRS = {
    "push": Pair("p2p_ll_oneshot", STUDIES, "sglang 1shot_push", r"all_reduce_1shot_push_kernel",
                 "SASS | before the first push: instructions, loads, indexed constant loads, barriers, branches | "
                 "first to last push | last push to first poll | pushes | polls | fences | atomics", push_cells),
    # SGLang's graph one-shot pull: LoadStoreImpl<..., kUseGraph = true>, whose pointers come from a table
    "pull": Pair("p2p_oneshot_graph", GRAPH_STUDIES, "sglang 1shot_pull (graph)",
                 r"all_reduce_1shot_pull_kernelINS_13LoadStoreImpl.*?Lb1EEE\d+__nv_bfloat16",
                 "SASS | before the first peer read: instructions, global loads before the PDL wait, after it, "
                 "barriers, atomics, 32-bit system-scope loads | global loads from the last barrier to the first peer "
                 "read | peer reads | first peer read to the store: instructions, bf16 packs (F2FP) | the store | "
                 "store to the end: instructions, atomics, 32-bit system-scope loads | PDL trigger", pull_cells),
}


def builds(args: argparse.Namespace, pair: Pair, nranks: int, workdir: Path) -> list[tuple[str, Path, str]]:
    """(build, cubin, function) for every build at this world size."""
    study = _study()
    shipped = KERNEL_SOURCE.read_text()
    made = []
    for build, name, flags in (("p2p nvcc", "base", study.nvrtc_options(ARCH)),
                               ("p2p nvcc+sglang flags", "base", SGLANG_FLAGS),
                               *((f"p2p {name}", name, study.nvrtc_options(ARCH)) for name in pair.studies)):
        folder = workdir / f"{re.sub(r'[^a-z0-9_]', '_', build)}_{pair.kernel}_{nranks}"
        folder.mkdir()
        source = folder / f"{name}.cu"
        source.write_text(study.patched(shipped, name))
        cubin, mangled = study.nvcc_cubin(source, [pair.kernel], BF16, nranks, flags, folder)
        made.append((build, cubin, mangled[pair.kernel]))
        if args.nvrtc and build == "p2p nvcc":
            cubin = workdir / f"nvrtc_{pair.kernel}_{nranks}.cubin"
            made.append(("p2p nvrtc", cubin, nvrtc_cubin(args.nvrtc, KERNEL_SOURCE,
                                                         f"{pair.kernel}<{BF16}, {nranks}>", cubin)))
    cubin = sglang_cubin(args.sglang, args.tvm_ffi_include, nranks, workdir)
    usage = _run([args.cuobjdump, "-res-usage", str(cubin)])
    function = next((m for m in re.findall(r"Function (\S+):", usage) if re.search(pair.sglang_function, m)), None)
    if function is None:
        raise BadInput(f"{args.sglang / SGLANG_SOURCE} built no {pair.sglang}")
    made.append((pair.sglang, cubin, function))
    return made


def table(args: argparse.Namespace, workdir: Path) -> list[str]:
    pair = PAIRS[args.pair]
    header = f"| build | ranks | registers | stack+local bytes | cmem[0] (parameter) bytes | {pair.columns} | SASS as `p2p nvcc` |"
    lines = [header, "|---" * (header.count(" | ") + 1) + "|"]
    for nranks in args.worlds:
        reference = None
        for build, cubin, function in builds(args, pair, nranks, workdir):
            usage = resource_usage(_run([args.cuobjdump, "-res-usage", str(cubin)]), function)
            sass = _run([args.cuobjdump, "-sass", "-fun", function, str(cubin)])
            listing = [m.group(1) for m in _INSTRUCTION.finditer(sass)]
            if build == "p2p nvcc":
                reference = listing
            same = "-" if not build.startswith("p2p ") or build == "p2p nvcc" else (
                "identical" if listing == reference else
                f"{sum(a != b for a, b in zip(listing, reference)) + abs(len(listing) - len(reference))} lines differ")
            cmem = usage.get("CONSTANT[0]", 0)
            lines.append(f"| {build} | {nranks} | {usage.get('REG')} | {usage.get('STACK', 0) + usage.get('LOCAL', 0)} | "
                         f"{cmem} ({cmem - PARAM_BASE}) | " + " | ".join(pair.cells(sass)) + f" | {same} |")
    return lines


def _worlds(text: str) -> list[int]:
    try:
        worlds = [int(w) for w in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a list of world sizes: {text!r}") from None
    if not worlds or any(w not in (2, 4, 8) for w in worlds):
        raise argparse.ArgumentTypeError(f"world sizes are 2, 4 or 8: {text!r}")
    return worlds


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sglang", type=Path, required=True, help="the sglang package folder (holds kernels/jit/)")
    parser.add_argument("--tvm-ffi-include", type=Path, required=True, help="apache-tvm-ffi's include folder")
    parser.add_argument("--cuobjdump", default="cuobjdump")
    parser.add_argument("--nvrtc", type=Path, help="libnvrtc.so to build the NVRTC row with (as CuPy would)")
    parser.add_argument("--pair", choices=sorted(PAIRS), default="push",
                        help="push: our Lamport one-shot against SGLang's one-shot push; pull: our graph one-shot "
                             "against SGLang's graph one-shot pull")
    parser.add_argument("--worlds", type=_worlds, default=[2, 4, 8])
    parser.add_argument("--keep", type=Path, help="keep the sources and cubins in this folder")
    args = parser.parse_args(argv)
    try:
        if not (args.sglang / SGLANG_SOURCE).is_file():
            raise BadInput(f"--sglang {args.sglang}: no {SGLANG_SOURCE} there")
        if not (args.tvm_ffi_include / "tvm" / "ffi" / "function.h").is_file():
            raise BadInput(f"--tvm-ffi-include {args.tvm_ffi_include}: no tvm/ffi/function.h there")
        for tool in ("nvcc", args.cuobjdump):
            if shutil.which(tool) is None:
                raise BadInput(f"{tool} is not on PATH (nor a program at that path)")
        if args.keep:
            args.keep.mkdir(parents=True, exist_ok=True)
            print("\n".join(table(args, args.keep)))
        else:
            with tempfile.TemporaryDirectory(prefix="p2p-static-") as workdir:
                print("\n".join(table(args, Path(workdir))))
    except (BadInput, RuntimeError, OSError) as exc:
        print(f"p2p_kernel_static: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
