"""What ran: versions, the relevant environment, host and GPUs, for run.json."""

from __future__ import annotations

import os
import socket
from typing import Any

import torch

from commbench.results import ENV_PREFIXES
from commbench.topology.software import installed_versions

def _driver_version() -> str | None:
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            version = pynvml.nvmlSystemGetDriverVersion()
            return version.decode() if isinstance(version, bytes) else version
        finally:
            pynvml.nvmlShutdown()
    except Exception:  # NVML missing or not loadable: the field stays unknown
        return None


def software_versions() -> dict[str, Any]:
    return {**installed_versions(), "nvidia_driver": _driver_version()}


def relevant_env() -> dict[str, str]:
    return {k: v for k, v in sorted(os.environ.items()) if k.startswith(ENV_PREFIXES)}


def local_device_info(device: torch.device) -> dict[str, Any]:
    """This rank's host and device, gathered by rank 0 into run.json's `gpus`."""
    info: dict[str, Any] = {"host": socket.gethostname(), "pid": os.getpid(), "device": str(device)}
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        info.update(name=props.name, memory_bytes=props.total_memory,
                    compute_capability=f"{props.major}.{props.minor}",
                    sm_count=props.multi_processor_count, uuid=str(getattr(props, "uuid", "")),
                    pci_bus_id=_pci_bus_id(device))
    return info


def _pci_bus_id(device: torch.device) -> str | None:
    try:
        import cupy

        return cupy.cuda.runtime.deviceGetPCIBusId(device.index)
    except Exception:  # cupy missing: the bus id is also in the probe snapshot
        return None
