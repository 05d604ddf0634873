"""``nccl:symm``: NCCL with the row's buffers registered as symmetric windows.

NCCL 2.27 added window registration (``ncclCommWindowRegister`` with NCCL_WIN_COLL_SYMMETRIC)
and symmetric-memory kernels that run when every rank's buffer lies at the same offset of a
registered window. torch reaches them through the group's own allocator: a
``torch.cuda.MemPool(backend.mem_allocator)`` (ncclMemAlloc, cuMem memory) registered with
``backend.register_mem_pool(pool, symm=True)`` (torch >= 2.9; ``symm`` is what makes the
registration symmetric, without it NCCL only registers user buffers). Plain ``dist.all_reduce``
on tensors from that pool is then eligible.

The harness owns the buffers, so this backend builds each row's workload inside the pool
(``torch.cuda.use_mem_pool``) and registers the pool after the row's allocations, collectively
and voted; before the next row's allocations it deregisters it. Registering after allocating
covers every torch: newer ones leave segments a pool gains after registration as ordinary
buffers (pytorch#192112, "collectively deregister and register the pool again"), and older
ones registered them from the allocator callback, a collective on only some ranks that could
hang. Every rank allocates the same sizes in the same order, so the offsets agree across ranks.

torch.distributed._symmetric_memory's NCCL backend (``set_backend("NCCL")``) is the other way
in; it is not used: the backend choice is process-wide and fixed at the first symmetric
allocation, so it would change what the ``symm_mem`` family allocates in the same process.

Whether a symmetric kernel ran is read from NCCL's TUNING log (``AllReduce [Symmetric]: N Bytes
-> Kernel NAME``); the rules below say beforehand where none will, and rows say which held.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Mapping

import torch

from commbench import engines
from commbench.backends.base import voted
from commbench.backends.nccl.backend import NcclBackend, logged_calls
from commbench.backends.nccl.libs import NcclLibrary
from commbench.topology.nccl_log import (ALGO_VAR, PROTO_VAR, process_nccl, read_lines, symmetric_kernel,
                                         symmetric_unsupported, used_algo_proto, version_text)
from commbench.topology.selection import non_nvlink_pairs

if TYPE_CHECKING:
    from commbench.runtime.context import RunContext
    from commbench.runtime.workload import Workload

FIRST_SYMMETRIC_CODE = 22700      # 2.27.0: window registration and symmetric kernels
MULTI_NODE_CODE = 22800           # 2.27 supports symmetric memory within one node only
ALL_NVLINK_CODE = 22900           # 2.29: built-in symmetric kernels only where every pair is NVLink
ROUTE = "ProcessGroupNCCL.register_mem_pool(pool, symm=True)"
SYMM_DTYPES = (torch.bfloat16, torch.float16, torch.float32)   # sum on float types but double
VLLM_SYMM_ENV = {"VLLM_USE_NCCL_SYMM_MEM": "1"}
SGLANG_SYMM_FLAG = "--enable-symm-mem"

# Kernel names this family's allreduce leaves in a profiler trace, read by `commbench attribute`
# with ast, without importing this module (docs/attribute.md): (regex searched in the demangled
# name, library, regex over this family's run variants that are its floor, note).
# NVIDIA/nccl src/device/symmetric/generate.py: 2.27 ncclSymDevKernel_AllReduce_<algo>_sum_<ty>,
# 2.28+ ncclSymkDevKernel_AllReduce_{AGxLL_R,AGxLLMC_R,RSxLD_AGxST,...}_sum_<ty> (+ _profile twin).
TRACE_KERNELS = (
    (r"\bncclSymk?DevKernel_AllReduce_", "NCCL symmetric", r"^nccl:symm",
     "NCCL's symmetric-memory kernel (window-registered buffers)"),
)


def registration_reason() -> str | None:
    """Why this torch cannot register a pool as symmetric windows; None when it can."""
    import torch.distributed as dist

    cls = getattr(dist, "ProcessGroupNCCL", None)
    if cls is None or not hasattr(cls, "register_mem_pool") or not hasattr(cls, "mem_allocator"):
        return (f"torch {torch.__version__} too old: ProcessGroupNCCL has no mem_allocator / register_mem_pool "
                "(NCCL pool registration)")
    if "symm" not in (cls.register_mem_pool.__doc__ or ""):
        return f"torch {torch.__version__} too old: register_mem_pool takes no symm= (symmetric windows need torch >= 2.9)"
    if not hasattr(torch.cuda, "MemPool") or not hasattr(torch.cuda, "use_mem_pool"):
        return f"torch {torch.__version__} has no torch.cuda.MemPool / use_mem_pool"
    return None


def all_nvlink_reason(snapshot: dict[str, Any] | None, world_size: int) -> str | None:
    """The first pair of the run's GPUs that the snapshot shows is not NVLink; None if all are
    (or the snapshot cannot tell)."""
    if not snapshot or not snapshot.get("gpus"):
        return None
    known = [pair for pair in non_nvlink_pairs(snapshot, world_size) if pair[2] != "?"]
    if not known:
        return None
    a, b, label = known[0]
    return f"GPU {a} - GPU {b} is {label}"


def expected_reason(version_code: int | None, world_size: int, nodes: int, snapshot: dict[str, Any] | None,
                    environ: Mapping[str, str], dtype: torch.dtype | None = None) -> str | None:
    """Why NCCL will run no symmetric allreduce kernel in this run; None where it may.

    NCCL's rules (src/init.cc symmetricSupport, src/sym_kernels.cc ncclSymkAvailable): windows
    and kernels from 2.27, on cuMem memory (NCCL_CUMEM_ENABLE) with NCCL_WIN_ENABLE on; 2.27
    within one node; from 2.29 only where every GPU pair is directly NVLink-connected."""
    if version_code is None:
        return "the NCCL version of this process is unknown"
    version = version_text(version_code)
    if version_code < FIRST_SYMMETRIC_CODE:
        return f"NCCL {version} has no symmetric kernels (they start at 2.27)"
    if world_size == 1:
        return "world size 1: NCCL's allreduce over one rank is a local copy, no symmetric kernel runs"
    for variable, meaning in (("NCCL_WIN_ENABLE", "window registration off"),
                              ("NCCL_CUMEM_ENABLE", "no cuMem memory, which windows need")):
        if environ.get(variable, "").strip() == "0":
            return f"{variable}=0: {meaning}"
    if dtype is not None and dtype not in SYMM_DTYPES:
        return f"NCCL's symmetric allreduce takes bf16, fp16 and fp32, not {str(dtype).replace('torch.', '')}"
    if version_code < MULTI_NODE_CODE and nodes > 1:
        return f"NCCL {version} runs symmetric kernels within one node only; this run spans {nodes} nodes"
    if version_code >= ALL_NVLINK_CODE:
        rule = f"NCCL {version} (>= 2.29) runs its symmetric kernels only where every GPU pair is NVLink-connected"
        if nodes > 1:
            return f"{rule}; this run spans {nodes} nodes"
        pair = all_nvlink_reason(snapshot, world_size)
        if pair:
            return f"{rule}: {pair}"
    return None


class NcclSymmBackend(NcclBackend):
    """NCCL's allreduce on buffers that are registered symmetric windows of its communicator."""

    def __init__(self, log_dir: Path | None = None, library: NcclLibrary | None = None):
        super().__init__(log_dir=log_dir, library=library)
        self._pool: Any = None
        self._pg: Any = None             # the group's ProcessGroupNCCL
        self._registered = False
        self._expected: str | None = None

    def _variant_parts(self) -> list[str]:
        return ["symm", *super()._variant_parts()]

    def software_reason(self) -> str | None:
        return super().software_reason() or registration_reason()

    def engine_settings(self, world_size: int | None) -> engines.Settings:
        settings = super().engine_settings(world_size)
        settings.vllm_env = {**engines.VLLM_ONLY_NCCL, **VLLM_SYMM_ENV}
        settings.sglang_flags = [SGLANG_SYMM_FLAG]
        settings.notes = [*settings.notes, engines.NCCL_SYMM_VLLM]
        settings.engine_paths = engines.claim(engines.NCCL_SYMM, engines.VLLM, engines.SGLANG)
        return settings

    def setup(self, ctx: "RunContext", max_bytes: int, dtype: torch.dtype) -> None:
        first = self.group is None
        super().setup(ctx, max_bytes, dtype)   # the group, and its communicator (registration needs one)
        self._expected = expected_reason(process_nccl().version_code, ctx.world_size, ctx.nodes, ctx.snapshot,
                                         os.environ, dtype)
        if not first:
            return
        self._pg = self.group._get_backend(ctx.device)
        self._pool = voted(ctx, "creating the NCCL memory pool",
                           lambda: torch.cuda.MemPool(self._pg.mem_allocator))
        # One small registration up front: a torch or NCCL that refuses says so before any row.
        probe = self._in_pool(ctx, lambda: torch.empty(1024, dtype=dtype, device=ctx.device))
        self._register(ctx)
        del probe

    def _in_pool(self, ctx: "RunContext", allocate: Callable[[], Any]) -> Any:
        """Allocate in the pool on every rank (voted: an allocation that fails fails everywhere)."""
        def step() -> Any:
            with torch.cuda.use_mem_pool(self._pool):
                return allocate()
        return voted(ctx, "allocating in the NCCL memory pool", step)

    def _register(self, ctx: "RunContext") -> None:
        self._deregister()
        voted(ctx, f"symmetric registration ({ROUTE})", lambda: self._pg.register_mem_pool(self._pool, symm=True))
        self._registered = True

    def _deregister(self) -> None:
        if self._registered:
            self._registered = False
            self._pg.deregister_mem_pool(self._pool)

    def make_workload(self, ctx: "RunContext", count: int, dtype: torch.dtype,
                      shape: tuple[int, int] | None, pairs: int) -> "Workload":
        """The row's buffers allocated in the pool, then the pool registered (see the module)."""
        build = super().make_workload
        self._deregister()
        workload = self._in_pool(ctx, lambda: build(ctx, count, dtype, shape, pairs))
        self._register(ctx)
        return workload

    def row_fields(self) -> dict[str, Any]:
        fields = super().row_fields()
        fields["extra"]["nccl_symm_registration"] = ROUTE
        return fields

    def observe(self, call: Callable[[], None], message_bytes: int) -> dict[str, Any]:
        if not self._observe_calls:   # alike on every rank: none of them calls
            return self._symmetric(None, self._expected or f"not observed: {self._not_observed}")
        self._passes += 1
        log_file = self._log_file(f"{message_bytes}B.{self._passes}")
        logged_calls(call, self._logging(log_file))
        if log_file is None:
            return self._symmetric(None, self._expected or f"not observed: {self._not_observed}")
        return self._from_log(read_lines(log_file), message_bytes, log_file)

    def _from_log(self, lines: list[str], message_bytes: int, log_file: Path) -> dict[str, Any]:
        kernel = symmetric_kernel(lines, message_bytes)
        if kernel:
            return {"observed": {"NCCL_SYM_KERNEL": kernel}, **self._symmetric(kernel, None)}
        algo, proto = used_algo_proto(lines, message_bytes)
        why = self._expected or (f"NCCL: {symmetric_unsupported(self._init_lines)}"
                                 if symmetric_unsupported(self._init_lines) else None)
        if algo and proto:
            chose = f"NCCL chose {algo}/{proto} for {message_bytes} bytes"
            return {"observed": {PROTO_VAR: proto, ALGO_VAR: algo},
                    **self._symmetric(None, f"{why} ({chose})" if why else f"{chose}, not a symmetric kernel")}
        return self._symmetric(None, why or f"NCCL logged neither a [Symmetric] nor an Algo line for "
                                            f"{message_bytes} bytes ({log_file})")

    @property
    def _init_lines(self) -> list[str]:
        init_log = self._log_file("init")
        return read_lines(init_log) if init_log is not None else []

    @staticmethod
    def _symmetric(kernel: str | None, why_not: str | None) -> dict[str, Any]:
        return {"extra": {"nccl_symmetric_kernel": kernel, "nccl_symmetric_note": why_not}}

    def close(self) -> None:
        try:
            if self._pg is not None:
                self._deregister()
        finally:
            self._pool = None
            self._pg = None
            super().close()
