"""Allreduce + residual add + RMSNorm: the fused pattern's backends, workload and check.

A decoder layer ends with ``residual = allreduce(x) + residual; y = rmsnorm(residual) * gamma``.
A fused backend (FlashInfer's TRT-LLM kernels) does all three in one kernel; the unfused
baseline (backends/unfused.py) runs the best plain allreduce measured on this box followed by
torch's add and RMSNorm. Both are timed on the same (tokens x hidden) shapes;
commbench.analysis.fusion pairs their rows into fused time, unfused time and the saving.

Correctness: inputs are small integers (commbench.runtime.workload), every call has its own
outputs and every one is checked; the summed residual is exact in every dtype and must match
bit for bit; the normalized output is compared with an fp32 reference within ``TOLERANCE[dtype]`` (|y - y_ref| <= tol + tol * |y_ref|): two units in the
last place of the dtype at 1.0 for bf16/fp16, and 1e-4 for fp32, because the kernels use
fast-math reciprocal square roots.
"""

from __future__ import annotations

from abc import abstractmethod
from typing import TYPE_CHECKING

import torch

from commbench.backends.base import Backend, BackendUnavailable
from commbench.ops import FUSED_OP
from commbench.runtime.workload import (EPOCHS_PER_PASS, NOOP, STALE, UNWRITTEN, VALUES, PassCheck, Workload,
                                      bit_checksum, exact_pattern)

if TYPE_CHECKING:
    from commbench.runtime.context import RunContext

RMS_EPS = 1e-6
TOLERANCE: dict[torch.dtype, float] = {torch.bfloat16: 2.0 ** -6, torch.float16: 2.0 ** -9, torch.float32: 1e-4}


def residual_rmsnorm(summed: torch.Tensor, residual_in: torch.Tensor, gamma: torch.Tensor, eps: float,
                     residual_out: torch.Tensor, norm_out: torch.Tensor) -> None:
    """The unfused tail of the pattern in torch: residual add, then RMSNorm (any device)."""
    torch.add(summed, residual_in, out=residual_out)
    norm_out.copy_(torch.nn.functional.rms_norm(residual_out, (residual_out.shape[-1],), gamma, eps))


