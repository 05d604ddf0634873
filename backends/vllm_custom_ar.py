"""vLLM's custom allreduce kernel (``vllm::cross_device_reduce_1stage`` / ``_2stage``).

Two implementations of the same kernel, and every row says which one ran (``implementation``):

- vLLM's own ``_C`` ops (``vllm._custom_ops``), when vLLM is installed (``impl=vllm``);
- FlashInfer's verbatim port (``flashinfer.comm`` ``vllm_*`` functions, JIT-built from
  ``csrc/vllm_custom_all_reduce.cu`` / ``include/flashinfer/comm/vllm_custom_all_reduce.cuh``,
  ported from vLLM's csrc/custom_all_reduce.cuh), the default when vLLM is not there
  (``impl=flashinfer``): vLLM's wheel is too large to carry to most GPU boxes.

Set up the way vLLM's ``CustomAllreduce`` (distributed/device_communicators/custom_all_reduce.py)
does, read there and written anew: a signal buffer (``meta_size()`` + max size, zeroed) and an
input staging buffer, both cudaMalloc'd and shared over CUDA IPC; ``init_custom_ar`` with the
peers' signal pointers; the staging buffer registered. Eager calls copy the input into the
staging buffer (``reg_buffer``); calls captured in a CUDA graph pass the input itself, and the
inputs are registered after capture (``get_graph_buffer_ipc_meta`` / ``register_graph_buffers``,
graph_capture below), as vLLM's ``capture()`` does.

The kernel picks its stage itself, by size (custom_all_reduce.cuh: always one-stage at 2 ranks;
with full NVLink one-stage below 512 KiB up to 4 ranks and below 256 KiB up to 8, else
two-stage); neither API can force one. So ``one_stage`` and ``two_stage`` run the sizes where the
kernel takes that stage and skip the rest with the reason; ``auto`` is vLLM's whole rule: its
custom allreduce takes byte sizes that are a multiple of 16 and under its 8 MiB buffer, and
hands anything else to NCCL. ``full_nvlink`` is passed as True: vLLM enables the kernel above 2
ranks only on fully NVLink-connected GPUs (with it False the kernel launches nothing there).
The kernel's barriers spin with no timeout: the harness's watchdog bounds every call.
"""

from __future__ import annotations

import ctypes
import importlib
from contextlib import contextmanager
from functools import cache
from importlib import metadata
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any, Iterator

import torch

from commbench import engines
from commbench.backends.base import (Backend, BackendFactory, MakeOptions, chosen_variants, parse_variant_options,
                                     voted, voted_rank0_first)
from commbench.errors import UsageError

if TYPE_CHECKING:
    from commbench.runtime.context import RunContext

# This kernel in a profiler trace, read by `commbench attribute` with ast (docs/attribute.md):
# vLLM csrc/custom_all_reduce.cuh; SGLang's sgl-kernel and FlashInfer's port keep the vllm:: names.
TRACE_KERNELS = (
    (r"\bvllm::cross_device_reduce_1stage\b",
     "vLLM-style custom allreduce (vLLM, SGLang or FlashInfer's port)", r"^vllm:one_stage", ""),
    (r"\bvllm::cross_device_reduce_2stage\b",
     "vLLM-style custom allreduce (vLLM, SGLang or FlashInfer's port)", r"^vllm:two_stage", ""),
)

MAX_BYTES = 8 << 20                # vLLM CustomAllreduce max_size default (8192 * 1024)
RANK_DATA_BYTES = 8 << 20          # vLLM's rank_data scratch: one RankData per registered buffer
NUM_CTAS = 36                      # custom_all_reduce.cuh default block limit (kMaxBlocks)
WORLD_SIZES = (2, 4, 6, 8)         # _SUPPORTED_WORLD_SIZES
MESSAGE_ALIGN = 16
ONE_STAGE_BELOW = {4: 512 << 10, 8: 256 << 10}   # full NVLink: up to 4 / up to 8 ranks
STAGES = {"one_stage": "1stage", "two_stage": "2stage"}
AUTO = "auto"
IMPLS = ("flashinfer", "vllm")
FLASHINFER_HINT = "pip install 'commbench[flashinfer]'"


