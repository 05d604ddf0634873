"""NCCL versions side by side: --nccl-lib labels and bad input, the child torchrun that preloads
each library, and the version every row records, asked of the library its process mapped."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from commbench import backends
from commbench.backends.nccl import backend as nccl_backend
from commbench.backends.nccl.variants import NcclOptions
from commbench.backends.nccl.libs import NcclLibrary, default_label, parse_nccl_libs, preloaded_here
from commbench.topology.nccl_log import LoadedNccl, loaded_nccl, mapped_libnccls, version_text
from commbench.errors import UsageError
from helpers import only_run_dir, rows, run_cli

FAKE_NCCL_C = """
int ncclGetVersion(int* version) { *version = %d; return 0; }
"""


def build_fake_nccl(folder: Path, code: int) -> Path:
    """A stand-in libnccl.so.2 whose ncclGetVersion answers `code` (the one symbol commbench asks)."""
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        pytest.skip("no C compiler to build a stand-in libnccl.so.2")
    folder.mkdir(parents=True, exist_ok=True)
    source = folder / "fake_nccl.c"
    source.write_text(FAKE_NCCL_C % code)
    library = folder / "libnccl.so.2"
    subprocess.run([compiler, "-shared", "-fPIC", "-Wl,-soname,libnccl.so.2", "-o", str(library), str(source)],
                   check=True, capture_output=True)
    return library


def wheel_tree(site: Path, cuda: str, version: str) -> Path:
    """site-packages as an nvidia-nccl-cuNN wheel installs it (file contents aside)."""
    lib = site / "nvidia" / "nccl" / "lib" / "libnccl.so.2"
    lib.parent.mkdir(parents=True)
    lib.write_bytes(b"\x7fELF" + b"\0" * 60)
    info = site / f"nvidia_nccl_{cuda}-{version}.dist-info"
    info.mkdir()
    (info / "RECORD").write_text("nvidia/__init__.py,,\nnvidia/nccl/lib/libnccl.so.2,sha256=abc,64\n")
    return lib


def test_version_codes_read_as_nccl_prints_them() -> None:
    assert version_text(22907) == "2.29.7" and version_text(22809) == "2.28.9" and version_text(23201) == "2.32.1"


def test_every_mapped_libnccl_is_listed_once_in_map_order() -> None:
    maps = ("7f00-7f10 r--p 00000000 08:01 11 /opt/a/libnccl.so.2\n"
            "7f10-7f20 r-xp 00001000 08:01 11 /opt/a/libnccl.so.2\n"
            "7f30-7f40 r--p 00000000 08:01 12 /usr/lib/x86_64-linux-gnu/libnccl.so.2.29.7\n"
            "7f50-7f60 r--p 00000000 08:01 13 /usr/lib/libnccl-net.so\n")
    assert mapped_libnccls(maps) == ["/opt/a/libnccl.so.2", "/usr/lib/x86_64-linux-gnu/libnccl.so.2.29.7"]


def test_a_row_records_the_loaded_version_and_any_second_nccl() -> None:
    one = LoadedNccl("/a/libnccl.so.2", 22809)
    assert one.row_extra() == {"nccl_version_loaded": "2.28.9", "nccl_lib_loaded": "/a/libnccl.so.2"}
    two = LoadedNccl("/a/libnccl.so.2", 22907, ("/b/libnccl.so.2",))
    assert two.row_extra()["nccl_libs_mapped"] == ["/a/libnccl.so.2", "/b/libnccl.so.2"]
    none = LoadedNccl(None, None, error="no libnccl is mapped into this process")
    assert none.row_extra() == {"nccl_version_loaded": None, "nccl_lib_loaded": None,
                                "nccl_version_error": "no libnccl is mapped into this process"}


@pytest.mark.procs
def test_the_version_is_asked_of_the_mapped_library(tmp_path: Path) -> None:
    # In a child: a stand-in libnccl mapped into pytest's own process would stay there and be
    # "the loaded NCCL" for every later test that reads /proc/self/maps.
    library = build_fake_nccl(tmp_path / "fake", 22907)
    maps = tmp_path / "maps"
    code = f"""
