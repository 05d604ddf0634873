#!/usr/bin/env python3
"""Builds FlashInfer's communication modules ahead of time, on any machine with nvcc (no GPU
needed), into the FlashInfer tree you bring, so that the GPU machine loads them at once.

    python3 scripts/flashinfer_aot.py FLASHINFER_DIR [--arch 9.0a] [--modules LIST] [--jobs N] [--work DIR]

FLASHINFER_DIR is the `flashinfer` package folder (an unpacked wheel's, or site-packages'). Each
module is built by FlashInfer's own JIT spec (its generator, its flags, its sources: nothing of
FlashInfer is copied here) with ninja under --work, then copied to
FLASHINFER_DIR/data/aot/NAME/NAME.so: FlashInfer 0.7.4 loads a module from there before it
thinks of building one (`flashinfer/jit/env.py`, get_aot_artifacts). On the H200 the TRT-LLM
module alone took 351-428 s of a device session to build at first use.

FlashInfer's `__init__` imports every kernel family and its dependencies; only its JIT package
is loaded here, so the machine needs torch, apache-tvm-ffi, jinja2, filelock, packaging, ninja
and nvcc (CUDA_HOME, else PATH), not FlashInfer's other dependencies. A toolkit without the
driver's link stub (`lib64/stubs/libcuda.so`) gets one made from the symbols the module uses,
named libcuda.so.1, so the module still asks for the driver when it loads.
Exit status: 0 every module built, 1 one failed (its log is named), 2 bad input.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import os
import re
import shutil
import subprocess
import sys
import time
import types
from pathlib import Path

# FlashInfer module name -> its JIT spec's generator (FlashInfer 0.7.4), and who needs it here.
MODULES = {
    "trtllm_comm": ("flashinfer.jit.comm", "gen_trtllm_comm_module"),      # flashinfer:trtllm_*, fused_*
    "vllm_comm": ("flashinfer.jit.comm", "gen_vllm_comm_module"),          # vllm:* (FlashInfer's port)
    "pcie_ipc_comm": ("flashinfer.jit.comm", "gen_pcie_ipc_comm_module"),  # flashinfer:pcie_ipc
    "trtllm_utils": ("flashinfer.jit.tllm_utils", "gen_trtllm_utils_module"),  # its autotuner's delay kernel
}
ARCH_RE = re.compile(r"^\d+\.\d+[af]?$")
PYTHON_NEEDS = ("torch", "tvm_ffi", "jinja2", "filelock", "packaging")


class BadInput(Exception):
    """One line for the user; exit 2."""


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="flashinfer_aot.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("flashinfer_dir", type=Path, help="the flashinfer package folder")
    parser.add_argument("--arch", default="9.0a",
                        help="CUDA archs as FlashInfer takes them, comma-separated (default 9.0a: H100/H200)")
    parser.add_argument("--modules", default=",".join(MODULES), help=f"comma-separated, of {', '.join(MODULES)}")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="ninja jobs (default: every core)")
    parser.add_argument("--work", type=Path, default=Path("build/flashinfer-aot"), help="build folder")
    args = parser.parse_args(argv)
    package = args.flashinfer_dir
    if not (package / "jit" / "core.py").is_file() or not (package / "data" / "csrc").is_dir():
        raise BadInput(f"{package}: not a flashinfer package folder (it needs jit/core.py and data/csrc/)")
    args.modules = [m for m in args.modules.split(",") if m]
    unknown = [m for m in args.modules if m not in MODULES]
    if unknown or not args.modules:
        raise BadInput(f"--modules takes {', '.join(MODULES)}, got {','.join(unknown) or 'nothing'}")
    for arch in args.arch.split(","):
        if not ARCH_RE.match(arch.strip()):
            raise BadInput(f"--arch takes CUDA archs such as 9.0a or 8.0,9.0a, got '{args.arch}'")
    if args.jobs < 1:
        raise BadInput(f"--jobs must be 1 or more, got {args.jobs}")
    return args


def cuda_home() -> Path:
    """The toolkit whose nvcc FlashInfer's ninja file will call."""
    nvcc = shutil.which("nvcc")
    if os.environ.get("CUDA_HOME"):
        home = Path(os.environ["CUDA_HOME"])
    elif nvcc:
        home = Path(nvcc).resolve().parents[1]
    else:
        raise BadInput("nvcc not found: set CUDA_HOME or put nvcc on PATH")
    if not (home / "bin" / "nvcc").is_file():
        raise BadInput(f"{home}/bin/nvcc does not exist (CUDA_HOME)")
    if not (home / "include" / "cuda_runtime.h").is_file():
        # An nvcc on PATH that is a wrapper script (exec /usr/local/cuda-X/bin/nvcc) resolves to the
        # script's folder, whose lib64 holds no libcudart: the link would fail after the compile.
        raise BadInput(f"{home} has bin/nvcc but no include/cuda_runtime.h (is nvcc a wrapper script?): "
                       "set CUDA_HOME to the toolkit")
    return home


