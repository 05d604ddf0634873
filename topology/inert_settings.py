"""Engine and NCCL settings that do nothing on this box (pure): users turn them on, nothing
changes, and hours go into finding out why. Each rule names the version whose code it reads,
so a newer release that changes the rule shows up as a stale source, not as a silent lie.

`inert_settings(snapshot, world_size)` returns (setting, why, source) tuples; the probe prints
them, and the engine-settings module can take the same list.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from commbench.topology.selection import used_gpus, used_hosts
from commbench.topology.needs import full_nvlink

VLLM = "vLLM 0.33.0"
SGLANG = "SGLang 0.5.23"
NCCL_SYMMETRIC_PCIE_OFF = (2, 29, 2)   # first NCCL whose symmetric kernels need all-NVLink


class InertSetting(NamedTuple):
    setting: str
    why: str
    source: str


def nccl_version(snapshot: dict[str, Any]) -> tuple[int, ...] | None:
    """The NCCL torch carries, as recorded by the probe ('2.28.9'); None when unknown."""
    text = str((snapshot.get("software") or {}).get("nccl") or "")
    parts = text.split(".")
    return tuple(int(p) for p in parts) if parts and all(p.isdigit() for p in parts) else None


def _fusion_rules(cc: str) -> list[InertSetting]:
    if not cc.startswith("12."):
        return []
    return [
        InertSetting("vLLM compilation pass fuse_allreduce_rms (FlashInfer allreduce + RMSNorm fusion)",
                     f"turned on automatically at -O2 on SM 9.0 and 10.0 only; its size table "
                     f"FI_ALLREDUCE_FUSION_MAX_SIZE_MB has no row for compute capability {cc}, so nothing is fused",
                     f"{VLLM} compilation/passes/fusion/allreduce_rms_fusion.py"),
        InertSetting("SGLang --enable-flashinfer-allreduce-fusion",
                     f"an alias of --flashinfer-allreduce-fusion-backend=auto, which needs SM90 or SM10x: on compute "
                     f"capability {cc} it silently does nothing",
                     f"{SGLANG} srt/layers/flashinfer_comm_fusion.py, srt/arg_groups/serving_hook.py"),
    ]


def _symm_mem_rules(cc: str, multicast: bool) -> list[InertSetting]:
    out = []
    if cc == "12.0":
        out.append(InertSetting("vLLM VLLM_ALLREDUCE_USE_SYMM_MEM=1 (torch symmetric-memory allreduce, on by default)",
                                "SYMM_MEM_ALL_REDUCE_MAX_SIZES gives sizes for compute capability 9.0 and 10.0 and "
                                "none for 12.0: no message takes this path",
                                f"{VLLM} distributed/device_communicators/symm_mem.py"))
    if not multicast:
        out.append(InertSetting("SGLang --enable-torch-symm-mem",
                                "the communicator disables itself when the GPUs have no multicast (PCIe GPUs never do)",
                                f"{SGLANG} distributed/device_communicators/torch_symm_mem.py"))
    return out


def _custom_allreduce_rule(world_size: int, nvlink: bool) -> list[InertSetting]:
    if world_size <= 2 or nvlink:
        return []
    return [InertSetting("vLLM / SGLang custom allreduce (on by default: no --disable-custom-all-reduce needed to "
                         "turn it off here)",
                         f"above 2 GPUs it needs NVLink between every pair ('not supported on more than two "
                         f"PCIe-only GPUs'); at TP {world_size} without full NVLink both engines fall back to NCCL",
                         f"{VLLM} distributed/device_communicators/custom_all_reduce.py; "
                         f"{SGLANG} custom_all_reduce.py")]


def _nccl_symmetric_rule(version: tuple[int, ...] | None, world_size: int, nvlink: bool) -> list[InertSetting]:
    if version is None or version < NCCL_SYMMETRIC_PCIE_OFF or nvlink or world_size < 2:
        return []
    shown = ".".join(str(p) for p in version)
    return [InertSetting("NCCL symmetric kernels (vLLM VLLM_USE_NCCL_SYMM_MEM=1, SGLang --enable-symm-mem, "
                         "NCCL_SYM_KERNEL)",
                         f"from NCCL 2.29.2 the built-in symmetric kernels run only on fully NVLink-connected systems "
                         f"(ncclSymkAvailable() is false otherwise): NCCL {shown} here uses its regular kernels",
                         "NCCL 2.29.2, commit ebd1e929 (src/sym_kernels.cc)")]


def inert_settings(snapshot: dict[str, Any], world_size: int) -> list[InertSetting]:
    """Settings that change nothing at this world size on this box, each with why and the rule's source."""
    gpus_used = used_gpus(snapshot, world_size)
    if not gpus_used or len(used_hosts(snapshot, world_size)) > 1:
        return []
    gpus = snapshot["gpus"]
    cc = str(gpus[gpus_used[0]].get("compute_capability", "?"))
    distinct = sorted(set(gpus_used))
    nvlink = len(distinct) > 1 and full_nvlink(snapshot, distinct)
    multicast = all((gpus[g].get("attributes") or {}).get("multicast") == 1 for g in distinct)
    return (_fusion_rules(cc) + _symm_mem_rules(cc, multicast) + _custom_allreduce_rule(world_size, nvlink)
            + _nccl_symmetric_rule(nccl_version(snapshot), world_size, nvlink))