import ctypes
from pathlib import Path
from commbench.topology.nccl_log import LoadedNccl, loaded_nccl
ctypes.CDLL({str(library)!r})   # mapped now, as torch maps its NCCL
maps = Path({str(maps)!r})
maps.write_text("7f00-7f10 r-xp 00000000 08:01 11 {library}\\n")
assert loaded_nccl(maps) == LoadedNccl({str(library)!r}, 22907), loaded_nccl(maps)
maps.write_text("7ffd-7ffe rw-p 00000000 00:00 0 [stack]\\n")
assert loaded_nccl(maps).error == "no libnccl is mapped into this process", loaded_nccl(maps)
"""
    child = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert child.returncode == 0, child.stderr


@pytest.mark.procs
def test_a_preloaded_library_is_the_one_a_process_reports(tmp_path: Path) -> None:
    """The child's view: LD_PRELOAD maps the library, /proc/self/maps finds it, it says 2.29.7."""
    library = build_fake_nccl(tmp_path / "nccl-2.29.7" / "lib", 22907)
    code = "from commbench.topology.nccl_log import loaded_nccl; l = loaded_nccl(); print(l.path, l.version)"
    env = {**os.environ, "LD_PRELOAD": str(library)}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    assert out.stdout.split() == [str(library.resolve()), "2.29.7"]


def test_labels_are_stable_and_never_a_version_claim_from_nowhere(tmp_path: Path) -> None:
    wheel_lib = wheel_tree(tmp_path / "site", "cu13", "2.29.7")
    assert default_label(wheel_lib) == "cu13-2.29.7"
    system = tmp_path / "usr" / "libnccl.so.2.27.7"
    system.parent.mkdir()
    system.write_bytes(b"\x7fELF")
    assert default_label(system) == "2.27.7"
    build = tmp_path / "build" / "lib" / "libnccl.so.2"
    build.parent.mkdir(parents=True)
    build.write_bytes(b"\x7fELF")
    label = default_label(build)
    assert label.startswith("lib-") and len(label) == 12 and default_label(build) == label


def test_nccl_lib_takes_a_file_a_folder_or_a_label(tmp_path: Path) -> None:
    wheel_lib = wheel_tree(tmp_path / "target", "cu13", "2.29.7")
    by_folder = parse_nccl_libs([str(tmp_path / "target")])           # pip install --target DIR
    assert by_folder == [NcclLibrary("cu13-2.29.7", str(wheel_lib.resolve()))]
    named = parse_nccl_libs([f"new={wheel_lib}", str(wheel_lib)])
    assert [lib.label for lib in named] == ["new", "cu13-2.29.7"]
    assert parse_nccl_libs([str(wheel_lib), str(wheel_lib)]) == by_folder   # the same file once


@pytest.mark.parametrize("spec, message", [
    ("/nonexistent/libnccl.so.2", "--nccl-lib /nonexistent/libnccl.so.2: no such file"),
    ("bad,label=/x", "a label is letters, digits"),
    ("label=", "give a path"),
])
def test_bad_nccl_lib_specs_are_usage_errors(spec: str, message: str) -> None:
    with pytest.raises(UsageError, match=message.replace("(", r"\(")):
        parse_nccl_libs([spec])


def test_a_non_library_and_a_folder_without_one_are_refused(tmp_path: Path) -> None:
    text = tmp_path / "libnccl.so.2"
    text.write_text("not a library")
    with pytest.raises(UsageError, match="not a shared library"):
        parse_nccl_libs([str(text)])
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(UsageError, match=f"--nccl-lib {empty}: no libnccl.so.2 in it"):
        parse_nccl_libs([str(empty)])


