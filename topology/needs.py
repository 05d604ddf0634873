"""What a backend needs from the machine, checked against a probe snapshot (pure functions).

Backends declare their needs by name (commbench.backends.base.NEEDS: "cuda", "own_gpu", "node",
"p2p", "ipc", "vmm", "atomics", "multicast"); each name has one check here, returning None when
the snapshot shows it met, else the reason. The same names are checked against the running
processes by Backend.check(), with the same wording for what no snapshot can add.
"""

from __future__ import annotations

from typing import Any, Callable

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


# need name -> check(snapshot, world_size, allow_multicast), in the order of
# commbench.backends.base.NEEDS (a test keeps the two alike).
CHECKS: dict[str, Callable[[dict[str, Any], int, bool], str | None]] = {
    "multicast": multicast_reason,
    "node": lambda s, n, mc: node_local_reason(s, n),
    "cuda": lambda s, n, mc: gpu_reason(s, n),
    "own_gpu": lambda s, n, mc: shared_gpu_reason(s, n),
    "p2p": lambda s, n, mc: p2p_reason(s, n),
    "ipc": lambda s, n, mc: ipc_reason(s, n),
    "vmm": lambda s, n, mc: vmm_reason(s, n),
    "atomics": lambda s, n, mc: atomics_reason(s, n),
}


def gpu_side(needs: tuple[str, ...]) -> bool:
    """Every need but being in one node is about GPUs."""
    return bool(set(needs) - {"node"})


def needs_reason(needs: tuple[str, ...], snapshot: dict[str, Any], world_size: int,
                 allow_multicast: bool) -> str | None:
    """The first need the snapshot shows unmet, or None. Without GPUs nothing GPU-side is met."""
    if gpu_side(needs) and not snapshot.get("gpus"):
        return NO_GPU
    for need, check in CHECKS.items():
        reason = check(snapshot, world_size, allow_multicast) if need in needs else None
        if reason is not None:
            return reason
    return None
