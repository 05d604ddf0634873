"""Can each backend run here, and what would vLLM and SGLang pick? Pure functions of a snapshot.

backend_verdicts / reason_for: None = can run, else the reason. The rules follow what each
backend needs from the fabric (reference/backends.md):
- CUDA-IPC P2P kernels (p2p:*, FlashInfer trtllm/fused/pcie_ipc, MSCCL++): every pair of the
  run's GPUs passes the functional write-and-verify, legacy CUDA IPC works across processes,
  and all ranks sit in one node.
- torch symmetric memory and FlashInfer trtllm/fused/mnnvl also need cuMemCreate buffers that
  export as POSIX file descriptors and import in the peer process (the VMM check).
- multicast users (symm_mem:multimem, flashinfer:mnnvl, NCCL NVLS/NVLSTree) need the driver's
  multicast attribute on every GPU AND permission: commbench.sweep.context.multicast_policy_reason.
LL128 without NVLink is not a skip but a warning (nccl_unsafe_reason): NCCL's docs say forcing
it where unsupported can corrupt data, and a benchmark should show that, flagged.
"""

from __future__ import annotations

from typing import Any

from commbench.backends.base import parse_variant_options
from commbench.policy import multicast_policy_reason
from commbench.topology.selection import gpu_pairs, is_nvlink, link, p2p_entry, participant_gpu, used_gpus, \
    used_hosts

NO_GPU = "no CUDA GPU"
KNOWN_BACKENDS = (
    "nccl", "nccl:proto=LL", "nccl:proto=LL128", "nccl:proto=Simple",
    *(f"nccl:proto={p},algo={a}" for p in ("LL", "LL128", "Simple") for a in ("Ring", "Tree", "NVLS", "NVLSTree")),
    "p2p:oneshot", "p2p:twoshot", "p2p:auto", "p2p:oneshot_pull",
    "symm_mem:one_shot", "symm_mem:two_shot", "symm_mem:multimem",
    "flashinfer:trtllm_oneshot", "flashinfer:trtllm_twoshot", "flashinfer:fused_oneshot",
    "flashinfer:fused_twoshot", "flashinfer:pcie_ipc", "flashinfer:mnnvl",
    "mscclpp", "mscclpp:shim", "gloo",
)
MULTICAST_ALGOS = ("NVLS", "NVLSTree")


# ---------------------------------------------------------------------------------------------
# Requirement checks: each returns None (met) or the reason (not met)
# ---------------------------------------------------------------------------------------------

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
        return "ranks share a GPU: NCCL refuses two ranks on one device"
    return None


# ---------------------------------------------------------------------------------------------
# Backend rules
# ---------------------------------------------------------------------------------------------

def _needs(snapshot: dict[str, Any], world_size: int, allow_multicast: bool, *needs: str) -> str | None:
    checks = {
        "node": lambda: node_local_reason(snapshot, world_size),
        "p2p": lambda: p2p_reason(snapshot, world_size),
        "ipc": lambda: ipc_reason(snapshot, world_size),
        "vmm": lambda: vmm_reason(snapshot, world_size),
        "multicast": lambda: multicast_reason(snapshot, world_size, allow_multicast),
        "atomics": lambda: atomics_reason(snapshot, world_size),
        "own_gpu": lambda: shared_gpu_reason(snapshot, world_size),
    }
    for need in needs:
        reason = checks[need]()
        if reason is not None:
            return reason
    return None


def reason_for(backend_name: str, snapshot: dict[str, Any], world_size: int, allow_multicast: bool) -> str | None:
    """None when backend_name (any variant spelling) can run here, else the reason."""
    family, _, variant = backend_name.partition(":")
    options = parse_variant_options(variant or None)
    if family == "gloo":
        return None
    if family not in ("nccl", "p2p", "symm_mem", "flashinfer", "mscclpp"):
        return None
    if not snapshot.get("gpus"):
        return NO_GPU
    need = lambda *n: _needs(snapshot, world_size, allow_multicast, *n)  # noqa: E731
    if family == "nccl":
        algos = {a.strip() for a in options.get("algo", "").split("|")}
        if algos & set(MULTICAST_ALGOS):
            return need("own_gpu", "multicast")
        return need("own_gpu")
    if family in ("p2p", "mscclpp"):
        return need("node", "p2p", "ipc")
    if family == "symm_mem":
        if "multimem" in options:
            return need("node", "p2p", "vmm", "multicast")
        # Its signal pad is set with system-scope CAS on the peer's memory: PCIe needs P2P atomics.
        return need("node", "p2p", "ipc", "vmm", "atomics")
    if "mnnvl" in options:
        return need("node", "p2p", "vmm", "multicast")
    if "pcie_ipc" in options:   # cudaMalloc + cudaIpcGetMemHandle buffers, no cuMemCreate
        return need("node", "p2p", "ipc")
    return need("node", "p2p", "ipc", "vmm")