def kernel_stage(world_size: int, message_bytes: int) -> str:
    """The stage custom_all_reduce.cuh launches (full NVLink, as vLLM requires above 2 ranks)."""
    if world_size == 2:
        return "1stage"
    limit = ONE_STAGE_BELOW[4] if world_size <= 4 else ONE_STAGE_BELOW[8]
    return "1stage" if message_bytes < limit else "2stage"


def vllm_takes(message_bytes: int, max_bytes: int = MAX_BYTES) -> bool:
    """vLLM's should_custom_ar on size: a multiple of 16 bytes, strictly under its buffer."""
    return message_bytes % MESSAGE_ALIGN == 0 and message_bytes < max_bytes


def _flashinfer_ops() -> SimpleNamespace:
    comm = importlib.import_module("flashinfer.comm")
    cuda_ipc = importlib.import_module("flashinfer.comm.cuda_ipc")

    return SimpleNamespace(
        build=lambda: importlib.import_module("flashinfer.comm.vllm_ar").get_vllm_comm_module(),
        init=comm.vllm_init_custom_ar, dispose=comm.vllm_dispose, meta_size=comm.vllm_meta_size,
        register_buffer=comm.vllm_register_buffer, graph_meta=comm.vllm_get_graph_buffer_ipc_meta,
        register_graph=comm.vllm_register_graph_buffers,
        all_reduce=lambda fa, inp, out, reg, reg_bytes: comm.vllm_all_reduce(fa, inp, out, reg, reg_bytes, NUM_CTAS),
        create=lambda size, group: comm.create_shared_buffer(size, group=group),
        free=lambda ptrs, group: comm.free_shared_buffer(ptrs, group=group),
        zero=lambda ptr, size: cuda_ipc.cudart.cudaMemset(ctypes.c_void_p(ptr), 0, size),
        version=f"flashinfer-python {metadata.version('flashinfer-python')} (its port of vLLM's kernel, "
                "flashinfer.comm.vllm_ar)")


def _vllm_ops() -> SimpleNamespace:
    ops = importlib.import_module("vllm._custom_ops")
    import torch.distributed as dist

    def create(size: int, group: Any) -> list[int]:
        # vLLM's CustomAllreduce.create_shared_buffer: allocate, swap handles, open the peers'.
        pointer, handle = ops.allocate_shared_buffer_and_handle(size)
        handles: list[Any] = [None] * dist.get_world_size(group=group)
        dist.all_gather_object(handles, handle, group=group)
        rank = dist.get_rank(group=group)
        return [pointer if i == rank else ops.open_mem_handle(h) for i, h in enumerate(handles)]

    def free(pointers: list[int], group: Any) -> None:
        dist.barrier(group=group)
        ops.free_shared_buffer(pointers[dist.get_rank(group=group)])

    return SimpleNamespace(
        build=lambda: None, init=ops.init_custom_ar, dispose=ops.dispose, meta_size=ops.meta_size,
        register_buffer=ops.register_buffer, graph_meta=ops.get_graph_buffer_ipc_meta,
        register_graph=ops.register_graph_buffers, all_reduce=ops.all_reduce, create=create, free=free,
        zero=lambda ptr, size: None,    # allocate_shared_buffer_and_handle zeroes its buffer itself
        version=f"vllm {metadata.version('vllm')} (vllm._custom_ops)")


@cache
def import_reason(impl: str) -> str | None:
    distribution = "vllm" if impl == "vllm" else "flashinfer-python"
    try:
        metadata.version(distribution)
    except metadata.PackageNotFoundError:
        hint = "pip install vllm" if impl == "vllm" else FLASHINFER_HINT
        return f"{distribution} not installed ({hint}): needed for vLLM's custom allreduce kernel (impl={impl})"
    module = "vllm._custom_ops" if impl == "vllm" else "flashinfer.comm"
    try:
        mod = importlib.import_module(module)
    except Exception as exc:
        return f"{distribution} is installed but {module} does not import: {type(exc).__name__}: {exc}"
    needed = "init_custom_ar" if impl == "vllm" else "vllm_init_custom_ar"
    if not hasattr(mod, needed):
        return f"{distribution} {metadata.version(distribution)} has no {module}.{needed}"
    return None


