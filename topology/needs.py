"""What a backend needs from the machine, checked against a probe snapshot (pure functions).

Backends declare their needs by name ("cuda", "own_gpu", "node", "p2p", "ipc", "vmm", "atomics",
"multicast"); NEEDS below is the one table of them: what each means, its check against a
snapshot (None when met, else the reason) and, where the running processes can answer, its check
against them (Backend.check()), in the order both are checked.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Protocol

from commbench.policy import multicast_policy_reason
from commbench.topology.selection import gpu_pairs, is_nvlink, link, p2p_entry, participant_gpu, used_gpus, \
    used_hosts

NO_GPU = "no CUDA GPU"
SHARED_GPU = "ranks share a GPU, and this backend needs one GPU per rank"


def _first_failures(items: list[str], what: str) -> str:
    more = f" (and {len(items) - 1} more)" if len(items) > 1 else ""
    return f"{what}: {items[0]}{more}"


def p2p_reason(snapshot: dict[str, Any], world_size: int) -> str | None:
    bad = []
    for a, b in gpu_pairs(used_gpus(snapshot, world_size)):
        entry = p2p_entry(snapshot, a, b)
        check = (entry or {}).get("write_verify") or {}
        if check.get("status") == "ok":
            continue
        if not check:
            bad.append(f"GPU {a} -> GPU {b} not tested")
        else:
            bad.append(f"GPU {a} -> GPU {b} {check.get('status', '?').upper()}"
                       + (f" ({check['detail']})" if check.get("detail") else ""))
    return _first_failures(bad, "no functional P2P") if bad else None


def _group_reason(snapshot: dict[str, Any], world_size: int, section: str, what: str) -> str | None:
    gpus = used_gpus(snapshot, world_size)
    if len(gpus) < 2:
        return None
    group = snapshot.get(section) or {}
    if not group.get("tested"):
        return f"{what} not tested"
    gpu_of = participant_gpu(snapshot)
    wanted = set(gpus)
    bad, seen = [], set()
    for pair in group.get("pairs", []):
        gw, go = gpu_of.get(pair["writer"]), gpu_of.get(pair["owner"])
        if gw not in wanted or go not in wanted:
            continue
        seen.add((gw, go))
        if pair["status"] != "ok":
            bad.append(f"{pair['status'].upper()}: {pair.get('detail')}")
    for export in group.get("exports", []):
        if export["status"] != "ok" and gpu_of.get(export["participant"]) in wanted:
            bad.insert(0, f"export by participant {export['participant']} failed: {export.get('detail')}")
    needed = {(a, b) for a in wanted for b in wanted if a != b or gpus.count(a) > 1}
    missing = sorted(needed - seen)
    if missing and not bad:
        bad.append(f"GPU {missing[0][0]} -> GPU {missing[0][1]} not tested")
    return _first_failures(bad, what + " failed") if bad else None


def ipc_reason(snapshot: dict[str, Any], world_size: int) -> str | None:
    return _group_reason(snapshot, world_size, "ipc", "CUDA IPC (cudaIpcGetMemHandle/OpenMemHandle)")


def vmm_reason(snapshot: dict[str, Any], world_size: int) -> str | None:
    gpus = snapshot.get("gpus") or []
    for g in sorted(set(used_gpus(snapshot, world_size))):
        attrs = gpus[g].get("attributes") or {}
        if attrs.get("vmm") == 0:
            return f"GPU {g} has no virtual memory management (CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED=0)"
        if attrs.get("posix_fd_handle") == 0:
            return f"GPU {g} cannot export POSIX file descriptors (CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED=0)"
    return _group_reason(snapshot, world_size, "vmm", "cuMemCreate -> POSIX FD export -> import -> cuMemSetAccess")


def atomics_reason(snapshot: dict[str, Any], world_size: int) -> str | None:
    """Peer atomics on every pair of distinct GPUs, where NVML says (NVLink pairs have them)."""
    bad = []
    for a, b in gpu_pairs(sorted(set(used_gpus(snapshot, world_size)))):
        status = ((p2p_entry(snapshot, a, b) or {}).get("nvml") or {}).get("atomics")
        if status is not None and status != "OK":
            bad.append(f"GPU {a} -> GPU {b} {status}")
    return _first_failures(bad, "no P2P atomics (NVML)") if bad else None


def multicast_reason(snapshot: dict[str, Any], world_size: int, allow_multicast: bool) -> str | None:
    gpus = snapshot.get("gpus") or []
    for g in sorted(set(used_gpus(snapshot, world_size))):
        if (gpus[g].get("attributes") or {}).get("multicast") != 1:
            return f"no multicast: GPU {g} reports CU_DEVICE_ATTRIBUTE_MULTICAST_SUPPORTED=0"
    policy = multicast_policy_reason(allow_multicast)
    if policy is not None:
        return f"multicast {policy}"
    functional = ((snapshot.get("multicast") or {}).get("functional") or {})
    if functional.get("status") == "fail":
        return f"multicast setup failed: {functional.get('detail')}"
    return None


def node_local_reason(snapshot: dict[str, Any], world_size: int) -> str | None:
    hosts = used_hosts(snapshot, world_size)
    if len(hosts) > 1:
        return f"node-local backend: the ranks span {len(hosts)} hosts"
    return None


def shared_gpu_reason(snapshot: dict[str, Any], world_size: int) -> str | None:
    gpus = used_gpus(snapshot, world_size)
    if len(set(gpus)) < len(gpus):
        return SHARED_GPU
    return None


def gpu_reason(snapshot: dict[str, Any], world_size: int) -> str | None:
    return None if snapshot.get("gpus") else NO_GPU


def full_nvlink(snapshot: dict[str, Any], gpu_ids: list[int]) -> bool:
    return all(is_nvlink(link(snapshot, a, b)) for a, b in gpu_pairs(gpu_ids))


class Ranks(Protocol):
    """What a need's check reads of the running ranks (commbench.runtime.context.RunContext)."""

    is_cuda: bool
    shares_gpus: bool
    nodes: int
    multicast_reason: str | None

    @property
    def device(self) -> Any: ...


