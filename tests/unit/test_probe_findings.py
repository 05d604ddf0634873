"""Every WARN/FAIL/INFO finding the analysis can raise, from the fixtures (edited where a
fixture does not carry the condition)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from commbench.topology.findings import findings

SNAPSHOTS = Path(__file__).parents[1] / "fixtures" / "snapshots"


def load(name: str) -> dict:
    return json.loads((SNAPSHOTS / name).read_text())


def codes(snapshot: dict) -> dict[str, str]:
    return {f["code"]: f["level"] for f in findings(snapshot)}


def test_pcie_2x4_numa_findings():
    found = codes(load("pcie-2x4-numa.json"))
    assert found == {
        "pcie_width_degraded": "WARN",   # GPU 6 at x8 of x16
        "iommu_translated": "WARN",      # DMA-FQ groups with GPUs talking over PCIe
        "uvm_hmm_enabled": "WARN",
        "vmm_fail": "WARN",              # rank 5 import + cross-socket cuMemSetAccess
        "ipc_fail": "WARN",              # cross-socket cuIpcOpenMemHandle
        "acs_unknown": "INFO",           # not root: extended config space unreadable
        "tp_spans_sockets": "WARN",      # TP8 crosses the SYS link between the two NUMA nodes
    }


def test_pcie_2x4_messages_name_gpu_and_rank():
    messages = [f["message"] for f in findings(load("pcie-2x4-numa.json"))]
    assert "GPU 6 PCIe link runs x8 of x16" in messages
    assert any("rank 5 (GPU 5)" in m and "cuMemImportFromShareableHandle" in m for m in messages)


def test_acs_switch_findings_and_remedy():
    s = load("pcie-switch-4x-acs.json")
    found = codes(s)
    assert found == {
        "p2p_advertised_broken": "FAIL", "p2p_hangs": "FAIL", "ipc_wrong": "FAIL",
        "probe_step_failed": "WARN", "acs_redirect": "WARN", "iommu_translated": "WARN", "aspm_powersave": "WARN",
        "pcie_gen_below_max": "WARN", "bar1_small": "WARN", "uvm_hmm_unknown": "INFO",
    }
    acs = [f for f in findings(s) if f["code"] == "acs_redirect"]
    assert len(acs) == 6   # every pair of the 4 GPUs crosses two redirecting downstream ports
    assert "0000:02:08.0 (ReqRedir+ CmpltRedir+)" in acs[0]["message"]
    assert "setpci" in acs[0]["remedy"] and "pci=noacs" in acs[0]["remedy"]
    assert [f["level"] for f in findings(s)][:3] == ["FAIL", "FAIL", "FAIL"]   # FAIL sorts first


def test_nvswitch_health_findings():
    found = codes(load("nvswitch-8x-h100.json"))
    assert found == {"ecc_uncorrected": "WARN", "retired_pages": "WARN", "retirement_pending": "WARN",
                     "row_remap_failed": "FAIL", "multicast_untested": "INFO"}


@pytest.mark.parametrize("edit, code, level", [
    (lambda s: s["p2p"][0].update(can_access_peer=False, write_verify={"status": "wrong", "detail": "3 wrong"}),
     "p2p_wrong_data", "FAIL"),
    (lambda s: s["p2p"][0].update(write_verify={"status": "fail", "detail": "cuLaunchKernel failed"}),
     "p2p_write_failed", "WARN"),
    (lambda s: s["p2p"][0]["nvml"].update(write="chipset not supported"), "p2p_nvml_disagrees", "INFO"),
    (lambda s: s["vmm"]["exports"][2].update(status="fail", detail="cuMemCreate failed: CUDA_ERROR_OUT_OF_MEMORY"),
     "vmm_export_failed", "WARN"),
    (lambda s: s["ipc"]["pairs"][0].update(status="hangs", detail="process 1 on GPU 1: timed out"), "ipc_hangs", "FAIL"),
    (lambda s: s["multicast"].update(functional={"status": "fail", "detail": "cuMulticastCreate failed"}),
     "multicast_failed", "WARN"),
    (lambda s: s.update(shares_gpus=True), "shared_gpus", "INFO"),
])
def test_edited_conditions(edit, code, level):
    s = load("nvswitch-8x-h100.json")
    edit(s)
    assert codes(s).get(code) == level


def test_pcie_gen_and_hmm_need_pcie_peers():
    s = load("nvswitch-8x-h100.json")
    s["hosts"]["hgx8"]["uvm_disable_hmm"] = "0"
    s["hosts"]["hgx8"]["iommu"]["mode"] = "translated"
    found = codes(s)
    # Every pair talks over NVLink: the PCIe-only host hazards do not apply.
    assert "uvm_hmm_enabled" not in found and "iommu_translated" not in found


def test_no_gpu_snapshot_has_no_device_findings():
    s = load("nvswitch-8x-h100.json")
    s.update(gpus=[], p2p=[], pcie_paths=[], ipc={"exports": [], "pairs": [], "tested": False},
             vmm={"exports": [], "pairs": [], "tested": False}, multicast={"attribute": {}, "functional": {}})
    assert findings(s) == []


def test_recorded_h200_has_only_the_shared_gpu_note():
    found = codes(load("h200-1gpu.json"))
    assert found == {"shared_gpus": "INFO"}