def backend_verdicts(snapshot: dict[str, Any], world_size: int, allow_multicast: bool) -> dict[str, str | None]:
    return {name: reason_for(name, snapshot, world_size, allow_multicast) for name in KNOWN_BACKENDS}


def full_nvlink(snapshot: dict[str, Any], gpu_ids: list[int]) -> bool:
    return all(is_nvlink(link(snapshot, a, b)) for a, b in gpu_pairs(gpu_ids))


def nccl_unsafe_reason(backend_name: str, snapshot: dict[str, Any]) -> str | None:
    """A warning for a variant that may run but give wrong answers here."""
    family, _, variant = backend_name.partition(":")
    if family != "nccl":
        return None
    protos = {p.strip() for p in parse_variant_options(variant or None).get("proto", "").split("|")}
    gpus = [g["index"] for g in snapshot.get("gpus") or []]
    if "LL128" in protos and len(gpus) > 1 and not full_nvlink(snapshot, gpus):
        return "LL128 forced without NVLink: may corrupt data"
    return None


# ---------------------------------------------------------------------------------------------
# Explain: what the serving engines would pick here
# ---------------------------------------------------------------------------------------------

def _cc(snapshot: dict[str, Any]) -> str:
    gpus = snapshot.get("gpus") or []
    return gpus[0].get("compute_capability", "?") if gpus else "?"


def _nvml_nvlink_all(snapshot: dict[str, Any], gpu_ids: list[int]) -> bool:
    """vLLM's is_fully_connected: NVML P2P status for the NVLINK index is OK on every pair."""
    for a, b in gpu_pairs(gpu_ids):
        nv = (p2p_entry(snapshot, a, b) or {}).get("nvml") or {}
        if nv.get("nvlink") != "OK":
            return False
    return True


def _can_access_all(snapshot: dict[str, Any], gpu_ids: list[int]) -> bool:
    return all((p2p_entry(snapshot, a, b) or {}).get("can_access_peer") is True for a, b in gpu_pairs(gpu_ids))


