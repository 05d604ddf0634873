"""Islands and placement (pure): which GPUs share a PCIe switch, a root port, a NUMA node or a
socket; which tensor-parallel groups stay inside one; the CUDA_VISIBLE_DEVICES for them.

Levels come from NVML's topology matrix (nvidia-smi topo -m): PIX = one PCIe switch between
the two GPUs, PXB = several bridges below one root port, PHB/NODE = the same NUMA node, SYS =
across the socket interconnect. Sockets come from each GPU's NUMA node and the package id of
that node's CPUs (host facts, numa_sockets); a snapshot without package ids lets a NUMA node
stand for a socket, and the output says so.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from commbench.topology.selection import is_nvlink, link

# NVML link label -> how far apart the two GPUs sit (0 = NVLink, 4 = across sockets).
LINK_DISTANCE = {"PIX": 1, "PXB": 2, "PHB": 3, "NODE": 3, "SYS": 4}
# (level name, largest link distance inside it), tightest first.
LEVELS = (("NVLink", 0), ("PCIe switch", 1), ("root port", 2), ("NUMA node", 3))
SOCKET = "socket"
ACROSS_SOCKETS = "across sockets"
ACROSS_NUMA = "across NUMA nodes (SYS; socket ids not in this snapshot)"
LEVEL_ORDER = [name for name, _ in LEVELS] + [SOCKET, ACROSS_NUMA, ACROSS_SOCKETS]
TP_SIZES = (2, 4, 8)


@dataclass(frozen=True)
class Placement:
    """Replicas of one tensor-parallel size, each a GPU group, with the tightest level it stays in."""

    host: str
    tp: int
    groups: tuple[tuple[int, ...], ...]   # snapshot GPU indices
    levels: tuple[str, ...]

    @property
    def spans_sockets(self) -> bool:
        return any(level in (ACROSS_SOCKETS, ACROSS_NUMA) for level in self.levels)


def distance(snapshot: dict[str, Any], a: int, b: int) -> int:
    label = link(snapshot, a, b)
    if is_nvlink(label):
        return 0
    return LINK_DISTANCE.get(label, 4)   # an unknown path counts as the farthest


def host_gpus(snapshot: dict[str, Any]) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {}
    for g in snapshot.get("gpus") or []:
        out.setdefault(g.get("host", ""), []).append(g["index"])
    return out


def components(snapshot: dict[str, Any], gpus: list[int], max_distance: int) -> dict[int, int]:
    """GPU -> lowest GPU index of its component when pairs up to max_distance join."""
    parent = {g: g for g in gpus}

    def find(g: int) -> int:
        while parent[g] != g:
            g = parent[g]
        return g

    for a in gpus:
        for b in gpus:
            if a < b and distance(snapshot, a, b) <= max_distance:
                ra, rb = find(a), find(b)
                parent[max(ra, rb)] = min(ra, rb)
    return {g: find(g) for g in gpus}


def socket_of(snapshot: dict[str, Any], gpu: int) -> int | None:
    g = snapshot["gpus"][gpu]
    sockets = (snapshot.get("hosts") or {}).get(g.get("host", ""), {}).get("numa_sockets") or {}
    return sockets.get(str(g.get("numa_node")))


def sockets_known(snapshot: dict[str, Any], gpus: list[int]) -> bool:
    return all(socket_of(snapshot, g) is not None for g in gpus)


def group_level(snapshot: dict[str, Any], group: list[int] | tuple[int, ...]) -> str:
    """The tightest level every GPU of the group shares."""
    for name, max_distance in LEVELS:
        if all(distance(snapshot, a, b) <= max_distance for a in group for b in group if a != b):
            return name
    if sockets_known(snapshot, list(group)):
        return SOCKET if len({socket_of(snapshot, g) for g in group}) == 1 else ACROSS_SOCKETS
    return ACROSS_NUMA


def islands(snapshot: dict[str, Any], gpus: list[int]) -> list[tuple[str, list[list[int]]]]:
    """Per level, the groups of two or more GPUs that share it (levels nobody shares left out)."""
    out = []
    for name, max_distance in LEVELS:
        comp = components(snapshot, gpus, max_distance)
        groups = [[g for g in gpus if comp[g] == root] for root in sorted(set(comp.values()))]
        if any(len(group) > 1 for group in groups):
            out.append((name, groups))
    if sockets_known(snapshot, gpus):
        by_socket: dict[int, list[int]] = {}
        for g in gpus:
            by_socket.setdefault(socket_of(snapshot, g), []).append(g)   # type: ignore[arg-type]
        out.append((SOCKET, [by_socket[k] for k in sorted(by_socket)]))
    return out


def _locality_key(snapshot: dict[str, Any], gpus: list[int]) -> dict[int, tuple[int, ...]]:
    """Sort key that keeps each island's GPUs next to each other, widest level first."""
    levels = [components(snapshot, gpus, d) for _, d in reversed(LEVELS)]
    return {g: (socket_of(snapshot, g) if socket_of(snapshot, g) is not None else -1,
                *(comp[g] for comp in levels), g) for g in gpus}


def placement(snapshot: dict[str, Any], host: str, gpus: list[int], tp: int, replicas: int) -> Placement:
    """`replicas` groups of `tp` GPUs: the GPUs ordered island by island and cut in order, then
    the tightest groups kept. Exact for islands whose sizes are multiples of tp (the usual
    2x4 and 1x8 boxes); otherwise a group crosses the boundary and says so in its level."""
    key = _locality_key(snapshot, gpus)
    ordered = sorted(gpus, key=lambda g: key[g])
    chunks = [tuple(ordered[i:i + tp]) for i in range(0, len(ordered) - tp + 1, tp)]
    ranked = sorted(chunks, key=lambda c: LEVEL_ORDER.index(group_level(snapshot, c)))[:replicas]
    groups = tuple(sorted(ranked))
    return Placement(host, tp, groups, tuple(group_level(snapshot, c) for c in groups))


def placements(snapshot: dict[str, Any]) -> list[Placement]:
    """One group and, where the box holds several, every replica, for TP 2, 4 and 8 per host."""
    out = []
    for host, gpus in host_gpus(snapshot).items():
        for tp in TP_SIZES:
            if tp > len(gpus):
                continue
            for replicas in sorted({1, len(gpus) // tp}):
                out.append(placement(snapshot, host, gpus, tp, replicas))
    return out


def cuda_visible_devices(snapshot: dict[str, Any], group: tuple[int, ...]) -> str:
    """CUDA ordinals as the probe saw them (relative to the probe's own CUDA_VISIBLE_DEVICES)."""
    gpus = snapshot["gpus"]
    return ",".join(str(gpus[g].get("cuda_ordinal", g)) for g in group)
