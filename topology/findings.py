"""WARN/FAIL/INFO findings over a snapshot (pure): what is wrong with this box, and what to do.

Every finding carries a code (stable, for tests and scripts), a message and, where one exists,
the usual remedy — printed, never applied.
"""

from __future__ import annotations

from typing import Any

from commbench.topology.finding import FAIL, INFO, WARN, finding
from commbench.topology.pcie_findings import at_max_under_load, pcie_box_findings
from commbench.topology.selection import is_nvlink, link

ACS_REMEDY = ("ACS redirect sends peer-to-peer traffic up to the root complex (and through the IOMMU): "
              "P2P may hang or return wrong data. Usual fixes (commbench applies none): disable ACS in the "
              "BIOS, boot with pci=noacs where the kernel supports it, or as root "
              "`setpci -s <bridge> ECAP_ACS+6.w=0000` (lost on reboot); see NCCL's troubleshooting guide "
              "on PCI ACS and NVIDIA/nccl#2079")
IOMMU_REMEDY = ("boot with iommu=pt (or amd_iommu=off / intel_iommu=off), or disable the IOMMU in the BIOS; "
                "NCCL_CUMEM_ENABLE=1 helped some passthrough hosts (gardenlinux#4556)")
ASPM_REMEDY = "boot with pcie_aspm=off pcie_port_pm=off (reported to stop 'Surprise Link Down' lockups)"
HMM_REMEDY = "options nvidia_uvm uvm_disable_hmm=1 in /etc/modprobe.d, then reload nvidia_uvm"
SMALL_BAR1_MIB = 256


def pcie_findings(snapshot: dict[str, Any]) -> list[dict[str, Any]]:
    out = []
    for g in snapshot.get("gpus") or []:
        p = g.get("pcie") or {}
        if p.get("width_current") and p.get("width_max") and p["width_current"] < p["width_max"]:
            out.append(finding(WARN, "pcie_width_degraded",
                               f"GPU {g['index']} PCIe link runs x{p['width_current']} of x{p['width_max']}",
                               "reseat the card or riser, check the slot's wiring and BIOS bifurcation"))
        if p.get("gen_current") and p.get("gen_max") and p["gen_current"] < p["gen_max"] \
                and not at_max_under_load(snapshot, g["index"]):   # an idle GPU's link trains down
            out.append(finding(WARN, "pcie_gen_below_max",
                               f"GPU {g['index']} PCIe link at Gen{p['gen_current']} of Gen{p['gen_max']}",
                               "idle GPUs lower their link speed to save power: re-check under load; if it stays "
                               "low, check the slot, riser and BIOS link-speed setting"))
        bar1 = g.get("bar1_total_mib")
        if bar1 is not None and bar1 <= SMALL_BAR1_MIB < (g.get("memory_total_mib") or 0):
            out.append(finding(WARN, "bar1_small", f"GPU {g['index']} BAR1 is {bar1} MiB (device memory "
                                                   f"{g.get('memory_total_mib')} MiB): peer mappings are limited",
                               "enable Resizable BAR / Above 4G decoding in the BIOS"))
    return out


def acs_findings(snapshot: dict[str, Any]) -> list[dict[str, Any]]:
    out, unreadable = [], set()
    for path in snapshot.get("pcie_paths") or []:
        redirect = [b for b in path.get("bridges", []) if b.get("req_redir") or b.get("cmplt_redir")]
        unreadable.update(b["bdf"] for b in path.get("bridges", []) if b.get("error"))
        if redirect:
            where = ", ".join(f"{b['bdf']} ({' '.join(f for f in b['flags'] if 'Redir' in f)})" for b in redirect)
            out.append(finding(WARN, "acs_redirect",
                               f"ACS redirect on the path GPU {path['a']} <-> GPU {path['b']}: {where}", ACS_REMEDY))
    if unreadable:
        out.append(finding(INFO, "acs_unknown", f"ACS bits of {len(unreadable)} bridge(s) unknown (needs root): "
                                                f"run the probe as root to read them"))
    return out


def pcie_pairs(snapshot: dict[str, Any]) -> list[tuple[int, int]]:
    gpus = snapshot.get("gpus") or []
    return [(a["index"], b["index"]) for a in gpus for b in gpus
            if a["index"] < b["index"] and a["host"] == b["host"]
            and not is_nvlink(link(snapshot, a["index"], b["index"]))]


def host_findings(snapshot: dict[str, Any]) -> list[dict[str, Any]]:
    out = []
    over_pcie = bool(pcie_pairs(snapshot))
    for name, h in (snapshot.get("hosts") or {}).items():
        mode = (h.get("iommu") or {}).get("mode")
        if mode == "translated" and over_pcie:
            out.append(finding(WARN, "iommu_translated", f"{name}: the IOMMU translates DMA "
                                                         f"({h['iommu'].get('source')}) and GPUs talk over PCIe",
                               IOMMU_REMEDY))
        if h.get("aspm_policy") in ("powersave", "powersupersave"):
            out.append(finding(WARN, "aspm_powersave", f"{name}: PCIe ASPM policy is {h['aspm_policy']}", ASPM_REMEDY))
        hmm = h.get("uvm_disable_hmm")
        if hmm == "0" and over_pcie:
            out.append(finding(WARN, "uvm_hmm_enabled", f"{name}: nvidia_uvm HMM is on (uvm_disable_hmm=0) with "
                                                        f"GPUs talking over PCIe", HMM_REMEDY))
        elif hmm and hmm.startswith("unknown"):
            out.append(finding(INFO, "uvm_hmm_unknown", f"{name}: uvm_disable_hmm {hmm}"))
    return out


