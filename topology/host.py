"""Host facts that decide whether P2P works, read-only: IOMMU mode, kernel command line,
PCIe ASPM policy, nvidia_uvm's HMM switch, NUMA nodes and CPU. Nothing is ever written."""

from __future__ import annotations

import os
import platform
import socket
from pathlib import Path
from typing import Any

from commbench.topology import link_health
from commbench.topology.pcie import PCI_DEVICES, normalize_bdf
from commbench.topology.sysfs import read_or_note

# iommu_group/type values (kernel >= 5.11) -> the mode that matters for P2P.
GROUP_TYPE_MODE = {"identity": "passthrough", "DMA": "translated", "DMA-FQ": "translated",
                   "blocked": "translated", "unmanaged": "translated"}


def iommu_mode(cmdline: str, gpu_bus_ids: list[str], root: Path = PCI_DEVICES,
               iommu_class: Path = Path("/sys/class/iommu")) -> dict[str, Any]:
    """off / passthrough / translated / unknown, with where it was read."""
    group_types: dict[str, str] = {}
    for bus_id in gpu_bus_ids:
        bdf = normalize_bdf(bus_id)
        value = read_or_note(root / bdf / "iommu_group" / "type")
        if value is not None:
            group_types[bdf] = value
    modes = {GROUP_TYPE_MODE.get(t) for t in group_types.values()} - {None}
    if len(modes) == 1:
        return {"mode": modes.pop(), "source": "iommu_group/type of the GPUs", "gpu_group_types": group_types}
    if len(modes) > 1:
        return {"mode": "mixed", "source": "iommu_group/type of the GPUs", "gpu_group_types": group_types}
    args = cmdline.split()
    if any(a in args for a in ("iommu=off", "intel_iommu=off", "amd_iommu=off")):
        return {"mode": "off", "source": "kernel command line"}
    if "iommu=pt" in args or "iommu.passthrough=1" in args:
        return {"mode": "passthrough", "source": "kernel command line"}
    try:
        units = os.listdir(iommu_class)
    except OSError:
        units = None
    if units == []:
        return {"mode": "off", "source": "/sys/class/iommu is empty"}
    if units:
        return {"mode": "translated", "source": f"{len(units)} IOMMU unit(s) in /sys/class/iommu, no iommu=pt"}
    return {"mode": "unknown", "source": "no IOMMU information readable"}


def aspm_policy() -> str | None:
    raw = read_or_note("/sys/module/pcie_aspm/parameters/policy")
    if raw and "[" in raw:
        return raw[raw.index("[") + 1:raw.index("]")]
    return raw


def uvm_disable_hmm() -> str:
    value = read_or_note("/sys/module/nvidia_uvm/parameters/uvm_disable_hmm")
    if value is None:
        return "nvidia_uvm not loaded" if not Path("/sys/module/nvidia_uvm").exists() else "parameter not present"
    return {"Y": "1", "N": "0"}.get(value, value)


def numa_nodes(base: Path = Path("/sys/devices/system/node")) -> dict[str, str]:
    out: dict[str, str] = {}
    if base.is_dir():
        for node in sorted(base.glob("node[0-9]*"), key=lambda p: int(p.name[4:])):
            out[node.name[4:]] = read_or_note(node / "cpulist") or ""
    return out


def numa_sockets(base: Path = Path("/sys/devices/system")) -> dict[str, int]:
    """NUMA node -> CPU package (socket) id, from the first CPU of each node: a socket may hold
    several NUMA nodes (AMD NPS2/NPS4), and islands are drawn by socket."""
    out: dict[str, int] = {}
    for node, cpus in numa_nodes(base / "node").items():
        first = cpus.split(",")[0].split("-")[0]
        package = read_or_note(base / "cpu" / f"cpu{first}" / "topology" / "physical_package_id")
        if first and package and package.isdigit():
            out[node] = int(package)
    return out


def cpu_model() -> str | None:
    text = read_or_note("/proc/cpuinfo")
    for line in (text or "").splitlines():
        if line.lower().startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or None


def host_facts(gpu_bus_ids: list[str]) -> dict[str, Any]:
    cmdline = read_or_note("/proc/cmdline") or ""
    return {
        "hostname": socket.gethostname(),
        "kernel": platform.release(),
        "cmdline": cmdline,
        "cpu": cpu_model(),
        "cpu_count": os.cpu_count(),
        "numa_nodes": numa_nodes(),
        "numa_sockets": numa_sockets(),
        "nvidia_module": link_health.nvidia_module(),
        "iommu": iommu_mode(cmdline, gpu_bus_ids),
        "aspm_policy": aspm_policy(),
        "uvm_disable_hmm": uvm_disable_hmm(),
    }


def gpu_numa_node(bus_id: str) -> int | None:
    value = read_or_note(PCI_DEVICES / normalize_bdf(bus_id) / "numa_node")
    try:
        return int(value) if value is not None else None
    except ValueError:
        return None


def gpu_cpu_affinity(bus_id: str) -> str | None:
    return read_or_note(PCI_DEVICES / normalize_bdf(bus_id) / "local_cpulist")
