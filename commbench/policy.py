"""Safety on shared machines: when NVLink multicast objects may be created.

Multicast (NCCL NVLS, torch multimem, FlashInfer MNNVL, cuMulticastCreate) is created only with
--allow-multicast and when no policy variable forbids it; these variables are kept in every
child process. A program that uses multicast can put a host's GPUs, which others share, out of
service, so hosts that lend GPUs set one of them. No torch here: the probe, the driver and the
analysis read these rules too.
"""

from __future__ import annotations

import os

# Variables that forbid NVLink multicast on a host.
MULTICAST_POLICY_VARS = {
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
}


def multicast_forbidden_by() -> list[str]:
    """Names of the policy variables that are set to forbid multicast."""
    return [f"{k}={os.environ[k]}" for k, v in MULTICAST_POLICY_VARS.items() if os.environ.get(k) == v]


def multicast_policy_reason(allow_multicast: bool) -> str | None:
    """None when multicast objects may be created; otherwise the reason they may not."""
    forbidden = multicast_forbidden_by()
    if forbidden:
        return "disabled by policy (" + ", ".join(forbidden) + ")"
    if not allow_multicast:
        return "not tested: pass --allow-multicast"
    return None