def reference_residual_rmsnorm(summed: torch.Tensor, residual_in: torch.Tensor, gamma: torch.Tensor,
                               eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 reference: (residual, normalized output)."""
    residual = summed.float() + residual_in.float()
    inv_rms = torch.rsqrt(residual.pow(2).mean(dim=-1, keepdim=True) + eps)
    return residual, residual * inv_rms * gamma.float()


def rms_gamma(hidden: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """Norm weights in [0.5, 1.25], multiples of 1/8: exact in every dtype, not all equal."""
    return (0.5 + (torch.arange(hidden, device=device) % 7).to(torch.float32) / 8).to(dtype)


class FusedBackend(Backend):
    """A backend whose timed call is the whole pattern, on a (tokens x hidden) shape."""

    op = FUSED_OP

    @abstractmethod
    def allreduce_residual_rmsnorm(self, x: torch.Tensor, residual_in: torch.Tensor, gamma: torch.Tensor,
                                   residual_out: torch.Tensor, norm_out: torch.Tensor) -> None:
        """residual_out = sum over ranks of x + residual_in; norm_out = rmsnorm(residual_out) * gamma."""

    def shape_reason(self, world_size: int, tokens: int, hidden: int, dtype: torch.dtype) -> str | None:
        """Per-shape rule on top of supports(). None = this shape can run."""
        return None

    def make_workload(self, ctx: "RunContext", count: int, dtype: torch.dtype,
                      shape: tuple[int, int] | None, pairs: int) -> Workload:
        if shape is None:
            raise BackendUnavailable("the fused allreduce+residual+RMSNorm pattern runs on model shapes: "
                                     "pass --tokens T --hidden H")
        tokens, hidden = shape
        reason = self.shape_reason(ctx.world_size, tokens, hidden, dtype)
        if reason:
            raise BackendUnavailable(reason)
        return FusedResidualRMSNormWorkload(self, ctx, tokens, hidden, dtype, pairs)


class FusedResidualRMSNormWorkload(Workload):
    """Per call: x (this rank's), residual_in (the same on every rank, as the residual stream is
    in tensor parallelism), and its own residual_out and norm_out; epochs rotate as for plain
    allreduce (commbench.runtime.workload)."""

    def __init__(self, backend: FusedBackend, ctx: "RunContext", tokens: int, hidden: int, dtype: torch.dtype,
                 pairs: int):
        self.backend = backend
        self.ctx = ctx
        self.tokens = tokens
        self.hidden = hidden
        self.count = tokens * hidden
        self.dtype = dtype
        self.pairs = pairs
        shared = min(pairs, EPOCHS_PER_PASS)

        def buffers(n: int) -> torch.Tensor:
            return torch.empty((n, tokens, hidden), device=ctx.device, dtype=dtype)

        self.x = buffers(pairs if backend.in_place else shared)
        self.residual_in = buffers(shared)
        self.residual_out = buffers(pairs)
        self.norm_out = buffers(pairs)
        self.gamma = rms_gamma(hidden, ctx.device, dtype)
        # Per-call views made once (slicing costs host time inside an eager timed loop).
        self._calls = [(self._slot(self.x, i), self._slot(self.residual_in, i), self.gamma, self.residual_out[i],
                        self.norm_out[i]) for i in range(pairs)]
        self._expected: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._local: list[torch.Tensor] = []

    @property
    def destroys_inputs(self) -> bool:
        return self.backend.in_place

    def _pattern(self, rank: int, epoch: int) -> torch.Tensor:
        # world_size + 1 terms are summed (every rank's x and the residual): keep their sum exact.
        return exact_pattern(rank, epoch, self.count, self.ctx.world_size + 1, self.ctx.device,
                             torch.float32).reshape(self.tokens, self.hidden)

    def _reference(self, epoch: int) -> tuple[torch.Tensor, torch.Tensor]:
        summed = sum(self._pattern(rank, epoch) for rank in range(self.ctx.world_size))
        return reference_residual_rmsnorm(summed, self._pattern(self.ctx.world_size, epoch), self.gamma, RMS_EPS)

    def prepare(self, base_epoch: int) -> None:
        epochs = [base_epoch + e for e in range(EPOCHS_PER_PASS)]
        self._expected = [self._reference(epoch) for epoch in epochs]
        self._local = []
        for e, epoch in enumerate(epochs):
            x = self._pattern(self.ctx.rank, epoch)
            residual = self._pattern(self.ctx.world_size, epoch)
            self._local.append(x + residual)
            self.x[e::EPOCHS_PER_PASS] = x.to(self.dtype)
            self.residual_in[e::EPOCHS_PER_PASS] = residual.to(self.dtype)
        self.residual_out.fill_(float("nan"))
        self.norm_out.fill_(float("nan"))

    def _slot(self, buffer: torch.Tensor, i: int) -> torch.Tensor:
        return buffer[i if buffer.shape[0] == self.pairs else i % EPOCHS_PER_PASS]

    def call(self, i: int) -> None:
        self.backend.allreduce_residual_rmsnorm(*self._calls[i])

    def verify(self, first: int, calls: int) -> PassCheck:
        result = PassCheck()
        checksum = torch.zeros((), dtype=torch.int64, device=self.ctx.device)
        for i in range(first, first + calls):
            e = i % EPOCHS_PER_PASS
            wrong, kind = check_fused(self.residual_out[i], self.norm_out[i], self._expected[e],
                                      self._expected[(i - 1) % EPOCHS_PER_PASS], self._local[e], self.dtype)
            checksum += bit_checksum(self.residual_out[i]) + bit_checksum(self.norm_out[i])
            result.add(i, wrong, kind)
        result.checksum = int(checksum.item())
        return result


def _wrong_mask(residual_out: torch.Tensor, norm_out: torch.Tensor,
                expected: tuple[torch.Tensor, torch.Tensor], tol: float) -> torch.Tensor:
    residual_ref, norm_ref = expected
    residual_wrong = residual_out.float() != residual_ref
    # NaN never passes the comparison, so an unwritten output counts as wrong.
    norm_ok = (norm_out.float() - norm_ref).abs() <= tol + tol * norm_ref.abs()
    return residual_wrong | ~norm_ok


def check_fused(residual_out: torch.Tensor, norm_out: torch.Tensor, expected: tuple[torch.Tensor, torch.Tensor],
                previous: tuple[torch.Tensor, torch.Tensor] | None, local_residual: torch.Tensor,
                dtype: torch.dtype) -> tuple[int, str | None]:
    """Wrong elements of one call (a position counts once even if both outputs are off), and
    what kind: 'unwritten' = both outputs still hold the NaN poison, 'noop' = the residual holds
    this rank's x alone (nothing was reduced), 'stale' = both outputs hold an earlier epoch's
    answer, else 'values'."""
    tol = TOLERANCE[dtype]
    wrong = int(_wrong_mask(residual_out, norm_out, expected, tol).sum().item())
    if wrong == 0:
        return 0, None
    if bool(torch.isnan(residual_out.float()).all()) and bool(torch.isnan(norm_out.float()).all()):
        return wrong, UNWRITTEN
    reduced_differs = local_residual != expected[0]
    if bool(reduced_differs.any()) and bool((residual_out.float() == local_residual)[reduced_differs].all()):
        return wrong, NOOP
    if previous is not None and not bool(_wrong_mask(residual_out, norm_out, previous, tol).any()):
        return wrong, STALE
    return wrong, VALUES
