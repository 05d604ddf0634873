"""What one timed call does, and how its result is checked.

Inputs are small integers that depend on rank, position and an epoch counter, so the sum is
exact in every dtype (bf16 holds integers up to 256 exactly) and every call of a new epoch
has a different right answer. That makes three failures visible and countable:
wrong values, a silent no-op (the output is the local input) and a stale result (the output
is the right answer of an earlier epoch).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from commbench.backends.base import Backend
    from commbench.context import RunContext


def pattern_amplitude(world_size: int) -> int:
    """Largest |value| per rank so that any partial sum stays within 256 (exact in bf16)."""
    return max(1, min(4, 256 // max(1, world_size)))


def exact_pattern(rank: int, epoch: int, count: int, world_size: int, device: torch.device,
                  dtype: torch.dtype) -> torch.Tensor:
    """Rank-, position- and epoch-dependent integers in [-a, a]; never all equal across ranks."""
    amp = pattern_amplitude(world_size)
    period = 2 * amp + 1
    index = torch.arange(count, device=device, dtype=torch.int64)
    values = (index * 7 + rank * 3 + epoch * 5 + (index // 13) * (rank + 1)) % period - amp
    return values.to(dtype)


def expected_sum(epoch: int, count: int, world_size: int, device: torch.device,
                 dtype: torch.dtype) -> torch.Tensor:
    total = torch.zeros(count, device=device, dtype=torch.int64)
    for rank in range(world_size):
        total += exact_pattern(rank, epoch, count, world_size, device, torch.int64)
    return total.to(dtype)


@dataclass
class CheckResult:
    wrong_elements: int
    wrong_kind: str | None = None   # "noop" | "stale" | "values"


def classify(output: torch.Tensor, expected: torch.Tensor, local_input: torch.Tensor,
             previous_expected: torch.Tensor | None) -> CheckResult:
    """Count wrong elements (exact compare) and name the failure."""
    out = output.reshape(-1)
    wrong_mask = out != expected.reshape(-1)
    wrong = int(wrong_mask.sum().item())
    if wrong == 0:
        return CheckResult(0)
    differs_from_input = expected.reshape(-1) != local_input.reshape(-1)
    if bool(differs_from_input.any()) and bool((out == local_input.reshape(-1))[differs_from_input].all()):
        return CheckResult(wrong, "noop")
    if previous_expected is not None and bool((out == previous_expected.reshape(-1)).all()):
        return CheckResult(wrong, "stale")
    return CheckResult(wrong, "values")


class Workload(ABC):
    """Inputs, one call and its check for one (backend, size, dtype) row."""

    count: int
    dtype: torch.dtype

    @abstractmethod
    def prepare(self, epoch: int) -> None:
        """Write the epoch's inputs into the (static) input buffers."""

    @abstractmethod
    def run(self) -> None:
        """One call on the current stream; must be capturable when the backend says so."""

    @abstractmethod
    def verify(self, epoch: int, previous_epoch: int | None) -> CheckResult:
        """Check the output of the last run() against the epoch's exact answer (this rank only)."""


class AllreduceWorkload(Workload):
    def __init__(self, backend: "Backend", ctx: "RunContext", count: int, dtype: torch.dtype):
        self.backend = backend
        self.ctx = ctx
        self.count = count
        self.dtype = dtype
        self.input = torch.empty(count, device=ctx.device, dtype=dtype)
        self.output: torch.Tensor | None = None
        self._local: torch.Tensor | None = None

    def prepare(self, epoch: int) -> None:
        self._local = exact_pattern(self.ctx.rank, epoch, self.count, self.ctx.world_size,
                                    self.ctx.device, self.dtype)
        self.input.copy_(self._local)

    def run(self) -> None:
        self.output = self.backend.allreduce(self.input)

    def verify(self, epoch: int, previous_epoch: int | None) -> CheckResult:
        assert self.output is not None and self._local is not None
        ws, dev = self.ctx.world_size, self.ctx.device
        expected = expected_sum(epoch, self.count, ws, dev, self.dtype)
        previous = (expected_sum(previous_epoch, self.count, ws, dev, self.dtype)
                    if previous_epoch is not None else None)
        if self.output.numel() != self.count:
            return CheckResult(self.count, "values")
        return classify(self.output, expected, self._local, previous)
