"""NCCL as users meet it, on one GPU (world size 1, seconds each): --nccl-lib with torch's own
libnccl records the version that process ran, nccl:symm registers its pool as symmetric windows
or says why not, and nccl4py runs or is reported unavailable with its reason. Whether a
symmetric kernel runs, and NCCL's numbers, need several GPUs (NCCL refuses two ranks on one)."""

from __future__ import annotations

import pytest
import torch

from commbench.backends.nccl4py import REQUIRES
from commbench.topology.nccl_log import loaded_nccl
from commbench.backends.nccl.symm import ROUTE
from test_sweep_gpu import _sweep

CHEAP = ("--sizes", "8K", "--iters", "5", "--no-probe")


def _torch_nccl() -> tuple[str, str]:
    """The libnccl torch mapped into this process, and its version as torch's calls see it."""
    torch.zeros(1, device="cuda")
    loaded = loaded_nccl()
    if loaded.path is None:
        pytest.skip(f"torch maps no libnccl here: {loaded.error}")
    torch_version = ".".join(str(part) for part in torch.cuda.nccl.version())
    assert loaded.version == torch_version, (loaded, torch_version)
    return loaded.path, torch_version


def test_nccl_lib_with_torch_s_own_nccl_records_the_version_it_ran(tmp_path) -> None:
    path, version = _torch_nccl()
    rows = _sweep(tmp_path, "--nproc", "1", "--backends", "nccl", "--nccl-lib", f"torchs={path}",
                  "--mode", "eager", *CHEAP)
    preloaded = [r for r in rows if r["env_setting"] == {"LD_PRELOAD": path}]
    assert preloaded and {r["backend"] for r in preloaded} == {"nccl:lib=torchs"}, rows
    plain = [r for r in rows if r["backend"] == "nccl"]
    assert plain, rows
    for row in preloaded + plain:
        assert row["status"] == "no_work" and row["wrong_elements"] == 0, row   # world size 1
        assert row["extra"]["nccl_version_loaded"] == version and row["extra"]["nccl_lib_loaded"] == path, row
    assert all(r["extra"]["nccl_lib_requested"] == path for r in preloaded)


def test_nccl_symm_registers_its_pool_or_says_why_not(tmp_path) -> None:
    rows = _sweep(tmp_path, "--backends", "nccl:symm", *CHEAP)
    assert {r["mode"] for r in rows} == {"eager", "graph"}, rows
    skipped = [r for r in rows if r["status"] == "skipped"]
    if skipped:   # this torch or NCCL refused: the reason names what (torch too old, the rank that failed)
        print("nccl:symm refused:", skipped[0]["reason"])
        assert len(skipped) == len(rows), rows
        assert all("too old" in r["reason"] or "failed on rank 0" in r["reason"] for r in skipped), skipped
        return
    print("nccl:symm registered:", rows[0]["extra"])
    for row in rows:
        assert row["status"] == "no_work" and row["wrong_elements"] == 0, row
        assert row["extra"]["nccl_symm_registration"] == ROUTE, row
        assert row["extra"]["nccl_symmetric_kernel"] is None, row
        assert row["extra"]["nccl_symmetric_note"].startswith("world size 1"), row


def test_nccl4py_runs_or_is_reported_unavailable(tmp_path) -> None:
    rows = _sweep(tmp_path, "--backends", "nccl4py", "--mode", "eager", *CHEAP)
    assert rows
    reason = REQUIRES.reason()    # "nccl4py not installed (pip install nccl4py)", or why it does not import
    if reason:
        print("nccl4py:", reason)
        assert all(r["status"] == "skipped" and r["reason"] == reason for r in rows), rows
        return
    for row in rows:
        assert row["status"] == "no_work" and row["wrong_elements"] == 0, row
        assert row["extra"]["nccl4py"] and row["extra"]["nccl_version_loaded"], row