def check_tools() -> None:
    missing = [name for name in PYTHON_NEEDS if importlib.util.find_spec(name) is None]
    if shutil.which("ninja") is None:
        missing.append("ninja (the build tool)")
    if missing:
        raise BadInput(f"missing: {', '.join(missing)} (FlashInfer's JIT needs them to write and run its build)")


def load_jit(package: Path) -> None:
    """Make `flashinfer` and `flashinfer.jit` importable from `package` without running their
    __init__ (which imports every kernel family); their submodules then import as usual."""
    for name, folder in (("flashinfer", package), ("flashinfer.jit", package / "jit")):
        module = types.ModuleType(name)
        module.__path__ = [str(folder)]
        sys.modules[name] = module


def stub_libcuda(objects: list[Path], folder: Path) -> Path:
    """A stand-in for the driver's link stub: the cu* functions the objects call, soname
    libcuda.so.1 (the real driver is what loads at run time)."""
    undefined = subprocess.run(["nm", "-u", *map(str, objects)], capture_output=True, text=True, check=True).stdout
    symbols = sorted({m for m in re.findall(r"\bU (cu[A-Z]\w*)", undefined)})
    folder.mkdir(parents=True, exist_ok=True)
    source = folder / "libcuda_stub.c"
    source.write_text("".join(f"void {name}(void) {{}}\n" for name in symbols) or "void cuStub(void) {}\n")
    library = folder / "libcuda.so"
    subprocess.run(["gcc", "-shared", "-fPIC", "-Wl,-soname,libcuda.so.1", "-o", str(library), str(source)],
                   check=True, capture_output=True)
    return library


def build(name: str, package: Path, jobs: int, work: Path) -> tuple[bool, str]:
    """One module built by FlashInfer's own spec and copied into package/data/aot."""
    module, generator = MODULES[name]
    spec = getattr(importlib.import_module(module), generator)()
    spec.write_ninja()
    log = work / f"{name}.log"
    env = dict(os.environ)

    def ninja() -> bool:
        with open(log, "a") as out:
            return subprocess.run(["ninja", "-C", str(spec.build_dir), "-f", str(spec.ninja_path), f"-j{jobs}"],
                                  stdout=out, stderr=subprocess.STDOUT, env=env).returncode == 0

    log.write_text("")
    ok = ninja()
    if not ok and "cannot find -lcuda" in log.read_text():
        stub = stub_libcuda(sorted(Path(spec.build_dir).glob("*.o")), work / "stub")
        env["LIBRARY_PATH"] = os.pathsep.join(filter(None, [str(stub.parent), env.get("LIBRARY_PATH")]))
        ok = ninja()
    if not ok:
        lines = [line.strip() for line in log.read_text().splitlines() if line.strip()]
        first_error = next((line for line in lines if re.search(r"\berror\b", line, re.I)), lines[-1] if lines else "")
        return False, f"{first_error or 'no output'} (log: {log})"
    target = package / "data" / "aot" / name / f"{name}.so"
    target.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(spec.jit_library_path, target)
    return True, f"{target} ({target.stat().st_size / 2**20:.1f} MiB)"


def main(argv: list[str] | None = None) -> int:
    try:
        args = parse(sys.argv[1:] if argv is None else argv)
        home = cuda_home()
        check_tools()
    except BadInput as exc:
        print(f"flashinfer_aot: {exc}", file=sys.stderr)
        return 2
    package = args.flashinfer_dir.resolve()
    work = args.work.resolve()
    work.mkdir(parents=True, exist_ok=True)
    # FlashInfer reads these when its JIT package is imported: where to build, for which GPUs.
    os.environ.update(CUDA_HOME=str(home), FLASHINFER_CUDA_ARCH_LIST=args.arch.replace(",", " "),
                      FLASHINFER_WORKSPACE_BASE=str(work))
    load_jit(package)
    failed = 0
    for name in args.modules:
        start = time.monotonic()
        ok, what = build(name, package, args.jobs, work)
        failed += not ok
        print(f"{name}: {'built' if ok else 'failed'} after {time.monotonic() - start:.0f} s: {what}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