def test_two_libraries_may_not_share_a_label(tmp_path: Path) -> None:
    a, b = (wheel_tree(tmp_path / name, "cu13", "2.29.7") for name in ("a", "b"))
    with pytest.raises(UsageError, match="would both be nccl:lib=cu13-2.29.7; name them LABEL=PATH"):
        parse_nccl_libs([str(a), str(b)])
    assert [lib.label for lib in parse_nccl_libs([f"a={a}", f"b={b}"])] == ["a", "b"]


def test_every_nccl_variant_runs_once_more_per_library(tmp_path: Path) -> None:
    lib = NcclLibrary("cu13-2.29.7", str(wheel_tree(tmp_path / "s", "cu13", "2.29.7")))
    options = backends.Options(families={"nccl": NcclOptions(protos=("LL",), symm=True, libraries=(lib,))})
    names = [b.name for b in backends.expand(["nccl"], options, True)]
    assert names == ["nccl", "nccl:proto=LL", "nccl:symm", "nccl:lib=cu13-2.29.7", "nccl:proto=LL,lib=cu13-2.29.7",
                     "nccl:symm,lib=cu13-2.29.7"]
    assert [b.name for b in backends.expand(["nccl:lib=cu13-2.29.7"], options, True)] == ["nccl:lib=cu13-2.29.7"]
    assert [b.name for b in backends.expand(["nccl:proto=LL"], options, True)] == [
        "nccl:proto=LL", "nccl:proto=LL,lib=cu13-2.29.7"]
    with pytest.raises(UsageError, match="nccl:lib=other: no --nccl-lib has that label"):
        backends.expand(["nccl:lib=other"], options, True)


def test_the_driver_gives_each_library_its_own_preloaded_child(tmp_path: Path) -> None:
    from commbench.sweep.launcher import child_runs

    path = wheel_tree(tmp_path / "s", "cu13", "2.29.7")
    options = backends.Options(families={"nccl": NcclOptions(libraries=tuple(parse_nccl_libs([str(path)])))})
    variants = backends.expand(["nccl"], options, True)
    argv = ["--nproc", "8", "--backends", "nccl", "-b", "4K", "--nccl-lib", str(path)]
    runs = child_runs(argv, [], variants, allow_multicast=False)
    assert runs[0] == ({}, ["--backends", "nccl", "-b", "4K", "--nccl-lib", str(path)])
    assert runs[1] == ({"LD_PRELOAD": str(path.resolve())},
                       ["-b", "4K", "--nccl-lib", str(path), "--backends", "nccl:lib=cu13-2.29.7"])
    assert len(runs) == 2


def test_a_library_variant_runs_only_where_its_library_is_preloaded(monkeypatch: pytest.MonkeyPatch,
                                                                    tmp_path: Path) -> None:
    lib = NcclLibrary("x", str(tmp_path / "libnccl.so.2"))
    backend = nccl_backend.NcclBackend(library=lib)
    monkeypatch.setattr(nccl_backend.dist, "is_nccl_available", lambda: True)
    ctx = type("Ctx", (), {"world_size": 2, "verdicts": {}, "is_cuda": True, "shares_gpus": False, "nodes": 1})()
    monkeypatch.delenv("LD_PRELOAD", raising=False)
    assert backend.check(ctx) == (f"runs in a child torchrun with LD_PRELOAD={lib.path} "
                                  "(started by the sweep's driver: commbench sweep --nproc N)")
    monkeypatch.setenv("LD_PRELOAD", f"/other.so:{lib.path}")
    assert preloaded_here(lib) and backend.check(ctx) is None
    assert backend.process_env(allow_multicast=False) == {"LD_PRELOAD": lib.path}
    assert nccl_backend.NcclBackend().process_env(allow_multicast=False) is None


