"""torch symmetric memory allreduce, called through the torch ops directly.

Serving engines wrap these ops in communicators that switch themselves off when the buffer
has no multicast address, even for two-shot, which needs none (vLLM issue 50179). Here
one_shot and two_shot run on plain P2P mappings; multimem runs only where multicast is allowed
by policy and supported by the device.

Facts used (PyTorch's symmetric-memory docs and torch/csrc/distributed/c10d/symm_mem): buffers
come from ``symm_mem.empty`` and are rendezvoused on a named process group; the ops need sizes that are a multiple of max(4, element size) bytes
and dispatch bf16 and fp32 only; one group's signal pad must not see concurrent launches from
two streams, so every variant gets its own group and runs on the caller's stream only.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any, Callable

import torch
import torch.distributed as dist

from commbench import engines
from commbench.backends.base import (Backend, BackendFactory, BackendUnavailable, MakeOptions, chosen_variants,
                                     parse_variant_options, voted)

if TYPE_CHECKING:
    from commbench.runtime.context import RunContext

# The symm_mem kernels are instantiated for these dtypes only (AT_DISPATCH_FLOAT_AND_BFLOAT16).
SYMM_MEM_DTYPES = (torch.bfloat16, torch.float32)
# Lets several ranks map one GPU (correctness runs on a shared GPU only).
ALLOW_OVERLAP_ENV = "TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES"

ALGOS = ("one_shot", "two_shot", "multimem")
# op name in torch.ops.symm_mem for each variant
TORCH_OPS = {"one_shot": "one_shot_all_reduce_out", "two_shot": "two_shot_all_reduce_",
             "multimem": "multimem_all_reduce_"}

# Kernel names this family's allreduce leaves in a profiler trace, read by `commbench attribute`
# with ast, without importing this module (docs/attribute.md): (regex searched in the demangled
# name, library, regex over this family's run variants that are its floor, note).
# pytorch torch/csrc/distributed/c10d/symm_mem/CUDASymmetricMemoryOps.cu (no end anchor: releases add
# suffixed variants such as _inplace)
TRACE_KERNELS = (
    (r"\bone_shot_all_reduce_kernel", "torch symm-mem one-shot", r"^symm_mem:one_shot$", ""),
    (r"\btwo_shot_all_reduce_kernel", "torch symm-mem two-shot", r"^symm_mem:two_shot$", ""),
    (r"\bmultimem_(one_shot_)?all_reduce_kernel", "torch symm-mem multimem", r"^symm_mem:multimem$", ""),
)


def _symm_mem_module() -> Any:
    import torch.distributed._symmetric_memory as symm_mem

    return symm_mem


class SymmMemAllreduce(Backend):
    family = "symm_mem"
    min_world_size = 2
    dtypes = SYMM_MEM_DTYPES

    def __init__(self, algo: str):
        self.algo = algo
        self.name = f"symm_mem:{algo}"
        self._group: Any = None
        self._buffer: torch.Tensor | None = None
        self._call: Callable[[torch.Tensor, torch.Tensor], None] | None = None

    @property
    def needs(self) -> tuple[str, ...]:  # type: ignore[override]
        if self.algo == "multimem":
            # Multicast across ranks that share a GPU means nothing.
            return ("cuda", "multicast", "own_gpu", "node", "p2p", "vmm")
        # The signal pad is set with system-scope CAS on the peer's memory: PCIe needs P2P atomics.
        return ("cuda", "node", "p2p", "ipc", "vmm", "atomics")

    def software_reason(self) -> str | None:
        op = TORCH_OPS[self.algo]
        if not hasattr(torch.ops, "symm_mem") or not hasattr(torch.ops.symm_mem, op):
            return f"torch {torch.__version__} has no torch.ops.symm_mem.{op} (one/two-shot need torch >= 2.6)"
        return None

    def engine_settings(self, world_size: int | None) -> engines.Settings:
        notes = [engines.SYMM_MEM_NEEDS_MULTICAST]
        if self.algo == "multimem":
            notes.append(engines.MULTIMEM_NEEDS_NVSWITCH)
        return engines.Settings(self.name, vllm_env=dict(engines.VLLM_ONLY_SYMM_MEM),
                                sglang_flags=[engines.SGLANG_TORCH_SYMM_MEM], notes=notes,
                                engine_paths=engines.claim(engines.TORCH_SYMM_MEM, engines.VLLM, engines.SGLANG))

    def supports(self, message_bytes: int, dtype: torch.dtype) -> str | None:
        if dtype not in SYMM_MEM_DTYPES:
            return "torch symm_mem kernels are built for bf16 and fp32 only"
        alignment = max(4, dtype.itemsize)
        if message_bytes % alignment:
            return f"torch symm_mem needs sizes that are a multiple of {alignment} bytes"
        return None

    def setup(self, ctx: "RunContext", max_bytes: int, dtype: torch.dtype) -> None:
        self._release_buffers()
        if ctx.shares_gpus:
            # Without it rendezvous refuses peers whose buffers sit on the same device.
            os.environ[ALLOW_OVERLAP_ENV] = "1"
        symm_mem = _symm_mem_module()
        elements = max(1, -(-max_bytes // dtype.itemsize))
        buffer = voted(ctx, f"symmetric memory allocation (symm_mem.empty of {elements} x {dtype})",
                       lambda: symm_mem.empty(elements, dtype=dtype, device=ctx.device))
        if self._group is None:
            # A group of its own: its name keys the rendezvous and its signal pad is not shared
            # with any other variant. gloo, because rendezvous only needs the group's store and
            # NCCL refuses two ranks on one GPU.
            self._group = dist.new_group(ranks=list(range(ctx.world_size)), backend="gloo")
        handle = symm_mem.rendezvous(buffer, self._group.group_name)
        if self.algo == "multimem" and not handle.multicast_ptr:
            raise BackendUnavailable("rendezvous gave no multicast address (multicast unavailable on this group)")
        self._buffer = buffer
        self._call = self._make_call(self._group.group_name)

    def _make_call(self, group_name: str) -> Callable[[torch.Tensor, torch.Tensor], None]:
        ops = torch.ops.symm_mem
        if self.algo == "one_shot":
            return lambda view, out: ops.one_shot_all_reduce_out(view, "sum", group_name, out)
        # two_shot and multimem reduce in the symmetric buffer itself; the result is copied out,
        # as serving engines do (the buffer is reused by the next call).
        op = ops.two_shot_all_reduce_ if self.algo == "two_shot" else ops.multimem_all_reduce_
        return lambda view, out: out.copy_(op(view, "sum", group_name))

    def allreduce(self, x: torch.Tensor, out: torch.Tensor) -> None:
        assert self._buffer is not None and self._call is not None, "setup() first"
        view = self._buffer[: x.numel()]
        # The ops read peers' copies of this buffer: the input has to be staged into it.
        view.copy_(x.reshape(-1))
        self._call(view, out.reshape(-1))

    def row_fields(self) -> dict[str, Any]:
        return {"extra": {"torch_op": f"torch.ops.symm_mem.{TORCH_OPS[self.algo]}"}}

    def _release_buffers(self) -> None:
        self._buffer = None
        self._call = None

    def close(self) -> None:
        self._release_buffers()
        if self._group is not None:
            dist.destroy_process_group(self._group)
            self._group = None


def make(variant: str | None, options: MakeOptions[None]) -> list[Backend]:
    return [SymmMemAllreduce(name) for name in chosen_variants("symm_mem", list(parse_variant_options(variant)), ALGOS)]


FACTORY = BackendFactory(
    family="symm_mem",
    make=make,
    summary="torch symmetric memory one-shot / two-shot (P2P) and multimem (multicast) allreduce",
    variants_help=[
        "symm_mem:one_shot   torch.ops.symm_mem.one_shot_all_reduce_out (every rank reads all peers)",
        "symm_mem:two_shot   torch.ops.symm_mem.two_shot_all_reduce_ (reduce-scatter + all-gather)",
        "symm_mem:multimem   torch.ops.symm_mem.multimem_all_reduce_ (needs --allow-multicast)",
    ],
)
