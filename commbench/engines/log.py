"""The allreduce chain an engine set up, from its own start-up log. vLLM logs it for every group
("Using ['FLASHINFER', 'CUSTOM', 'SYMM_MEM', 'PYNCCL'] all-reduce backends (in dispatch order) for
group 'tp:0' out of potential backends: [...]", vllm.py fact dispatch_log); SGLang 0.5.23 logs no
such line on CUDA (only ROCm's "[AR] ..." lines), so its chain stays the model's.
The log is untrusted input: read bounded, matched by a strict pattern, names not known are named
as such, never echoed raw."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from commbench.engines.settings import (CUSTOM_AR, FLASHINFER_AR, FLASHINFER_PCIE_IPC, NCCL_PATH, NCCL_SYMM,
                                        TORCH_SYMM_MEM)
from commbench.errors import UsageError

MAX_LOG_BYTES = 64 << 20
DISPATCH = re.compile(r"Using \[((?:'[A-Z_]{1,40}'(?:, )?){0,16})\] all-reduce backends \(in dispatch order\) "
                      r"for group '([A-Za-z0-9_:.-]{0,64})'")
# vLLM's backend names (cuda_communicator.py all_potential_ar_backends) -> commbench path ids;
# QUICK_REDUCE and AITER_CUSTOM are ROCm's.
VLLM_NAMES = {"FLASHINFER_PCIE_IPC": FLASHINFER_PCIE_IPC, "FLASHINFER": FLASHINFER_AR, "NCCL_SYMM_MEM": NCCL_SYMM,
              "CUSTOM": CUSTOM_AR, "SYMM_MEM": TORCH_SYMM_MEM, "PYNCCL": NCCL_PATH}


@dataclass(frozen=True)
class Chain:
    group: str
    names: tuple[str, ...]      # as logged, in dispatch order
    paths: tuple[str, ...]      # the commbench path ids among them

    def said(self, file: str) -> str:
        return (f"vLLM's start-up log {file} (group '{self.group}'): {', '.join(self.names) or 'no backend'} "
                "— the chain below is the one the engine set up")


def read_chain(path: str) -> Chain:
    """The tensor-parallel group's chain in a vLLM log; one line (UsageError) when there is none."""
    try:
        file = Path(path)
        if file.stat().st_size > MAX_LOG_BYTES:
            raise UsageError(f"--engine-log {path}: larger than {MAX_LOG_BYTES >> 20} MiB")
        text = file.read_text(encoding="utf-8", errors="replace")
    except OSError as exc:
        raise UsageError(f"--engine-log {path}: cannot be read ({exc.strerror or type(exc).__name__})") from None
    found = [m for m in DISPATCH.finditer(text)]
    if not found:
        raise UsageError(f"--engine-log {path}: no \"Using [...] all-reduce backends (in dispatch order) for group\" "
                         "line (vLLM logs one per group at start-up since 2026)")
    tp = next((m for m in found if m.group(2).startswith("tp")), found[0])
    names = tuple(re.findall(r"'([A-Z_]+)'", tp.group(1)))
    return Chain(tp.group(2), names, tuple(VLLM_NAMES[n] for n in names if n in VLLM_NAMES))
