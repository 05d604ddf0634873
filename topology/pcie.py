"""The PCIe path between two GPUs and the ACS control bits on its bridges (sysfs, read-only).

ACS request/completion redirect on a bridge between two GPUs sends their peer traffic up to
the root complex (and through the IOMMU when it translates): P2P then hangs, corrupts or
crawls while every capability query still says yes (NVIDIA/nccl#2079, vllm#51513). The
extended config space that holds ACS is readable by root only; other users get the first
64 bytes, which is reported as 'unknown (needs root)'. Nothing here ever writes.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

from commbench.topology.sysfs import NEEDS_ROOT, Unreadable, read_bytes

PCI_DEVICES = Path("/sys/bus/pci/devices")
BDF = re.compile(r"^[0-9a-fA-F]{4}:[0-9a-fA-F]{2}:[0-9a-fA-F]{2}\.[0-7]$")
EXT_CAP_START = 0x100
EXT_CAP_ACS = 0x000D
ACS_FLAGS = ("SrcValid", "TransBlk", "ReqRedir", "CmpltRedir", "UpstreamFwd", "EgressCtrl", "DirectTrans")


def normalize_bdf(bus_id: str) -> str:
    """NVML/CUDA write '00000000:1B:00.0'; sysfs wants '0000:1b:00.0'."""
    domain, _, rest = bus_id.strip().lower().rpartition(":")
    domain, _, bus = domain.rpartition(":") if domain.count(":") else ("", "", domain)
    domain = (domain or "0")[-4:].rjust(4, "0")
    return f"{domain}:{bus.rjust(2, '0')}:{rest}"


def ancestors(bdf: str, root: Path = PCI_DEVICES) -> list[str] | None:
    """The bridges above a device, top first; None when the device is not in sysfs."""
    path = root / bdf
    if not path.exists():
        return None
    parts = os.path.realpath(path).split(os.sep)
    return [p for p in parts if BDF.match(p) and p != bdf]


def path_bridges(bdf_a: str, bdf_b: str, root: Path = PCI_DEVICES) -> list[str] | None:
    """Bridges a peer packet crosses between a and b: both branches below their lowest common
    bridge, and that bridge itself. None when either device is unknown to sysfs."""
    up_a, up_b = ancestors(bdf_a, root), ancestors(bdf_b, root)
    if up_a is None or up_b is None:
        return None
    common = 0
    while common < min(len(up_a), len(up_b)) and up_a[common] == up_b[common]:
        common += 1
    meeting = [up_a[common - 1]] if common else []
    return meeting + up_a[common:] + up_b[common:]


def parse_acs(config: bytes) -> dict[str, Any]:
    """ACS capability from a config-space dump; {'acs': 'none'} when the bridge has none."""
    if len(config) <= EXT_CAP_START:
        return {"error": NEEDS_ROOT}
    offset, seen = EXT_CAP_START, set()
    while offset and offset not in seen and offset + 8 <= len(config):
        seen.add(offset)
        header = int.from_bytes(config[offset:offset + 4], "little")
        if header in (0, 0xFFFFFFFF):
            break
        if header & 0xFFFF == EXT_CAP_ACS:
            control = int.from_bytes(config[offset + 6:offset + 8], "little")
            flags = [f"{name}{'+' if control >> bit & 1 else '-'}" for bit, name in enumerate(ACS_FLAGS)]
            return {"acs_ctl": f"0x{control:04x}", "flags": flags,
                    "req_redir": bool(control & 0x4), "cmplt_redir": bool(control & 0x8)}
        offset = (header >> 20) & 0xFFC
    return {"acs": "none"}


def bridge_acs(bdf: str, root: Path = PCI_DEVICES) -> dict[str, Any]:
    try:
        config = read_bytes(root / bdf / "config")
    except Unreadable:
        return {"bdf": bdf, "error": NEEDS_ROOT}
    if config is None:
        return {"bdf": bdf, "error": "config space not found"}
    return {"bdf": bdf, **parse_acs(config)}


def gpu_pair_paths(bus_ids: list[str], root: Path = PCI_DEVICES) -> list[dict[str, Any]]:
    """For each unordered GPU pair: the bridges on its path and their ACS state."""
    bdfs = [normalize_bdf(b) for b in bus_ids]
    cache: dict[str, dict[str, Any]] = {}
    out = []
    for i in range(len(bdfs)):
        for j in range(i + 1, len(bdfs)):
            bridges = path_bridges(bdfs[i], bdfs[j], root)
            if bridges is None:
                out.append({"a": i, "b": j, "error": "GPU not found in /sys/bus/pci (container or VM?)"})
                continue
            for b in bridges:
                if b not in cache:
                    cache[b] = bridge_acs(b, root)
            out.append({"a": i, "b": j, "bridges": [cache[b] for b in bridges]})
    return out
