"""The built wheel works like the editable install: built offline, installed into a fresh
virtual environment and run from outside the source tree, so that anything read at run time
relative to the checkout, instead of from package data, fails here.

The fresh venv gets the test environment's own site-packages through a .pth file (torch and
the other dependencies come from there, and nothing is downloaded). A .pth line only puts
that directory on sys.path: the .pth files inside it, among them the editable install's
finder that points at this checkout, are not run, so `commbench` can only come from the wheel.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from importlib import metadata
from pathlib import Path

import pytest
from packaging.version import Version  # pytest's own dependency

# Every test here launches processes, and they share a wheel built and installed once (~30 s).
pytestmark = [pytest.mark.procs, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]
# The first setuptools that builds a wheel without the `wheel` package; the test extra's pin.
SETUPTOOLS_MIN = "70.1"
# The source directories that become the package (pyproject's package-dir), and what they
# become inside it.
PACKAGE_DIRS = {"commbench": "commbench", "backends": "commbench/backends", "topology": "commbench/topology"}
# Copied to build from: the source without anything a checkout may have lying around.
_NOT_SOURCE_ANYWHERE = shutil.ignore_patterns(".git", ".venv", "venv", "build", "dist", "*.egg-info", "__pycache__",
                                              ".pytest_cache", "gpu-logs", ".whl", ".device")
_NOT_SOURCE_TOP = {"results", "tests", "docs"}   # top-level folders only: commbench/results is the package


def NOT_SOURCE(folder: str, names: list[str]) -> set[str]:
    ignored = set(_NOT_SOURCE_ANYWHERE(folder, names))
    return ignored | (_NOT_SOURCE_TOP & set(names)) if Path(folder) == REPO else ignored


def run(argv: list[str], cwd: Path, timeout: float = 300) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env.setdefault("OMP_NUM_THREADS", "1")
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    done = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, f"{argv} exited {done.returncode}\n{done.stdout[-4000:]}\n{done.stderr[-4000:]}"
    return done


def runtime_files() -> set[str]:
    """Every file but Python source in the package's source directories, as package paths."""
    out = set()
    for src, pkg in PACKAGE_DIRS.items():
        for path in (REPO / src).rglob("*"):
            if path.is_file() and path.suffix not in (".py", ".pyc") and "__pycache__" not in path.parts:
                out.add(f"{pkg}/{path.relative_to(REPO / src).as_posix()}")
    return out


def require_setuptools() -> None:
    """Fails, never skips: a skip here would let CI go green without building the wheel."""
    try:
        found = metadata.version("setuptools")
    except metadata.PackageNotFoundError:
        found = None
    if found is None or Version(found) < Version(SETUPTOOLS_MIN):
        pytest.fail(f"building the wheel offline (--no-build-isolation) needs setuptools>={SETUPTOOLS_MIN}, "
                    f"found {found}: pip install -e \".[test]\"", pytrace=False)


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> dict:
    """Build the wheel offline, install it into a fresh venv; the venv's python, bin and a cwd
    outside the source tree."""
    require_setuptools()
    base = tmp_path_factory.mktemp("wheel")
    src, wheels, venv, cwd = base / "src", base / "wheels", base / "venv", base / "cwd"
    shutil.copytree(REPO, src, ignore=NOT_SOURCE)
    cwd.mkdir()
    run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "--wheel-dir", str(wheels),
         str(src)], cwd=cwd)
    (wheel,) = wheels.glob("commbench-*.whl")
    # No pip of its own (ensurepip costs seconds): this environment's pip installs into it (--python).
    run([sys.executable, "-m", "venv", "--without-pip", str(venv)], cwd=cwd)
    bindir = venv / ("Scripts" if os.name == "nt" else "bin")
    python = bindir / ("python.exe" if os.name == "nt" else "python")
    venv_site = Path(run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                         cwd=cwd).stdout.strip())
    ours = dict.fromkeys([sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]])
    (venv_site / "zz_test_environment.pth").write_text("".join(f"{p}\n" for p in ours), encoding="utf-8")
    run([sys.executable, "-m", "pip", "--python", str(python), "install", "-q", "--no-deps", "--no-index", str(wheel)],
        cwd=cwd)
    return {"wheel": wheel, "python": python, "bin": bindir, "site": venv_site, "cwd": cwd}


