"""scripts/flashinfer_aot.py: FlashInfer's modules built ahead of time into the tree a user brings.
A stand-in FlashInfer package (its JIT spec's contract: write_ninja, build_dir, ninja_path,
jit_library_path) builds a real shared library with gcc and ninja, linked against the driver as
FlashInfer's are; the real modules were built so for the H200 (docs/testing.md)."""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
_SPEC = importlib.util.spec_from_file_location("flashinfer_aot", ROOT / "scripts" / "flashinfer_aot.py")
aot = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(aot)

# The module's spec as FlashInfer's JitSpec exposes it, building one C file that calls the driver.
FAKE_COMM = '''
import os
from pathlib import Path


class Spec:
    def __init__(self, name):
        self.build_dir = Path(os.environ["FLASHINFER_WORKSPACE_BASE"]) / "cached_ops" / name
        self.ninja_path = self.build_dir / "build.ninja"
        self.jit_library_path = self.build_dir / f"{name}.so"

    def write_ninja(self):
        self.build_dir.mkdir(parents=True, exist_ok=True)
        source = self.build_dir / "kernel.c"
        source.write_text("int cuPointerGetAttribute(void*, int, unsigned long long);\\n"
                          "int probe(void) { return cuPointerGetAttribute(0, 0, 0); }\\n")
        obj = self.build_dir / "kernel.o"
        self.ninja_path.write_text(
            "rule cc\\n  command = gcc -fPIC -c $in -o $out\\n"
            "rule link\\n  command = gcc -shared $in -lcuda -o $out\\n"
            f"build {obj}: cc {source}\\nbuild {self.jit_library_path}: link {obj}\\n")


def gen_vllm_comm_module():
    return Spec("vllm_comm")


def gen_pcie_ipc_comm_module():
    return Spec("pcie_ipc_comm")
'''


@pytest.fixture
def package(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A flashinfer package folder whose __init__ must never run (FlashInfer's imports everything)."""
    root = tmp_path / "site" / "flashinfer"
    (root / "jit").mkdir(parents=True)
    (root / "data" / "csrc").mkdir(parents=True)
    (root / "__init__.py").write_text("raise ImportError('flashinfer/__init__ ran')\n")
    (root / "jit" / "__init__.py").write_text("raise ImportError('flashinfer/jit/__init__ ran')\n")
    (root / "jit" / "core.py").write_text("")
    (root / "jit" / "comm.py").write_text(FAKE_COMM)
    for name in [n for n in sys.modules if n == "flashinfer" or n.startswith("flashinfer.")]:
        monkeypatch.delitem(sys.modules, name)
    yield root
    for name in [n for n in sys.modules if n == "flashinfer" or n.startswith("flashinfer.")]:
        del sys.modules[name]


@pytest.mark.parametrize("args, line", [
    (["--modules", "trtllm_comm,nccl_comm"],
     "--modules takes trtllm_comm, vllm_comm, pcie_ipc_comm, trtllm_utils, got nccl_comm"),
    (["--arch", "sm_90"], "--arch takes CUDA archs such as 9.0a or 8.0,9.0a, got 'sm_90'"),
    (["--jobs", "0"], "--jobs must be 1 or more, got 0"),
])
def test_bad_flags_are_one_line_and_exit_2(package, args, line, capsys) -> None:
    assert aot.main([str(package), *args]) == 2
    assert capsys.readouterr().err == f"flashinfer_aot: {line}\n"


def test_a_folder_that_is_not_flashinfer_is_refused(tmp_path, capsys) -> None:
    assert aot.main([str(tmp_path)]) == 2
    assert capsys.readouterr().err == (f"flashinfer_aot: {tmp_path}: not a flashinfer package folder "
                                       "(it needs jit/core.py and data/csrc/)\n")


def test_without_nvcc_it_says_so(package, monkeypatch, capsys) -> None:
    monkeypatch.delenv("CUDA_HOME", raising=False)
    monkeypatch.setenv("PATH", str(package))   # no nvcc there
    assert aot.main([str(package)]) == 2
    assert capsys.readouterr().err == "flashinfer_aot: nvcc not found: set CUDA_HOME or put nvcc on PATH\n"


def test_an_nvcc_wrapper_outside_the_toolkit_asks_for_cuda_home(package, tmp_path, monkeypatch, capsys) -> None:
    wrapper = tmp_path / "usr" / "bin" / "nvcc"     # as an image's /usr/local/bin/nvcc: exec the real one
    wrapper.parent.mkdir(parents=True)
    wrapper.write_text("#!/bin/sh\nexec /opt/cuda/bin/nvcc \"$@\"\n")
    wrapper.chmod(0o755)
    monkeypatch.delenv("CUDA_HOME", raising=False)
    monkeypatch.setenv("PATH", str(wrapper.parent))
    assert aot.main([str(package)]) == 2
    assert capsys.readouterr().err == (f"flashinfer_aot: {tmp_path / 'usr'} has bin/nvcc but no "
                                       "include/cuda_runtime.h (is nvcc a wrapper script?): set CUDA_HOME to the "
                                       "toolkit\n")


def test_flashinfers_jit_package_loads_without_its_init(package) -> None:
    aot.load_jit(package)
    comm = importlib.import_module("flashinfer.jit.comm")
    assert Path(comm.__file__) == package / "jit" / "comm.py"
    assert callable(comm.gen_vllm_comm_module)


@pytest.mark.procs
@pytest.mark.skipif(any(shutil.which(tool) is None for tool in ("gcc", "nm", "ninja", "readelf")),
                    reason="needs gcc, nm, ninja and readelf")
def test_each_module_lands_in_data_aot_and_still_needs_the_driver(package, tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("FLASHINFER_WORKSPACE_BASE", str(tmp_path / "work"))
    monkeypatch.delenv("LIBRARY_PATH", raising=False)
    aot.load_jit(package)
    (tmp_path / "work").mkdir()
    for name in ("vllm_comm", "pcie_ipc_comm"):
        ok, what = aot.build(name, package, 1, tmp_path / "work")
        built = package / "data" / "aot" / name / f"{name}.so"
        assert ok and what.startswith(str(built)), what
        needed = subprocess.run(["readelf", "-d", str(built)], capture_output=True, text=True, check=True).stdout
        assert "[libcuda.so.1]" in needed
    stub = tmp_path / "work" / "stub" / "libcuda.so"
    if stub.exists():   # this machine's linker had no libcuda: the stand-in holds what the module calls
        symbols = subprocess.run(["nm", "-D", "--defined-only", str(stub)], capture_output=True, text=True).stdout
        assert " T cuPointerGetAttribute" in symbols


@pytest.mark.procs
@pytest.mark.skipif(any(shutil.which(tool) is None for tool in ("gcc", "ninja")), reason="needs gcc and ninja")
def test_a_module_that_does_not_compile_is_named_with_its_first_error(package, tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("FLASHINFER_WORKSPACE_BASE", str(tmp_path / "work"))
    (package / "jit" / "comm.py").write_text(FAKE_COMM.replace("int probe(void)", "int probe(void) missing_type x;"))
    aot.load_jit(package)
    (tmp_path / "work").mkdir()
    ok, what = aot.build("vllm_comm", package, 1, tmp_path / "work")
    assert not ok and "error" in what and what.endswith(f"(log: {tmp_path / 'work' / 'vllm_comm.log'})"), what
    assert not (package / "data" / "aot").exists()
