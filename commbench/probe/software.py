"""What software this machine has for commbench: Python, torch with its CUDA and NCCL, and the
versions of the packages commbench and its backend families use (each family names its own,
BackendFactory.packages). The probe's snapshot and the sweep's run.json both record this."""

from __future__ import annotations

import platform
from importlib import metadata
from typing import Any

CORE_PACKAGES = ("commbench", "torch", "rich", "matplotlib", "cuda-python", "cuda-bindings", "nvidia-ml-py")


def package_versions() -> dict[str, str]:
    from commbench.backends import packages

    out = {}
    for name in dict.fromkeys((*CORE_PACKAGES, *packages())):
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return out


def torch_nccl_version() -> str | None:
    """The NCCL this torch was built with; None for a build without NCCL (CPU-only)."""
    import torch

    try:
        version = torch.cuda.nccl.version()
    except (AttributeError, RuntimeError):
        return None
    return ".".join(str(part) for part in version) if isinstance(version, tuple) else str(version)


def installed_versions() -> dict[str, Any]:
    import torch

    return {"python": platform.python_version(), "torch": torch.__version__, "torch_cuda": torch.version.cuda,
            "nccl": torch_nccl_version(), "packages": package_versions()}