def _ranks_cuda(ranks: Ranks) -> str | None:
    return None if ranks.is_cuda else "needs CUDA GPUs; this run is on the CPU"


def _ranks_own_gpu(ranks: Ranks) -> str | None:
    return "needs one GPU per rank, and these ranks share a GPU" if ranks.shares_gpus else None


def _ranks_node(ranks: Ranks) -> str | None:
    if ranks.nodes > 1:
        return f"node-local backend: this run spans {ranks.nodes} nodes (P2P/IPC only works within one node)"
    return None


def _ranks_multicast(ranks: Ranks) -> str | None:
    if ranks.multicast_reason:
        return f"needs NVLink multicast: {ranks.multicast_reason}"
    if ranks.is_cuda:
        from commbench.topology.cudadrv import multicast_supported   # the driver only where there is one

        if not multicast_supported(ranks.device.index or 0):
            return "needs NVLink multicast: CU_DEVICE_ATTRIBUTE_MULTICAST_SUPPORTED is 0 on this GPU"
    return None


@dataclass(frozen=True)
class Need:
    description: str
    on_snapshot: Callable[[dict[str, Any], int, bool], str | None]   # (snapshot, world_size, allow_multicast)
    on_ranks: Callable[[Ranks], str | None] | None = None            # None: only a snapshot can tell


# Every need, in the order they are checked (the most basic first).
NEEDS: dict[str, Need] = {
    "multicast": Need("NVLink multicast (and permission to create it)", multicast_reason, _ranks_multicast),
    "node": Need("every rank in one node", lambda s, n, mc: node_local_reason(s, n), _ranks_node),
    "cuda": Need("CUDA GPUs", lambda s, n, mc: gpu_reason(s, n), _ranks_cuda),
    "own_gpu": Need("one GPU per rank", lambda s, n, mc: shared_gpu_reason(s, n), _ranks_own_gpu),
    "p2p": Need("functional P2P between every pair of GPUs", lambda s, n, mc: p2p_reason(s, n)),
    "ipc": Need("CUDA IPC between processes", lambda s, n, mc: ipc_reason(s, n)),
    "vmm": Need("cuMemCreate buffers shared as POSIX file descriptors", lambda s, n, mc: vmm_reason(s, n)),
    "atomics": Need("P2P atomics between every pair of GPUs", lambda s, n, mc: atomics_reason(s, n)),
}


def ranks_reason(needs: tuple[str, ...], ranks: Ranks) -> str | None:
    """The first need the running ranks show unmet, or None (also where only a snapshot can tell)."""
    for name, need in NEEDS.items():
        reason = need.on_ranks(ranks) if name in needs and need.on_ranks is not None else None
        if reason is not None:
            return reason
    return None


def gpu_side(needs: tuple[str, ...]) -> bool:
    """Every need but being in one node is about GPUs."""
    return bool(set(needs) - {"node"})


def needs_reason(needs: tuple[str, ...], snapshot: dict[str, Any], world_size: int,
                 allow_multicast: bool) -> str | None:
    """The first need the snapshot shows unmet, or None. Without GPUs nothing GPU-side is met."""
    if gpu_side(needs) and not snapshot.get("gpus"):
        return NO_GPU
    for name, need in NEEDS.items():
        reason = need.on_snapshot(snapshot, world_size, allow_multicast) if name in needs else None
        if reason is not None:
            return reason
    return None