def default_impl() -> str:
    """vLLM's own ops where vLLM imports, else FlashInfer's port."""
    return "vllm" if import_reason("vllm") is None else "flashinfer"


class VllmCustomAllreduce(Backend):
    family = "vllm"
    needs = ("cuda", "node", "p2p", "ipc")          # cudaMalloc + cudaIpcGetMemHandle buffers
    min_world_size = 2
    max_world_size = 8
    world_sizes = WORLD_SIZES
    message_multiple_bytes = MESSAGE_ALIGN

    def __init__(self, variant: str, impl: str | None) -> None:
        self.variant = variant
        self.impl = impl
        self.name = f"vllm:{variant}" + (f",impl={impl}" if impl else "")
        self._world_size = 0
        self._ops: SimpleNamespace | None = None
        self._fa: int | None = None
        self._meta: list[int] = []
        self._buffer: list[int] = []
        self._rank_data: torch.Tensor | None = None
        self._max_bytes = MAX_BYTES
        self._ctx: "RunContext | None" = None
        self._fields: dict[str, Any] = {}

    def _impl(self) -> str:
        return self.impl or default_impl()

    def software_reason(self) -> str | None:
        return import_reason(self._impl())

    def engine_settings(self, world_size: int | None) -> engines.Settings:
        notes = [engines.CUSTOM_AR_ON_BY_DEFAULT, engines.CUSTOM_AR_PCIE_GATE, engines.SGLANG_NOT_VLLM_KERNEL]
        if self.variant != AUTO:
            # One stage of vLLM's kernel: VLLM_CUSTOM_ALLREDUCE_ALGO makes vLLM run it at every size.
            return engines.vllm_forced_stage(self.name, STAGES[self.variant], notes)
        # vLLM's kernel (its _C ops, or FlashInfer's verbatim port of the same source; the row says which).
        return engines.Settings(self.name, vllm_env=dict(engines.VLLM_ONLY_CUSTOM_ALLREDUCE), sglang_supported=False,
                                notes=notes, engine_paths=engines.claim(engines.CUSTOM_AR, engines.VLLM))

    def check(self, ctx: "RunContext") -> str | None:
        reason = super().check(ctx)
        if reason is None:
            self._world_size = ctx.world_size
        return reason

    def supports(self, message_bytes: int, dtype: torch.dtype) -> str | None:
        reason = super().supports(message_bytes, dtype)
        if reason:
            return reason
        ws = self._world_size or 2
        if self.variant == AUTO:
            if not vllm_takes(message_bytes):
                return f"vLLM hands {message_bytes} B to NCCL (its custom allreduce takes sizes under {MAX_BYTES} B)"
            return None
        stage = kernel_stage(ws, message_bytes)
        if stage != STAGES[self.variant]:
            return (f"the kernel runs {stage} at {message_bytes} B on {ws} ranks (it picks the stage by size; "
                    f"no API forces one)")
        return None

    def setup(self, ctx: "RunContext", max_bytes: int, dtype: torch.dtype) -> None:
        self.close()
        self._ctx = ctx
        impl = self._impl()
        self._ops = ops = _vllm_ops() if impl == "vllm" else _flashinfer_ops()
        voted_rank0_first(ctx, f"vLLM custom allreduce kernel build ({impl})", ops.build)
        # vLLM's default 8 MiB, grown for forced-stage rows of larger messages.
        self._max_bytes = max(MAX_BYTES, -(-max_bytes // MESSAGE_ALIGN) * MESSAGE_ALIGN)
        meta_bytes = int(ops.meta_size()) + self._max_bytes
        group = ctx.control_group
        self._meta = ops.create(meta_bytes, group)
        ops.zero(self._meta[ctx.rank], meta_bytes)       # the Signal flags start at zero
        self._buffer = ops.create(self._max_bytes, group)
        torch.cuda.synchronize(ctx.device)
        ctx.barrier()
        self._rank_data = torch.empty(RANK_DATA_BYTES, dtype=torch.uint8, device=ctx.device)

        def init() -> None:
            self._fa = int(ops.init(self._meta, self._rank_data, ctx.rank, True))
            ops.register_buffer(self._fa, self._buffer)

        voted(ctx, "vLLM init_custom_ar / register_buffer", init)
        # The kernel writes the caller's output tensor, as vLLM's own caller's: no copy is added.
        self._fields = {"implementation": ops.version, "impl": impl, "full_nvlink": True, "num_ctas": NUM_CTAS,
                        "max_bytes": self._max_bytes, "copy_out": "none"}

    def allreduce(self, x: torch.Tensor, out: torch.Tensor) -> None:
        assert self._ops is not None and self._fa is not None, "setup() first"
        if torch.cuda.is_current_stream_capturing():
            self._ops.all_reduce(self._fa, x, out, 0, 0)       # the input itself, registered after capture
        else:
            self._ops.all_reduce(self._fa, x, out, self._buffer[self._ctx.rank if self._ctx else 0], self._max_bytes)

    @contextmanager
    def graph_capture(self) -> Iterator[None]:
        yield
        self._register_graph_buffers()

    def _register_graph_buffers(self) -> None:
        """vLLM's register_graph_buffers: every rank's IPC handles and offsets of the inputs its
        captured calls used, gathered, then opened into the kernel's pointer table."""
        assert self._ops is not None and self._fa is not None and self._ctx is not None
        handle, offsets = self._ops.graph_meta(self._fa)
        gathered = self._ctx.all_gather_objects((list(handle), list(offsets)))
        self._ops.register_graph(self._fa, [h for h, _ in gathered], [o for _, o in gathered])

    def observe(self, call: Any, message_bytes: int) -> dict[str, Any]:
        ws = self._world_size or 2
        return {"extra": {"vllm_stage": kernel_stage(ws, message_bytes), "vllm_takes": vllm_takes(message_bytes)}}

    def row_fields(self) -> dict[str, Any]:
        return {"extra": dict(self._fields)} if self._fields else {}

    def close(self) -> None:
        ops, ctx = self._ops, self._ctx
        if ops is not None and ctx is not None:
            torch.cuda.synchronize()
            if self._fa is not None:
                ops.dispose(self._fa)
            for pointers in (self._meta, self._buffer):
                if pointers:
                    ops.free(pointers, ctx.control_group)
        self._fa = None
        self._meta, self._buffer = [], []
        self._rank_data = None
        self._ops = None


VARIANTS = (*STAGES, AUTO)


def make(variant: str | None, options: MakeOptions[None]) -> list[Backend]:
    parsed = parse_variant_options(variant)
    impl = parsed.pop("impl", None)
    if impl is not None and impl not in IMPLS:
        raise UsageError(f"vllm: impl={impl} unknown; choose impl=flashinfer or impl=vllm")
    names = chosen_variants("vllm", list(parsed), VARIANTS, every="custom_ar", also=" (and impl=flashinfer|vllm)")
    return [VllmCustomAllreduce(n, impl) for n in names]


FACTORY = BackendFactory(
    family="vllm",
    make=make,
    native=True,
    summary="vLLM's custom allreduce kernel: vLLM's own _C ops, or FlashInfer's verbatim port (optional)",
    variants_help=[
        "vllm:custom_ar    every variant below",
        "vllm:one_stage    cross_device_reduce_1stage, at the sizes where the kernel takes it",
        "vllm:two_stage    cross_device_reduce_2stage, at the sizes where the kernel takes it (> 2 ranks)",
        "vllm:auto         vLLM's own rule: the kernel's stage choice, sizes under 8 MiB",
        "  add ,impl=vllm or ,impl=flashinfer to pick the implementation (default: vLLM's where it imports)",
    ],
    probe_specs=(AUTO,),
    packages=("vllm", "flashinfer-python"),
)