def test_a_preload_that_did_not_take_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    lib = NcclLibrary("x", "/w/nvidia/nccl/lib/libnccl.so.2")

    def running(loaded: LoadedNccl) -> None:
        monkeypatch.setattr(nccl_backend, "process_nccl", lambda: loaded)

    running(LoadedNccl(lib.path, 22907))
    assert nccl_backend.preloaded_library_reason(lib, 22907) is None
    assert "torch's calls report NCCL 2.28.9 but the preloaded" in nccl_backend.preloaded_library_reason(lib, 22809)
    running(LoadedNccl("/torch/libnccl.so.2", 22809))
    assert nccl_backend.preloaded_library_reason(lib, 22809) == (
        f"--nccl-lib x: this process maps /torch/libnccl.so.2, not the preloaded {lib.path}")


def test_rows_carry_the_library_they_asked_for_and_the_one_that_ran(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(nccl_backend, "process_nccl", lambda: LoadedNccl("/w/libnccl.so.2", 22907))
    lib = NcclLibrary("cu13-2.29.7", "/w/libnccl.so.2")
    extra = nccl_backend.NcclBackend(library=lib).row_fields()["extra"]
    assert extra == {"nccl_version_loaded": "2.29.7", "nccl_lib_loaded": "/w/libnccl.so.2",
                     "nccl_lib_label": "cu13-2.29.7", "nccl_lib_requested": "/w/libnccl.so.2"}
    assert nccl_backend.NcclBackend().row_fields()["extra"] == {"nccl_version_loaded": "2.29.7",
                                                                "nccl_lib_loaded": "/w/libnccl.so.2"}


@pytest.mark.parametrize("args, message", [
    (["--nccl-lib", "/nonexistent/libnccl.so.2"], "--nccl-lib /nonexistent/libnccl.so.2: no such file"),
    (["--backends", "nccl:lib=missing"], "nccl:lib=missing: no --nccl-lib has that label"),
])
@pytest.mark.procs
def test_bad_library_input_is_one_line_and_exit_2(tmp_path: Path, args: list[str], message: str) -> None:
    result = run_cli(["sweep", "--cpu", "--out", str(tmp_path), *args])
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [f"commbench: error: {message}"] or \
        message in result.stderr.strip().splitlines()[-1]
    assert not any(tmp_path.iterdir())


@pytest.mark.procs
@pytest.mark.skipif(torch.distributed.is_available() and torch.distributed.is_nccl_available(),
                    reason="the CPU end-to-end run expects a torch without NCCL")
@pytest.mark.slow
def test_the_driver_runs_a_preloaded_child_whose_rows_name_its_nccl(tmp_path: Path) -> None:
    """On the CPU NCCL cannot run, but the plumbing can: the library's child starts with it
    preloaded, and its rows say which NCCL that process mapped (a stand-in 2.29.7)."""
    library = build_fake_nccl(tmp_path / "nccl-2.29.7", 22907)
    out = tmp_path / "results"
    result = run_cli(["sweep", "--nproc", "1", "--cpu", "--no-probe", "--sizes", "1K", "--backends", "nccl",
                      "--nccl-lib", f"fake229={library}", "--out", str(out)], timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"LD_PRELOAD={library.resolve()}" in result.stdout
    got = rows(only_run_dir(out))
    preloaded = [r for r in got if r["env_setting"] == {"LD_PRELOAD": str(library.resolve())}]
    assert preloaded and {r["backend"] for r in preloaded} == {"nccl:lib=fake229"}
    assert all(r["extra"]["nccl_version_loaded"] == "2.29.7" and r["extra"]["nccl_lib_loaded"] == str(library.resolve())
               and r["extra"]["nccl_lib_label"] == "fake229" for r in preloaded)
    assert all(r["status"] == "skipped" and "CUDA" in r["reason"] for r in preloaded)
    main = [r for r in got if not r["env_setting"]]
    assert {r["backend"] for r in main} == {"nccl", "nccl:lib=fake229"}
    assert all(r["extra"]["nccl_version_loaded"] is None for r in main)   # a CPU torch maps no NCCL
    assert json.loads((only_run_dir(out) / "run.json").read_text())["run_id"]
