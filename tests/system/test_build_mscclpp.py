"""scripts/build-mscclpp.sh's C++ runtime check, on a compiler that links libstdc++ statically:
a libmscclpp built so crashed in its TCP bootstrap beside torch and CuPy (docs/mscclpp.md)."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "build-mscclpp.sh"

pytestmark = [pytest.mark.procs,   # every test here launches processes
              pytest.mark.skipif(shutil.which("g++") is None or shutil.which("ldd") is None, reason="needs g++ and ldd")]


@pytest.fixture
def checkout(tmp_path: Path) -> Path:
    """What the script looks for before building: enough to reach its prerequisite checks."""
    src = tmp_path / "mscclpp"
    (src / "src" / "ext" / "nccl").mkdir(parents=True)
    (src / "CMakeLists.txt").write_text("")
    (src / "pyproject.toml").write_text("")
    (src / "VERSION").write_text("0.9.0\n")
    (src / "src" / "ext" / "nccl" / "CMakeLists.txt").write_text("add_library(mscclpp_nccl SHARED nccl.cc)\n")
    return src


@pytest.fixture
def static_gxx(tmp_path: Path) -> Path:
    wrapper = tmp_path / "bin" / "static-g++"
    wrapper.parent.mkdir()
    wrapper.write_text(f'#!/bin/sh\nexec {shutil.which("g++")} "$@" -static-libstdc++\n')
    wrapper.chmod(0o755)
    return wrapper


def build(checkout: Path, tmp_path: Path, **env: str) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items() if k not in ("CXX", "MSCCLPP_CXX", "CUDAHOSTCXX")}
    return subprocess.run(["bash", str(SCRIPT), str(checkout), str(tmp_path / "out")], capture_output=True,
                          text=True, timeout=120, env={**clean, "MSCCLPP_STEPS": "shim", **env})


def test_a_compiler_chosen_by_name_that_links_libstdcxx_statically_is_refused(checkout, tmp_path, static_gxx):
    result = build(checkout, tmp_path, MSCCLPP_CXX=str(static_gxx))
    assert result.returncode == 2
    assert (f"missing: C++ compiler: {static_gxx} links libstdc++ statically (or cannot link a shared library): "
            "set MSCCLPP_CXX to one that links the shared libstdc++") in result.stderr.splitlines()


def test_cxx_that_links_libstdcxx_statically_gives_way_to_one_on_path_that_does_not(checkout, tmp_path, static_gxx):
    result = build(checkout, tmp_path, CXX=str(static_gxx))
    chosen = [line for line in result.stdout.splitlines() if line.startswith("   C++ ")]
    assert len(chosen) == 1 and chosen[0].endswith(", shared libstdc++)"), result.stdout
    assert str(static_gxx) not in chosen[0]
    assert "C++ compiler" not in result.stderr     # whatever else this machine lacks, not that


@pytest.fixture
def old_setuptools_scm(tmp_path: Path) -> dict[str, str]:
    """An installed setuptools-scm 8.3.1 as Python sees it (its metadata, first on the path)."""
    site = tmp_path / "site"
    (site / "setuptools_scm-8.3.1.dist-info").mkdir(parents=True)
    (site / "setuptools_scm-8.3.1.dist-info" / "METADATA").write_text("Metadata-Version: 2.1\nName: setuptools-scm\nVersion: 8.3.1\n")
    return {"PYTHONPATH": str(site), "MSCCLPP_STEPS": "wheel"}


def imports_commit_id(checkout: Path) -> None:
    (checkout / "python" / "mscclpp").mkdir(parents=True)
    (checkout / "python" / "mscclpp" / "__init__.py").write_text("from ._version import __version__, __commit_id__\n")


def scm_lines(result: subprocess.CompletedProcess) -> list[str]:
    return [line for line in result.stderr.splitlines() if line.startswith("missing: python: setuptools-scm")]


def test_setuptools_scm_8_is_refused_for_a_checkout_that_imports_commit_id(checkout, tmp_path, old_setuptools_scm):
    # 8.x writes no __commit_id__: MSCCL++ 0.9.0's wheel built with it failed at `import mscclpp`.
    imports_commit_id(checkout)
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    (wheels / "setuptools_scm-8.2.0-py3-none-any.whl").write_bytes(b"")
    result = build(checkout, tmp_path, MSCCLPP_WHEELS_DIR=str(wheels), **old_setuptools_scm)
    assert result.returncode == 2
    (line,) = scm_lines(result)
    assert line.startswith("missing: python: setuptools-scm 8.3.1 (installed for python3) and 8.2.0 ("), line
    assert "imports __commit_id__, which setuptools-scm writes into _version.py only from version 9 on" in line


def test_a_newer_setuptools_scm_wheel_stands_in_for_an_old_installed_one(checkout, tmp_path, old_setuptools_scm):
    imports_commit_id(checkout)
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    for name in ("setuptools_scm-8.3.1-py3-none-any.whl", "setuptools_scm-9.2.2-py3-none-any.whl"):
        (wheels / name).write_bytes(b"")
    assert scm_lines(build(checkout, tmp_path, MSCCLPP_WHEELS_DIR=str(wheels), **old_setuptools_scm)) == []
    # A checkout that does not import it (older MSCCL++) builds with 8.x as before.
    (checkout / "python" / "mscclpp" / "__init__.py").write_text("from ._version import __version__\n")
    assert scm_lines(build(checkout, tmp_path, **old_setuptools_scm)) == []