def explain(snapshot: dict[str, Any], world_size: int) -> list[str]:
    """Which allreduce path vLLM 0.33.0 and SGLang 0.5.23 would take on this box, and why."""
    if not snapshot.get("gpus"):
        return ["No CUDA GPU in this snapshot: vLLM and SGLang would not start a CUDA tensor-parallel group."]
    if world_size < 2:
        return [f"World size {world_size}: there is nothing to all-reduce; pass --world-size N to see TP=N."]
    gpus = used_gpus(snapshot, world_size)
    distinct = sorted(set(gpus))
    nvlink = _nvml_nvlink_all(snapshot, gpus)
    p2p_ok = p2p_reason(snapshot, world_size) is None
    can_access = _can_access_all(snapshot, gpus)
    vmm_fail = vmm_reason(snapshot, world_size)
    cc = _cc(snapshot)
    multi_node = len(used_hosts(snapshot, world_size)) > 1
    mc_attr = all((snapshot["gpus"][g].get("attributes") or {}).get("multicast") == 1 for g in distinct)
    mc_allowed = multicast_policy_reason(True) is None
    pair_text = "n/a (one GPU, ranks share it)" if len(distinct) == 1 else "yes" if nvlink else "no"
    lines = [f"TP={world_size} on GPUs {distinct} (compute capability {cc}); "
             f"NVLink between every pair (NVML): {pair_text}; functional P2P: "
             f"{'yes' if p2p_ok else 'no'}; multicast attribute: {'yes' if mc_attr else 'no'}."]
    # --- vLLM 0.33.0 ---
    ca = "on"
    if multi_node:
        ca = "off: the group spans nodes (rule: custom_all_reduce.py, vLLM 0.33.0)"
    elif world_size not in (2, 4, 6, 8):
        ca = f"off: world size {world_size} is not one of 2, 4, 6, 8 (_SUPPORTED_WORLD_SIZES, vLLM 0.33.0)"
    elif world_size > 2 and not nvlink:
        ca = ("off: 'not supported on more than two PCIe-only GPUs' — is_fully_connected() asks NVML for "
              "NVLink on every pair and never tests PCIe peer access (vLLM 0.33.0)")
    elif not can_access:
        ca = "off: cudaDeviceCanAccessPeer is false on some pair (VLLM_SKIP_P2P_CHECK=1 default, vLLM 0.33.0)"
    if ca == "on":
        if world_size == 2:
            stage = "always 1-stage at TP2"
        else:
            limit = "512 KiB" if world_size <= 4 else "256 KiB"
            stage = f"1-stage below {limit}, 2-stage above (full NVLink)"
        ca = f"on: {stage}, inputs below 8 MiB (vLLM 0.33.0 custom_all_reduce.cuh)"
        if not p2p_ok:
            ca += ("; WARNING: vLLM trusts cudaDeviceCanAccessPeer by default but the write-and-verify check "
                   "failed here — expect a hang or wrong output; use --disable-custom-all-reduce or "
                   "VLLM_SKIP_P2P_CHECK=0")
    lines.append(f"vLLM 0.33.0 custom allreduce (CUDA IPC): {ca}.")
    if not mc_attr:
        symm = "off: no multicast on these GPUs, so the symmetric-memory handle has multicast_ptr == 0"
    elif not mc_allowed:
        symm = ("off: TORCH_SYMM_MEM_DISABLE_MULTICAST/NCCL_NVLS_ENABLE policy leaves multicast_ptr == 0, and vLLM "
                "disables the communicator even for two-shot")
    elif cc not in ("9.0", "10.0"):
        symm = f"off: no SYMM_MEM_ALL_REDUCE_MAX_SIZES entry for compute capability {cc}"
    else:
        kind = "multimem" if world_size in ((4, 6, 8) if cc == "9.0" else (6, 8)) else "two-shot"
        symm = f"on ({kind}) for sizes above the custom-allreduce limit"
    lines.append(f"vLLM 0.33.0 torch symmetric memory (VLLM_ALLREDUCE_USE_SYMM_MEM=1 default): {symm}.")
    if vmm_fail:
        fi = f"off: FlashInfer's cuMemCreate workspace cannot be shared here ({vmm_fail})"
    elif multi_node:
        fi = "trtllm is single-node only; mnnvl needs multicast across nodes"
    elif mc_attr:
        fi = ("backend 'auto' resolves to mnnvl on one node and creates a multicast object (cuMulticastCreate)"
              + ("" if mc_allowed else " — forbidden by this host's policy: set VLLM_FLASHINFER_ALLREDUCE_BACKEND=trtllm"))
    else:
        fi = "backend 'auto' falls back to trtllm (cuMemCreate + POSIX FD buffers, no multicast)"
    if world_size not in (2, 4, 8, 16) and not vmm_fail:
        fi += f"; the AR+RMSNorm fusion pass skips world size {world_size} (supports 2, 4, 8, 16)"
    lines.append(f"vLLM 0.33.0 FlashInfer allreduce (VLLM_ALLREDUCE_USE_FLASHINFER=1 default): {fi}.")
    lines.append("vLLM 0.33.0 fallback: PyNccl (NCCL) for every size the paths above do not take.")
    # --- SGLang 0.5.23 ---
    sg_ca = ca.split(":")[0] if ca.startswith("off") else "on (same gate as vLLM: ws 2/4/6/8, NVLink for >2 GPUs, 8 MiB max)"
    lines.append(f"SGLang 0.5.23 custom allreduce v1: {sg_ca}"
                 + (f" — {ca.split(':', 1)[1].strip()}" if ca.startswith("off") else "") + ".")
    if cc.split(".")[0] not in ("9", "10"):
        sg_fi = f"off: needs SM90 or SM10x, this is compute capability {cc}"
    elif vmm_fail:
        sg_fi = ("off: its cuMemCreate preflight would fail on at least one rank "
                 f"('Skipping allreduce fusion to avoid cross-rank desync'); here: {vmm_fail}")
    elif cc.startswith("9"):
        sg_fi = "on with backend 'auto' -> trtllm (SM90, single node)"
    else:
        sg_fi = "on with backend 'auto' -> mnnvl (Blackwell) — needs multicast" + ("" if mc_attr and mc_allowed else
                                                                                  ", unavailable here")
    lines.append(f"SGLang 0.5.23 FlashInfer allreduce fusion (fused AR+residual+RMSNorm models): {sg_fi}.")
    sg_symm = ("on if --enable-torch-symm-mem (multimem on SM9/SM10 at 4/6/8 ranks, else two-shot)"
               if mc_attr and mc_allowed else "off even with --enable-torch-symm-mem: no multicast")
    lines.append(f"SGLang 0.5.23 torch symmetric memory: {sg_symm}.")
    mscclpp = ("available with --enable-mscclpp" if world_size in (4, 8, 16, 32, 64) and p2p_ok
               else "not used: needs 4/8/16/.. ranks with working P2P" if world_size not in (4, 8, 16, 32, 64)
               else "would fail: P2P does not work here")
    lines.append(f"SGLang 0.5.23 MSCCL++: {mscclpp}; fallback: PyNccl.")
    return lines
