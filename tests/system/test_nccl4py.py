"""The optional nccl4py backend on the CPU: its readable reason when nccl4py is missing or
broken, the facts rows record from nccl4py's own version report, and its bad input. Its calls
need a GPU (tests/gpu/test_nccl_gpu.py)."""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from commbench import backends
from commbench.backends.base import SweepFacts
from commbench.backends import nccl4py
from commbench.errors import UsageError
from helpers import only_run_dir, rows, run_cli


@pytest.fixture
def no_nccl_module(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in [m for m in sys.modules if m == "nccl" or m.startswith("nccl.")]:
        monkeypatch.delitem(sys.modules, name)


def test_missing_nccl4py_is_a_readable_reason(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                             no_nccl_module: None) -> None:
    monkeypatch.setattr(sys, "path", [str(tmp_path)] + [p for p in sys.path if "site-packages" not in p])
    assert nccl4py.REQUIRES.reason() == "nccl4py not installed (pip install nccl4py)"
    assert backends.expand(["nccl4py"], backends.Options(), True)[0].software_reason() == "nccl4py not installed (pip install nccl4py)"


def test_a_broken_nccl4py_says_what_failed(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                           no_nccl_module: None) -> None:
    core = tmp_path / "nccl" / "core"
    core.mkdir(parents=True)
    (tmp_path / "nccl" / "__init__.py").write_text("")
    (core / "__init__.py").write_text("raise ImportError('cuda.core is required')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert nccl4py.REQUIRES.reason() == "nccl4py is installed but does not import: ImportError: cuda.core is required"


def test_rows_record_nccl4py_and_the_nccl_it_reports() -> None:
    report = SimpleNamespace(nccl4py="0.6.0", nccl_bindings="2.30.3",
                             libnccl=SimpleNamespace(version="2.30.3", path=Path("/w/nvidia/nccl/lib/libnccl.so.2")))
    fake = SimpleNamespace(get_version=lambda: report)
    assert nccl4py.library_facts(fake) == {"nccl4py": "0.6.0", "nccl4py_bindings": "2.30.3",
                                           "nccl_version_loaded": "2.30.3",
                                           "nccl_lib_loaded": "/w/nvidia/nccl/lib/libnccl.so.2"}
    report.libnccl = None    # nccl4py could not load a libnccl
    assert nccl4py.library_facts(fake)["nccl_version_loaded"] is None


def test_the_family_has_one_variant_and_logs_into_the_run_dir(tmp_path: Path) -> None:
    (backend,) = backends.expand(["nccl4py"], backends.Options(SweepFacts(run_dir=tmp_path)), True)
    assert backend.name == "nccl4py" and backend.log_dir == tmp_path / "nccl-logs" and backend.in_place
    quiet = backends.Options(SweepFacts(run_dir=tmp_path), {"nccl4py": nccl4py.Nccl4pyOptions(log=False)})
    assert backends.expand(["nccl4py"], quiet, True)[0].log_dir is None
    with pytest.raises(UsageError, match="nccl4py: unknown variant 'fast'"):
        backends.expand(["nccl4py:fast"], backends.Options(), True)


@pytest.mark.procs
def test_a_cpu_sweep_skips_nccl4py_with_its_reason(tmp_path: Path) -> None:
    result = run_cli(["sweep", "--cpu", "--no-probe", "--sizes", "1K", "--backends", "nccl4py,gloo",
                      "--out", str(tmp_path)], timeout=180)
    assert result.returncode == 0, result.stdout + result.stderr
    got = rows(only_run_dir(tmp_path))
    skipped = [r for r in got if r["backend"] == "nccl4py"]
    assert skipped and all(r["status"] == "skipped" and r["reason"] == "needs CUDA GPUs; this run is on the CPU"
                           for r in skipped)
    assert any(r["backend"] == "gloo" and r["status"] in ("ok", "no_work") for r in got)
