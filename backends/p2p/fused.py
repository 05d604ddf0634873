"""p2p:fused: commbench's own allreduce + residual add + RMSNorm in one kernel, over the p2p family's
Lamport buffers (the fused pattern of backends/fused.py; FlashInfer's TRT-LLM fusion is the engines'
kernel for it, our kernels are our own code).

* ``p2p:fused_oneshot`` (``p2p_fused_oneshot`` in allreduce.cu): every rank pushes its x into every
  peer's Lamport buffer (the Lamport one-shot's buffers and call count), then reduces every token as
  its vectors land, adds the residual, rounds it to the dtype (``residual_out``), and normalises that
  rounded residual: ``norm_out = r * rsqrt(mean(r^2) + eps) * gamma``, the weight and epsilon as the
  engines pass them. One link crossing, no flag.
* ``p2p:fused_twoshot`` (``p2p_fused_twoshot``): the Lamport two-shot's reduce-scatter by vectors, the
  sums pushed to every rank's gather buffer; then every rank adds the residual to every token and
  normalises it (FlashInfer's fused two-shot splits the same way: an all-gather of the sum, the norm on
  every rank).
* ``p2p:fused`` runs the one-shot up to ``rules.FUSED_ONESHOT_MAX_BYTES`` of its world size and the
  two-shot above (a provisional rule, from the plain Lamport kernels' crossover: rules.py says which).

A token's sum of squares needs every vector of its row: a token is taken by a group of blocks
(``layout.fused_dims``: spread over up to 32 blocks while tokens are fewer than blocks, else a block
per token in turn), each thread holding its vectors in registers until the norm; blocks of a group
swap their partial sums through a slot per block in this rank's own memory, tagged with the call
count. Waits are bounded like every p2p kernel's (a timeout is a ``hang`` row). Every call is checked
by the fused workload (backends/fused.py): the residual exactly, the norm within its tolerance.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from commbench import engines
from commbench.backends.fused import RMS_EPS, TOLERANCE, FusedBackend
from commbench.backends.p2p.backend import P2PAllreduce
from commbench.backends.p2p.layout import (FUSED_PARTIAL_WORDS, VECTOR_BYTES, FusedDims, fused_args, fused_dims,
                                           fused_params, fused_row_reason)
from commbench.backends.p2p.rules import FUSED_ONESHOT_MAX_BYTES, P2POptions, fused_kernel, size_reason, tensor_reason
from commbench.ops import FUSED_OP
from commbench.units import format_bytes

if TYPE_CHECKING:
    from commbench.runtime.context import RunContext
    from commbench.runtime.workload import Workload

# What recommend prints beside these rows: the engines cannot run this kernel; it prices their fused path.
OWN_FUSED_KERNEL = ("commbench's own fused allreduce + residual + RMSNorm kernel (p2p:fused): no engine runs it; it "
                    "is the headroom reference for the engines' fused kernel (FlashInfer's TRT-LLM fusion), measured "
                    "on the same shapes")


class P2PFused(P2PAllreduce, FusedBackend):
    """p2p:fused, p2p:fused_oneshot, p2p:fused_twoshot: the p2p backend's buffers and checks, the fused
    pattern's workload and check."""

    op = FUSED_OP

    def __init__(self, variant: str, options: P2POptions):
        super().__init__(variant, options)
        self._partials: torch.Tensor | None = None   # the groups' per-block sums of squares (u64 slots)
        self._partials_area: object = None            # the shared area whose call counts tag them
        self._shape: tuple[int, int] | None = None    # (tokens, hidden) of the current row

    def engine_settings(self, world_size: int | None) -> engines.Settings:
        # It prices the engines' fused path (FlashInfer's kernel, which the same settings select) as a
        # stand-in: the p2p family's plain kernels stand in for the custom allreduce alike.
        return engines.Settings(self.name, vllm_env=dict(engines.VLLM_FLASHINFER_TRTLLM_ENV),
                                vllm_flags=list(engines.VLLM_FUSE_ALLREDUCE_RMS),
                                sglang_flags=list(engines.SGLANG_FLASHINFER_TRTLLM),
                                notes=[OWN_FUSED_KERNEL, engines.FUSED_TIMING],
                                engine_paths=engines.claim(engines.FLASHINFER_FUSED, engines.VLLM, engines.SGLANG,
                                                           stand_in=True))

    def shape_reason(self, world_size: int, tokens: int, hidden: int, dtype: torch.dtype) -> str | None:
        row_bytes = hidden * dtype.itemsize
        if row_bytes % VECTOR_BYTES:
            return f"hidden {hidden} is not a multiple of {VECTOR_BYTES // dtype.itemsize} (the kernels move " \
                   f"{VECTOR_BYTES}-byte vectors)"
        return fused_row_reason(row_bytes // VECTOR_BYTES)

    def setup(self, ctx: "RunContext", max_bytes: int, dtype: torch.dtype) -> None:
        super().setup(ctx, max_bytes, dtype)
        # A new shared area counts its calls from 1 again: slots tagged by the old count must go.
        if self._partials is None or self._partials_area is not self._area:
            self._partials = torch.zeros(FUSED_PARTIAL_WORDS, dtype=torch.int64, device=ctx.device)
            self._partials_area = self._area

    def close(self) -> None:
        super().close()
        self._partials = self._partials_area = None

    def algorithm_for(self, message_bytes: int, dtype: torch.dtype, in_graph: bool = True) -> str:
        if len(self.algorithms) == 1:
            return self.algorithms[0]
        return fused_kernel(self._ctx.world_size, message_bytes)

    def allreduce(self, x: torch.Tensor, out: torch.Tensor) -> None:
        raise RuntimeError(f"{self.name} computes allreduce + residual add + RMSNorm only (allreduce_residual_rmsnorm)")

    def make_workload(self, ctx: "RunContext", count: int, dtype: torch.dtype,
                      shape: tuple[int, int] | None, pairs: int) -> "Workload":
        # The fused pattern's workload and check (FusedBackend's); the harness asks raise_if_failed
        # after every pass, so a wait that gave up is a hang row, not a count of wrong values.
        workload = super().make_workload(ctx, count, dtype, shape, pairs)
        self._shape = shape
        return workload

    def dims(self, tokens: int, hidden: int, dtype: torch.dtype) -> FusedDims:
        """The launch of one call of this shape (a method so that a study can measure another)."""
        cap_blocks, sms = self._grids[dtype]
        return fused_dims(tokens, hidden * dtype.itemsize // VECTOR_BYTES, cap_blocks, sms)

    def allreduce_residual_rmsnorm(self, x: torch.Tensor, residual_in: torch.Tensor, gamma: torch.Tensor,
                                   residual_out: torch.Tensor, norm_out: torch.Tensor) -> None:
        if self._area is None or self._partials is None:
            raise RuntimeError(f"{self.name}: setup() first")
        self.raise_if_failed()
        tokens, hidden = x.shape
        message_bytes = x.numel() * x.element_size()
        reason = (self.supports(message_bytes, x.dtype) or size_reason(message_bytes, self._area.plan.slot_bytes)
                  or tensor_reason(x, residual_in, self._ctx.device) or tensor_reason(x, residual_out, self._ctx.device)
                  or tensor_reason(x, norm_out, self._ctx.device)
                  or tensor_reason(gamma, gamma, self._ctx.device)
                  or (None if gamma.numel() == hidden and gamma.dtype == x.dtype
                      else f"gamma ({gamma.numel()} x {gamma.dtype}) is not one {x.dtype} weight per hidden element")
                  or self.shape_reason(self._ctx.world_size, tokens, hidden, x.dtype))
        if reason:
            raise ValueError(f"{self.name}: {reason}")
        if x.dtype not in self._grids:
            raise RuntimeError(f"{self.name}: not set up for {x.dtype}")
        kernel = self.algorithm_for(message_bytes, x.dtype)
        dims = self.dims(tokens, hidden, x.dtype)
        args = fused_args((x.data_ptr(), residual_in.data_ptr(), gamma.data_ptr(), residual_out.data_ptr(),
                           norm_out.data_ptr(), self._partials.data_ptr()),
                          tokens, hidden * x.element_size() // VECTOR_BYTES, dims.group_blocks, RMS_EPS, hidden)
        function, parameter = self._functions[x.dtype][kernel], self._area.parameter(kernel)
        if self._pdl is not None:
            self._pdl.launch(function.ptr, dims.blocks, dims.threads,
                             torch.cuda.current_stream(self._ctx.device).cuda_stream, fused_params(parameter, args))
            return
        function((dims.blocks,), (dims.threads,), (parameter, args), stream=self._stream())

    def observe(self, call: Any, message_bytes: int) -> dict[str, Any]:
        """The kernel and launch this row's calls run (known from its shape alone: no call made)."""
        if self._shape is None or self._dtype is None or self._dtype not in self._grids:
            return {}
        dims = self.dims(*self._shape, self._dtype)
        return {"extra": {"p2p_fused_kernel": self.algorithm_for(message_bytes, self._dtype),
                          "p2p_fused_launch": {"blocks": dims.blocks, "threads": dims.threads,
                                               "blocks_per_token": dims.group_blocks}}}

    def row_fields(self) -> dict[str, Any]:
        fields = super().row_fields()
        extra = fields["extra"]
        extra.update({"pattern": "allreduce + residual add + RMSNorm", "rms_eps": RMS_EPS,
                      "tolerance": {str(k).replace("torch.", ""): v for k, v in TOLERANCE.items()}})
        if self.variant == "fused":
            extra["p2p_fused_rule"] = {str(world): f"fused_oneshot<={format_bytes(limit)},fused_twoshot"
                                       for world, limit in FUSED_ONESHOT_MAX_BYTES.items()}
        return fields