def health_findings(snapshot: dict[str, Any]) -> list[dict[str, Any]]:
    out = []
    for g in snapshot.get("gpus") or []:
        ecc = g.get("ecc") or {}
        errors = max(ecc.get("volatile_uncorrected") or 0, ecc.get("aggregate_uncorrected") or 0)
        if errors:
            out.append(finding(WARN, "ecc_uncorrected", f"GPU {g['index']} has {errors} uncorrected ECC error(s)",
                               "check nvidia-smi -q -d ECC and the Xid log before blaming a backend"))
        if ecc.get("retired_pages"):
            out.append(finding(WARN, "retired_pages", f"GPU {g['index']} has {ecc['retired_pages']} retired page(s)"))
        if ecc.get("retired_pages_pending") or ecc.get("remap_pending"):
            out.append(finding(WARN, "retirement_pending", f"GPU {g['index']} has a page retirement or row remap "
                                                           f"pending", "reset the GPU when it is idle"))
        if ecc.get("remap_failed"):
            out.append(finding(FAIL, "row_remap_failed", f"GPU {g['index']} failed to remap a memory row",
                               "the GPU needs service"))
    return out


def p2p_findings(snapshot: dict[str, Any]) -> list[dict[str, Any]]:
    out = []
    for e in snapshot.get("p2p") or []:
        wv = e.get("write_verify") or {}
        status = wv.get("status")
        pair = f"GPU {e['src']} -> GPU {e['dst']}"
        if status == "hangs":
            out.append(finding(FAIL, "p2p_hangs", f"{pair}: peer write never completed ({wv.get('detail')})",
                               "run with NCCL_P2P_DISABLE=1 and --disable-custom-all-reduce until fixed; check "
                               "the ACS and IOMMU findings"))
        elif status == "wrong" and e.get("can_access_peer"):
            out.append(finding(FAIL, "p2p_advertised_broken",
                               f"{pair}: cudaDeviceCanAccessPeer says yes but the written data is wrong "
                               f"({wv.get('detail')})", "check the ACS and IOMMU findings; do not use P2P backends"))
        elif status == "wrong":
            out.append(finding(FAIL, "p2p_wrong_data", f"{pair}: {wv.get('detail')}"))
        elif status == "fail" and e.get("can_access_peer"):
            out.append(finding(WARN, "p2p_write_failed", f"{pair}: capability says yes but the write failed: "
                                                         f"{wv.get('detail')}"))
        nv = e.get("nvml") or {}
        if e.get("can_access_peer") is True and nv.get("write") not in (None, "OK"):
            out.append(finding(INFO, "p2p_nvml_disagrees", f"{pair}: CUDA allows peer access but NVML P2P write "
                                                           f"status is '{nv.get('write')}'"))
    return out


def group_findings(snapshot: dict[str, Any]) -> list[dict[str, Any]]:
    out = []
    for section, label in (("ipc", "legacy CUDA IPC"), ("vmm", "cuMemCreate/POSIX-FD sharing")):
        group = snapshot.get(section) or {}
        for export in group.get("exports", []):
            if export["status"] != "ok":
                out.append(finding(WARN, f"{section}_export_failed",
                                   f"{label}: participant {export['participant']} could not export: "
                                   f"{export.get('detail')}"))
        bad = [p for p in group.get("pairs", []) if p["status"] != "ok"]
        for p in bad:
            level = FAIL if p["status"] in ("hangs", "wrong") else WARN
            out.append(finding(level, f"{section}_{p['status']}", f"{label}: {p.get('detail')}"))
    return out


def multicast_findings(snapshot: dict[str, Any]) -> list[dict[str, Any]]:
    mc = snapshot.get("multicast") or {}
    functional = mc.get("functional") or {}
    out = []
    if any(v == 1 for v in (mc.get("attribute") or {}).values()) and functional.get("status", "").startswith(
            ("not tested", "disabled")):
        out.append(finding(INFO, "multicast_untested", "the driver reports multicast support; it was not created: "
                                                       f"{functional['status']}"))
    if functional.get("status") == "fail":
        out.append(finding(WARN, "multicast_failed", f"multicast setup failed: {functional.get('detail')}"))
    return out


def probe_findings(snapshot: dict[str, Any]) -> list[dict[str, Any]]:
    out = [finding(WARN, "probe_step_failed", f"{e.get('step')}: {e.get('detail')}") for e in snapshot.get("errors") or []]
    if snapshot.get("shares_gpus"):
        out.append(finding(INFO, "shared_gpus", "several ranks share one GPU: functional checks are real, "
                                                "bandwidth and timings between them mean nothing"))
    return out


def findings(snapshot: dict[str, Any]) -> list[dict[str, Any]]:
    """All findings, FAIL first, then WARN, then INFO."""
    out = (probe_findings(snapshot) + p2p_findings(snapshot) + group_findings(snapshot) + acs_findings(snapshot)
           + host_findings(snapshot) + pcie_findings(snapshot) + health_findings(snapshot)
           + multicast_findings(snapshot) + pcie_box_findings(snapshot))
    order = {FAIL: 0, WARN: 1, INFO: 2}
    return sorted(out, key=lambda f: order[f["level"]])
