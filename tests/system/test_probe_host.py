"""Host facts and the child-process machinery, on a fake sysfs tree and real child processes."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from commbench.topology import pcie
from commbench.topology.childproc import Child, module_argv, run_child
from commbench.topology.host import iommu_mode
from commbench.probe.snapshot import merge


def config_space(acs_control: int | None, size: int = 4096) -> bytes:
    """A config-space dump with an AER capability at 0x100 chained to ACS at 0x148."""
    data = bytearray(size)
    if size > 0x100:
        data[0x100:0x104] = (0x0001 | (1 << 16) | (0x148 << 20)).to_bytes(4, "little")   # AER -> next 0x148
        if acs_control is not None:
            data[0x148:0x14C] = (0x000D | (1 << 16)).to_bytes(4, "little")
            data[0x14E:0x150] = acs_control.to_bytes(2, "little")
    return bytes(data)


def test_parse_acs():
    on = pcie.parse_acs(config_space(0x001D))
    assert on["acs_ctl"] == "0x001d" and on["req_redir"] and on["cmplt_redir"]
    assert on["flags"][:4] == ["SrcValid+", "TransBlk-", "ReqRedir+", "CmpltRedir+"]
    off = pcie.parse_acs(config_space(0x0001))
    assert not off["req_redir"] and not off["cmplt_redir"]
    assert pcie.parse_acs(config_space(None)) == {"acs": "none"}
    assert pcie.parse_acs(config_space(None, size=64)) == {"error": "unknown (needs root)"}


def make_tree(tmp_path: Path) -> Path:
    """root port 00:01.0 -> switch up 01:00.0 -> down 02:08.0 / 02:09.0 -> GPUs 03:00.0 / 04:00.0."""
    devices = tmp_path / "devices"
    real = tmp_path / "real" / "pci0000:00"
    chain = {"0000:03:00.0": ["0000:00:01.0", "0000:01:00.0", "0000:02:08.0"],
             "0000:04:00.0": ["0000:00:01.0", "0000:01:00.0", "0000:02:09.0"]}
    devices.mkdir()
    for gpu, bridges in chain.items():
        path = real
        for b in bridges:
            path = path / b
            path.mkdir(parents=True, exist_ok=True)
            (path / "config").write_bytes(config_space(0x001D if b.startswith("0000:02") else 0x0000))
            if not (devices / b).exists():
                os.symlink(path, devices / b)
        (path / gpu).mkdir()
        os.symlink(path / gpu, devices / gpu)
    return devices


def test_path_between_gpus_behind_one_switch(tmp_path):
    root = make_tree(tmp_path)
    assert pcie.path_bridges("0000:03:00.0", "0000:04:00.0", root) == ["0000:01:00.0", "0000:02:08.0", "0000:02:09.0"]
    paths = pcie.gpu_pair_paths(["00000000:03:00.0", "00000000:04:00.0", "00000000:09:00.0"], root)
    first = paths[0]
    assert [b["bdf"] for b in first["bridges"]] == ["0000:01:00.0", "0000:02:08.0", "0000:02:09.0"]
    assert [b["req_redir"] for b in first["bridges"]] == [False, True, True]
    assert paths[1]["error"].startswith("GPU not found")


def test_unreadable_config_says_needs_root(tmp_path):
    root = make_tree(tmp_path)
    cfg = Path(os.path.realpath(root / "0000:02:08.0")) / "config"
    cfg.write_bytes(config_space(0x001D, size=64))   # what a non-root user sees
    assert pcie.bridge_acs("0000:02:08.0", root) == {"bdf": "0000:02:08.0", "error": "unknown (needs root)"}


def test_iommu_mode_sources(tmp_path):
    root = make_tree(tmp_path)
    group = Path(os.path.realpath(root / "0000:03:00.0")) / "iommu_group"
    empty, units = tmp_path / "iommu_none", tmp_path / "iommu_units"
    empty.mkdir()
    (units / "dmar0").mkdir(parents=True)
    assert iommu_mode("ro quiet", ["0000:03:00.0"], root, empty)["mode"] == "off"
    assert iommu_mode("ro iommu=pt", ["0000:03:00.0"], root, units)["mode"] == "passthrough"
    assert iommu_mode("ro amd_iommu=off", [], root, units)["mode"] == "off"
    assert iommu_mode("ro", [], root, units)["mode"] == "translated"
    assert iommu_mode("ro", [], root, tmp_path / "absent")["mode"] == "unknown"
    group.mkdir()
    (group / "type").write_text("DMA-FQ\n")
    found = iommu_mode("ro iommu=pt", ["00000000:03:00.0"], root, units)
    assert found["mode"] == "translated" and found["gpu_group_types"] == {"0000:03:00.0": "DMA-FQ"}


@pytest.mark.procs
def test_child_time_limit_gives_partial_records_and_the_hung_step():
    code = ("import json,time;print(json.dumps({'kind':'start','step':'P2P write GPU 0 -> GPU 1','src':0,'dst':1}),"
            "flush=True);time.sleep(60)")
    result = Child([sys.executable, "-c", code]).wait(__import__("time").monotonic() + 1.5)
    assert result.timed_out and result.records[0]["step"] == "P2P write GPU 0 -> GPU 1"
    assert result.failure().startswith("timed out after") and result.failure().endswith("GPU 0 -> GPU 1")
    assert result.elapsed_s < 10


@pytest.mark.procs
def test_child_crash_is_reported_not_raised():
    result = Child([sys.executable, "-c", "import sys; sys.exit('boom')"]).wait(__import__("time").monotonic() + 20)
    assert result.failure() == "child exited with status 1: boom"


@pytest.mark.procs
def test_local_checks_child_without_a_driver_reports_a_row():
    result = run_child("commbench.topology.local_checks", {"task": "caps", "devices": "all", "pairs": "all"}, 30)
    kinds = [r["kind"] for r in result.records]
    if "driver" in kinds:
        pytest.skip("this machine has an NVIDIA driver (tests/gpu covers it)")
    assert kinds == ["error", "done"] and result.failure() is None
    assert module_argv("m", {"a": 1})[-1] == '{"a": 1}'


def fake_report(records: list[dict], failures: list[dict]) -> dict:
    dev = {"kind": "device", "name": "GPU", "compute_capability": "8.9", "sm_count": 1, "memory_total_mib": 1,
           "attributes": {}, "numa_node": 0, "cpu_affinity": "0"}
    return {"hostname": "h", "notes": [], "failures": failures, "nvml": {"error": "NVML unavailable"},
            "host": {}, "caps": [{"kind": "driver", "version": "13.0", "device_count": 3},
                                 *[{**dev, "index": i, "uuid": f"GPU-{i}", "pci_bus_id": f"0000:0{i}:00.0"}
                                   for i in range(3)], *records]}


@pytest.mark.procs
def test_merge_marks_the_hung_pair_and_the_pairs_that_never_ran():
    records = [{"kind": "can_access", "src": 0, "dst": 1, "value": True},
               {"kind": "enable_peer", "src": 0, "dst": 1, "status": "ok"},
               {"kind": "write_verify", "src": 0, "dst": 1, "status": "ok"}]
    failure = {"step": "driver facts and P2P pair checks", "detail": "timed out after 20 s", "timed_out": True,
               "last_step": "P2P write GPU 0 -> GPU 2", "last_src": 0, "last_dst": 2}
    s = merge([fake_report(records, [failure])], "single-process", 1, [],
              {"bandwidth": False, "allow_multicast": False, "timeout_s": 20})
    status = {(e["src"], e["dst"]): (e["write_verify"] or {}).get("status") for e in s["p2p"]}
    assert status[(0, 1)] == "ok" and status[(0, 2)] == "hangs" and status[(2, 1)] == "not_run"
    assert s["links"]["error"] == "NVML unavailable" and s["links"]["matrix"][0][0] == "X"
    assert "NVML unavailable" in s["notes"] and s["errors"][0]["step"] == "driver facts and P2P pair checks"


@pytest.mark.procs
def test_merge_group_names_who_failed():
    parts = [{"id": k, "rank": k, "host": "h", "device": k} for k in range(3)]
    group = [{"participant": 0, "failure": None, "last_step": None, "records": [
                 {"kind": "export", "mechanism": "vmm", "participant": 0, "status": "ok"},
                 {"kind": "write", "mechanism": "vmm", "writer": 0, "owner": 1, "status": "ok"},
                 {"kind": "write", "mechanism": "vmm", "writer": 0, "owner": 2, "status": "ok"}]},
             {"participant": 1, "failure": None, "last_step": None, "records": [
                 {"kind": "write", "mechanism": "vmm", "writer": 1, "owner": 0, "status": "fail",
                  "detail": "cuMemImportFromShareableHandle failed: CUDA_ERROR_INVALID_VALUE (1)"},
                 {"kind": "verify", "mechanism": "vmm", "writer": 0, "owner": 1, "status": "ok"}]},
             {"participant": 2, "failure": "timed out after 20 s during VMM import and write 2 -> 0",
              "timed_out": True, "last_step": "VMM import and write 2 -> 0", "records": []}]
    report = fake_report([], [])
    report["group"] = group
    s = merge([report], "torchrun", 3, parts, {"bandwidth": False, "allow_multicast": False, "timeout_s": 20})
    pairs = {(p["writer"], p["owner"]): p for p in s["vmm"]["pairs"]}
    assert pairs[(0, 1)]["status"] == "ok"
    assert pairs[(1, 0)]["status"] == "fail" and pairs[(1, 0)]["detail"].startswith("rank 1 (GPU 1) writing to rank 0")
    assert pairs[(0, 2)]["status"] == "hangs" and "rank 2 (GPU 2): timed out" in pairs[(0, 2)]["detail"]
    assert pairs[(2, 1)]["status"] == "hangs" and pairs[(2, 1)]["detail"].startswith("rank 2 (GPU 2): timed out")
    # A child that crashed (not timed out) is a failure, not a hang
    group[2].update(timed_out=False, failure="child exited with status -11")
    s = merge([report], "torchrun", 3, parts, {"bandwidth": False, "allow_multicast": False, "timeout_s": 20})
    crashed = {(p["writer"], p["owner"]): p for p in s["vmm"]["pairs"]}[(2, 0)]
    assert crashed["status"] == "fail" and "status -11 (last step: VMM import and write 2 -> 0)" in crashed["detail"]
