"""What ran: versions, the relevant environment, host and GPUs, for run.json."""

from __future__ import annotations

import json
import os
import socket
import sys
from pathlib import Path
from typing import Any

import torch

from commbench.results import ENV_PREFIXES
from commbench.probe.software import installed_versions

LAUNCH_COMMAND_VAR = "COMMBENCH_LAUNCH_COMMAND"   # the --nproc driver's command line, for its children


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
    return {k: v for k, v in sorted(os.environ.items()) if k.startswith(ENV_PREFIXES) and k != LAUNCH_COMMAND_VAR}


def launch_command() -> list[str]:
    """The command line the user typed, for run.json: the --nproc driver's (handed to its
    children), else torchrun's (a worker's parent process), else this process's own."""
    handed = os.environ.get(LAUNCH_COMMAND_VAR)
    if handed:
        return json.loads(handed)
    if "TORCHELASTIC_RUN_ID" in os.environ:   # started by torchrun's agent
        try:
            words = Path(f"/proc/{os.getppid()}/cmdline").read_bytes().split(b"\0")
        except OSError:   # not Linux: the worker's own command is all there is
            words = []
        if any(words):
            return [w.decode(errors="replace") for w in words if w]
    return list(sys.argv)


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
