"""A box as the engines' gates read it: the GPUs a world size uses, their compute capability and
memory, the fabric between them and the NCCL they run. Read once, from a probe snapshot (a
sweep's, an import's or a file's) or, for an nccl-tests import without one, from what the log
shows (GPUs and nodes; the fabric unknown), then passed down typed: nothing below re-reads the
snapshot. Torch-free.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from commbench.topology.needs import full_nvlink, p2p_reason, vmm_reason
from commbench.topology.selection import gpu_pairs, p2p_entry, used_gpus, used_hosts

PROBED, IMPORTED, NONE = "probe snapshot", "nccl-tests import, no probe snapshot", "no box"


@dataclass(frozen=True)
class Box:
    """The facts of one box at one world size."""

    world_size: int
    source: str                  # PROBED | IMPORTED | NONE
    gpu_ids: tuple[int, ...] = ()   # the distinct GPUs the ranks use (snapshot order)
    shares_gpus: bool = False    # ranks share GPUs (an MPS emulation): fabric gates cannot be read
    nodes: int | None = None     # None: unknown
    cc: str = "?"                # compute capability "9.0"; "?" unknown
    gpu_name: str = ""
    memory_mib: float | None = None
    nvlink_all: bool = False     # NVLink between every pair (the link matrix, or NVML as vLLM asks)
    can_access_all: bool = False  # cudaDeviceCanAccessPeer on every pair
    p2p_ok: bool = False         # the probe's write-and-verify P2P check passed on every pair
    multicast: bool = False      # CU_DEVICE_ATTRIBUTE_MULTICAST_SUPPORTED on every GPU
    vmm_reason: str | None = None   # why cuMemCreate memory cannot be shared here (None: it can)
    nccl_version: tuple[int, ...] | None = None
    multicast_blocked: str | None = None   # the host's policy forbids multicast objects (the probe's own host)

    @property
    def has_gpus(self) -> bool:
        return self.source == IMPORTED or bool(self.gpu_ids)

    @property
    def fabric_known(self) -> bool:
        """False for an import without a snapshot: GPUs and nodes known, nothing about links."""
        return self.source == PROBED

    @property
    def log_only(self) -> bool:
        """An nccl-tests import without a probe snapshot: only NCCL's own path can be priced."""
        return self.source == IMPORTED

    @property
    def multi_node(self) -> bool:
        return bool(self.nodes and self.nodes > 1)

    @property
    def multicast_usable(self) -> bool:
        return self.multicast and self.multicast_blocked is None

    @property
    def cc_int(self) -> int | None:
        """'9.0' -> 90."""
        major, _, minor = self.cc.partition(".")
        return int(major) * 10 + int(minor) if major.isdigit() and minor.isdigit() else None

    @property
    def major(self) -> int | None:
        major = self.cc.partition(".")[0]
        return int(major) if major.isdigit() else None

    @property
    def said(self) -> str:
        """How an output names what the box was read from."""
        return self.source


def nccl_version(text: Any) -> tuple[int, ...] | None:
    """'2.28.9' -> (2, 28, 9); None when it is not a dotted version."""
    parts = str(text or "").split(".")
    return tuple(int(p) for p in parts) if parts and all(p.isdigit() for p in parts) else None


def _nvml_nvlink_all(snapshot: dict[str, Any], gpu_ids: list[int]) -> bool:
    """vLLM's is_fully_connected: NVML P2P status for the NVLINK index is OK on every pair."""
    return all(((p2p_entry(snapshot, a, b) or {}).get("nvml") or {}).get("nvlink") == "OK"
               for a, b in gpu_pairs(gpu_ids))


def nvlink_everywhere(snapshot: dict[str, Any], gpu_ids: list[int]) -> bool:
    """NVLink between every pair, by the link matrix or by NVML (vLLM's is_fully_connected asks NVML)."""
    return full_nvlink(snapshot, gpu_ids) or _nvml_nvlink_all(snapshot, gpu_ids)


def read(snapshot: dict[str, Any] | None, world_size: int, *, nccl: str | None = None,
         multicast_blocked: str | None = None) -> Box:
    """The box a probe snapshot shows at `world_size`. `nccl`: the NCCL a run recorded, used where
    the snapshot has none; `multicast_blocked`: why this host's policy forbids multicast objects
    (the probe passes its own host's; a run's analysis none)."""
    snapshot = snapshot if isinstance(snapshot, dict) else {}
    gpus = snapshot.get("gpus")
    used = used_gpus(snapshot, world_size) if isinstance(gpus, list) and gpus else []
    if not used:
        return Box(world_size, NONE)
    distinct = sorted(set(used))
    first = gpus[distinct[0]] if isinstance(gpus[distinct[0]], dict) else {}
    memory = first.get("memory_total_mib")
    software = snapshot.get("software") if isinstance(snapshot.get("software"), dict) else {}
    return Box(
        world_size, PROBED, tuple(distinct), shares_gpus=len(distinct) < len(used),
        nodes=len(used_hosts(snapshot, world_size)), cc=str(first.get("compute_capability", "?")),
        gpu_name=str(first.get("name") or ""),
        memory_mib=float(memory) if isinstance(memory, (int, float)) and memory > 0 else None,
        nvlink_all=len(distinct) > 1 and nvlink_everywhere(snapshot, distinct),
        can_access_all=all((p2p_entry(snapshot, a, b) or {}).get("can_access_peer") is True
                           for a, b in gpu_pairs(distinct)),
        p2p_ok=p2p_reason(snapshot, world_size) is None,
        multicast=all(((gpus[g] or {}).get("attributes") or {}).get("multicast") == 1 for g in distinct),
        vmm_reason=vmm_reason(snapshot, world_size),
        nccl_version=nccl_version(software.get("nccl")) or nccl_version(nccl),
        multicast_blocked=multicast_blocked)


def imported(world_size: int, nodes: int | None, nccl: str | None) -> Box:
    """An nccl-tests import without a probe snapshot: GPUs and nodes from its log, the fabric unknown."""
    return Box(world_size, IMPORTED, nodes=nodes if isinstance(nodes, int) and nodes > 0 else None,
               nccl_version=nccl_version(nccl))
