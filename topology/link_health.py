"""Driver and PCIe link health, read-only: which nvidia kernel module is loaded (open or
proprietary) and the registry overrides it was loaded with, the AER error counters of each GPU
and of the port at the other end of its link, and the link speed sysfs reports (read by the
probe's children while a GPU is busy: an idle GPU trains its link down to save power).

Nothing here writes: the remedies the findings print are for a human to apply.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

from commbench.topology.pcie import PCI_DEVICES, ancestors, normalize_bdf
from commbench.topology.sysfs import NEEDS_ROOT, read_or_note

NVIDIA_PROC = Path("/proc/driver/nvidia")
NVIDIA_MODULE = Path("/sys/module/nvidia")
# sysfs link speeds (GT/s) -> PCIe generation.
GEN_OF_GTS = {2.5: 1, 5.0: 2, 8.0: 3, 16.0: 4, 32.0: 5, 64.0: 6}
AER_FILES = {"correctable": "aer_dev_correctable", "nonfatal": "aer_dev_nonfatal", "fatal": "aer_dev_fatal"}
_REGISTRY_RE = re.compile(r'^RegistryDwords:\s*"(.*)"\s*$', re.MULTILINE)
_VERSION_RE = re.compile(r"Kernel Module\s+(?:for \S+\s+)?(\d+\.\d+(?:\.\d+)?)")


def module_flavor(version_text: str | None, taint: str | None) -> tuple[str, str]:
    """('open' | 'proprietary' | 'unknown', where that was read).

    /proc/driver/nvidia/version names the open build ("NVIDIA UNIX Open Kernel Module"); without
    it, the taint flags tell: a proprietary module taints the kernel with P, the open one
    (Dual MIT/GPL) does not.
    """
    if version_text and "Kernel Module" in version_text:
        flavor = "open" if "Open Kernel Module" in version_text else "proprietary"
        return flavor, "/proc/driver/nvidia/version"
    if taint and taint != NEEDS_ROOT:
        return ("proprietary" if "P" in taint else "open"), "/sys/module/nvidia/taint"
    return "unknown", "neither /proc/driver/nvidia/version nor /sys/module/nvidia/taint readable"


def registry_dwords(params_text: str | None) -> str | None:
    """The RegistryDwords the module was loaded with, from /proc/driver/nvidia/params."""
    match = _REGISTRY_RE.search(params_text or "")
    return match.group(1) if match else None


def nvidia_module(proc: Path = NVIDIA_PROC, module: Path = NVIDIA_MODULE) -> dict[str, Any]:
    """Flavor, version and registry overrides of the loaded nvidia module (no modinfo needed)."""
    if not module.exists() and not proc.exists():
        return {"flavor": "not loaded", "source": f"{module} absent", "version": None, "registry_dwords": None}
    version_text = read_or_note(proc / "version")
    flavor, source = module_flavor(version_text, read_or_note(module / "taint"))
    match = _VERSION_RE.search(version_text or "")
    return {"flavor": flavor, "source": source,
            "version": match.group(1) if match else read_or_note(module / "version"),
            "registry_dwords": registry_dwords(read_or_note(proc / "params"))}


def parse_aer(text: str) -> dict[str, int]:
    """aer_dev_* files: one 'Name count' per line (TOTAL_ERR_* among them)."""
    counts = {}
    for line in text.splitlines():
        parts = line.split()
        if len(parts) == 2 and parts[1].isdigit():
            counts[parts[0]] = int(parts[1])
    return counts


def aer_counters(bdf: str, root: Path = PCI_DEVICES) -> dict[str, Any] | None:
    """{'correctable': {...}, 'nonfatal': {...}, 'fatal': {...}} since boot; None without AER
    files (a kernel without AER reporting, or a device without the capability)."""
    out: dict[str, Any] = {}
    for kind, name in AER_FILES.items():
        text = read_or_note(root / bdf / name)
        if text is None:
            continue
        out[kind] = NEEDS_ROOT if text == NEEDS_ROOT else parse_aer(text)
    return {"bdf": bdf, **out} if out else None


def gpu_aer(bus_id: str, root: Path = PCI_DEVICES) -> dict[str, Any]:
    """AER counters of the GPU and of the port above it: the two ends of one link record
    errors each receives, so both are needed to see the link's health."""
    bdf = normalize_bdf(bus_id)
    above = ancestors(bdf, root) or []
    return {"gpu": aer_counters(bdf, root), "port": aer_counters(above[-1], root) if above else None}


def link_gen(speed_text: str | None) -> int | None:
    """'32.0 GT/s PCIe' -> 5; None when unreadable or unknown."""
    try:
        return GEN_OF_GTS.get(float((speed_text or "").split()[0]))
    except (ValueError, IndexError):
        return None


def _int_or_none(text: str | None) -> int | None:
    return int(text) if text and text.isdigit() else None


def link_state(bus_id: str, root: Path = PCI_DEVICES) -> dict[str, Any]:
    """Current and maximum PCIe generation and width of a GPU's own link, from sysfs."""
    path = root / normalize_bdf(bus_id)
    if not os.path.exists(path):
        return {"error": "GPU not found in /sys/bus/pci (container or VM?)"}
    return {"gen_current": link_gen(read_or_note(path / "current_link_speed")),
            "width_current": _int_or_none(read_or_note(path / "current_link_width")),
            "gen_max": link_gen(read_or_note(path / "max_link_speed")),
            "width_max": _int_or_none(read_or_note(path / "max_link_width"))}