def test_the_wheel_ships_every_file_the_package_reads(installed) -> None:
    names = set(zipfile.ZipFile(installed["wheel"]).namelist())
    wanted = runtime_files()
    # What the code reads at run time today; a new one must be package data too.
    assert {"commbench/data/models.toml", "commbench/backends/p2p/allreduce.cu",
            "commbench/specs/nvswitch-8x-h100-h200.toml", "commbench/specs/pcie-8x.toml"} <= wanted
    assert sorted(wanted - names) == []


def test_the_installed_package_is_the_wheel_and_finds_its_data(installed) -> None:
    code = ("import json, commbench, commbench.backends.p2p.kernels as p2p, commbench.probe.snapshot\n"
            "from commbench import models\n"
            "from commbench.analysis.qualify import load_spec\n"
            "from importlib import resources\n"
            "specs = sorted(p.name for p in resources.files('commbench').joinpath('specs').iterdir())\n"
            "names = [load_spec(resources.files('commbench').joinpath('specs', s)).name for s in specs]\n"
            "print(json.dumps({'file': commbench.__file__, 'kernel': str(p2p.KERNEL_SOURCE),\n"
            "                  'kernel_bytes': len(p2p.KERNEL_SOURCE.read_text()), 'specs': names}))\n")
    got = json.loads(run([str(installed["python"]), "-c", code], cwd=installed["cwd"]).stdout)
    site = installed["site"].resolve()
    assert Path(got["file"]).resolve().is_relative_to(site), got
    assert Path(got["kernel"]).resolve().is_relative_to(site) and got["kernel_bytes"] > 1000, got
    assert len(got["specs"]) >= 2, got


def test_help_probe_models_and_a_sweep_run_from_the_wheel(installed, tmp_path: Path) -> None:
    commbench, cwd = str(installed["bin"] / "commbench"), installed["cwd"]
    assert "sweep" in run([commbench, "--help"], cwd=cwd).stdout
    run([commbench, "probe"], cwd=cwd)
    assert "llama-3.1-70b" in run([commbench, "floor", "--list-models"], cwd=cwd).stdout
    out = tmp_path / "results"
    run([commbench, "sweep", "--sizes", "4K", "--iters", "2", "--out", str(out)], cwd=cwd)
    (run_dir,) = [p for p in out.iterdir() if p.is_dir()]
    rows = [json.loads(line) for line in (run_dir / "measurements.jsonl").read_text().splitlines() if line.strip()]
    assert [(r["message_bytes"], r["status"]) for r in rows if r["backend"] == "gloo"] == [(4096, "no_work")], rows
    info = json.loads((run_dir / "run.json").read_text())
    assert info["versions"]["packages"]["commbench"] == "0.1.0" and info["command"][0] == commbench, info


def test_a_two_rank_torchrun_sweep_from_the_wheel(installed, tmp_path: Path) -> None:
    out = tmp_path / "results"
    run([str(installed["python"]), "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         "-m", "commbench", "sweep", "--sizes", "4K", "--iters", "2", "--out", str(out)], cwd=installed["cwd"])
    (run_dir,) = [p for p in out.iterdir() if p.is_dir()]
    rows = [json.loads(line) for line in (run_dir / "measurements.jsonl").read_text().splitlines() if line.strip()]
    assert [(r["message_bytes"], r["status"], r["wrong_elements"]) for r in rows if r["backend"] == "gloo"] \
        == [(4096, "ok", 0)], rows
