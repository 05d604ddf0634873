"""What the calls of one row compute, and how every one of them is checked.

A row's calls run over a set of input/output pairs that the harness owns: call i uses pair i,
and its inputs hold the exact pattern of epoch ``base + i % 3``, so every two adjacent calls
expect different answers. Outputs start poisoned (NaN) and are kept until the pass ends, so the
timed calls themselves are checked afterwards, on the device, as one count per call.

A backend may return a tensor of its own instead of writing the pair's output (an engine's
kernel that allocates its result): that tensor is kept as the call's output, checked the same
and poisoned with the pair's output before each pass, so that memory it reuses holds no answer.

Inputs are small integers that depend on rank, position and the epoch, so every sum is exact
in every dtype (bf16 holds integers up to 256 exactly). That makes these failures countable and
nameable: wrong values, an output never written, a silent no-op (the output is the local input)
and a stale result (the previous call's answer). A backend that reduces in place destroys its
input, so it gets one input per call; any other shares three inputs (one per epoch) among its
calls. Each rank also sums the bits of every output it checked, so ranks that got different
results (TP ranks that would diverge) show up even where every value is within tolerance.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Iterator, Protocol

import torch

if TYPE_CHECKING:
    from commbench.runtime.context import RunContext

EPOCHS_PER_PASS = 3
PAIR_ALIGN_BYTES = 256          # every pair starts on this boundary, as torch's own allocations do
CHECK_CHUNK_BYTES = 64 << 20    # outputs compared per step of the check (bounds its temporaries)
UNWRITTEN, NOOP, STALE, VALUES = "unwritten", "noop", "stale", "values"


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


def bit_checksum(values: torch.Tensor) -> torch.Tensor:
    """A position-weighted sum of the bits of each row (int64, wraps deterministically): equal
    on two ranks exactly when their rows are bit-identical, up to a negligible collision."""
    width = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[values.element_size()]
    bits = values.contiguous().view(width).to(torch.int64)
    weights = torch.arange(1, bits.shape[-1] + 1, device=values.device, dtype=torch.int64) % 65521 + 1
    return (bits * weights).sum()


@dataclass
class PassCheck:
    """This rank's check of one pass: every call's output against its exact answer."""

    calls: int = 0
    wrong_elements: int = 0
    wrong_calls: int = 0
    first_wrong_call: int | None = None
    kinds: dict[str, int] = field(default_factory=dict)     # wrong calls per kind
    checksum: int = 0

    def add(self, call: int, wrong: int, kind: str | None) -> None:
        self.calls += 1
        if not wrong:
            return
        self.wrong_elements += wrong
        self.wrong_calls += 1
        self.kinds[kind or VALUES] = self.kinds.get(kind or VALUES, 0) + 1
        if self.first_wrong_call is None or call < self.first_wrong_call:
            self.first_wrong_call = call


def name_failure(out: torch.Tensor, expected: torch.Tensor, local_input: torch.Tensor,
                 previous_expected: torch.Tensor | None) -> str:
    if out.is_floating_point() and bool(torch.isnan(out).all()):
        return UNWRITTEN
    differs_from_input = expected != local_input
    if bool(differs_from_input.any()) and bool((out == local_input)[differs_from_input].all()):
        return NOOP
    if previous_expected is not None and bool((out == previous_expected.reshape(-1)).all()):
        return STALE
    return VALUES


class Workload(ABC):
    """Input/output pairs, the calls and their check for one (backend, size, dtype) row."""

    count: int
    dtype: torch.dtype
    pairs: int

    @abstractmethod
    def prepare(self, base_epoch: int) -> None:
        """Write every pair's inputs for its epoch (base + i % 3) and poison every output."""

    @abstractmethod
    def call(self, i: int) -> None:
        """One call on pair i, on the current stream; capturable when the backend says so."""

    @abstractmethod
    def verify(self, first: int, calls: int) -> PassCheck:
        """Check the outputs of pairs first .. first + calls - 1 (this rank only)."""

    def bus_factor(self, world_size: int) -> float | None:
        """busbw = algbw x this (nccl-tests: the factor belongs to the collective); None when
        the op's time is not a bus transfer alone."""
        return None

    @property
    def destroys_inputs(self) -> bool:
        """True when a call overwrites its own inputs (then a graph replay re-reduces them)."""
        return False


def bandwidths_gbps(message_bytes: int, latency_us: float | None,
                    bus_factor: float | None) -> tuple[float | None, float | None]:
    """algbw = bytes / time (GB = 1e9 B); busbw = algbw x the collective's bus factor."""
    if latency_us is None or latency_us <= 0:
        return None, None
    algbw = message_bytes / (latency_us * 1e-6) / 1e9
    return algbw, (algbw * bus_factor if bus_factor is not None else None)


def pair_stride(count: int, dtype: torch.dtype) -> int:
    align = max(1, PAIR_ALIGN_BYTES // torch.tensor([], dtype=dtype).element_size())
    return -(-count // align) * align


def chunks(first: int, calls: int, row_bytes: int) -> Iterator[range]:
    """Ranges of calls whose outputs together stay within CHECK_CHUNK_BYTES."""
    step = max(1, CHECK_CHUNK_BYTES // max(1, row_bytes))
    for start in range(first, first + calls, step):
        yield range(start, min(start + step, first + calls))


class Reducer(Protocol):
    """What a plain allreduce workload needs of a backend (backends.base.Backend is one)."""

    in_place: bool

    def allreduce(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor | None: ...


class ReturnedOutputError(ValueError):
    """A backend returned a tensor that cannot be its call's output."""


def returned_reason(result: torch.Tensor, x: torch.Tensor) -> str | None:
    """Why a tensor a backend returned cannot hold the sum of x; None when it can."""
    if not isinstance(result, torch.Tensor):
        return f"returned {type(result).__name__}, not a tensor or None"
    if result.numel() != x.numel() or result.dtype != x.dtype or result.device != x.device:
        return (f"returned a tensor of {result.numel()} {str(result.dtype).replace('torch.', '')} on {result.device} "
                f"for an input of {x.numel()} {str(x.dtype).replace('torch.', '')} on {x.device}")
    if not result.is_contiguous():
        return "returned a tensor that is not contiguous"
    return None


class AllreduceWorkload(Workload):
    def __init__(self, backend: Reducer, ctx: "RunContext", count: int, dtype: torch.dtype, pairs: int):
        self.backend = backend
        self.ctx = ctx
        self.count = count
        self.dtype = dtype
        self.pairs = pairs
        self.in_place = backend.in_place
        stride = pair_stride(count, dtype)
        self.inputs = torch.empty((pairs if self.in_place else min(pairs, EPOCHS_PER_PASS), stride),
                                  device=ctx.device, dtype=dtype)
        self.outputs = self.inputs if self.in_place else torch.empty((pairs, stride), device=ctx.device, dtype=dtype)
        # Views made once: slicing a tensor costs microseconds of host time, which an eager
        # timed loop would count as the backend's.
        self._pairs = [(self.inputs[i if self.in_place else i % EPOCHS_PER_PASS, :count], self.outputs[i, :count])
                       for i in range(pairs)]
        # Per pair: the tensor the backend returned at its latest call (None: it wrote the pair's
        # output). In a CUDA graph, the one captured, which every replay rewrites.
        self.returned: list[torch.Tensor | None] = [None] * pairs
        self.local: torch.Tensor | None = None       # [3, count]: this rank's input per epoch
        self.expected: torch.Tensor | None = None    # [3, count]: the sum per epoch

    def input(self, i: int) -> torch.Tensor:
        return self._pairs[i][0]

    def output(self, i: int) -> torch.Tensor:
        """The tensor that holds call i's sum: the backend's own when it returned one."""
        returned = self.returned[i]
        return self._pairs[i][1] if returned is None else returned

    def prepare(self, base_epoch: int) -> None:
        ws, dev = self.ctx.world_size, self.ctx.device
        self.local = torch.stack([exact_pattern(self.ctx.rank, base_epoch + e, self.count, ws, dev, self.dtype)
                                  for e in range(EPOCHS_PER_PASS)])
        self.expected = torch.stack([expected_sum(base_epoch + e, self.count, ws, dev, self.dtype)
                                     for e in range(EPOCHS_PER_PASS)])
        for returned in self.returned:   # before the inputs: a returned tensor may be the input itself
            if returned is not None:
                returned.fill_(float("nan"))
        for e in range(min(EPOCHS_PER_PASS, self.inputs.shape[0])):
            self.inputs[e::EPOCHS_PER_PASS, : self.count] = self.local[e]
        if not self.in_place:
            self.outputs.fill_(float("nan"))

    def call(self, i: int) -> None:
        x, out = self._pairs[i]
        result = self.backend.allreduce(x, out)
        if result is not None:
            reason = returned_reason(result, x)
            if reason:
                raise ReturnedOutputError(reason)
            result = result.view(-1)
        self.returned[i] = result

    @property
    def destroys_inputs(self) -> bool:
        return self.in_place

    def bus_factor(self, world_size: int) -> float:
        """nccl-tests' allreduce factor: each rank sends and receives 2(n-1)/n of the message."""
        return 2 * (world_size - 1) / world_size

    def verify(self, first: int, calls: int) -> PassCheck:
        assert self.expected is not None and self.local is not None, "prepare() first"
        result = PassCheck()
        checksum = torch.zeros((), dtype=torch.int64, device=self.ctx.device)
        row_bytes = self.count * self.outputs.element_size()
        for part in chunks(first, calls, row_bytes):
            outputs = (self.outputs[part.start:part.stop, : self.count]
                       if all(self.returned[i] is None for i in part)
                       else torch.stack([self.output(i) for i in part]))
            index = torch.tensor([i % EPOCHS_PER_PASS for i in part], device=self.ctx.device)
            wrong = (outputs != self.expected[index]).sum(dim=1).tolist()
            checksum += bit_checksum(outputs)
            for i, count in zip(part, wrong):
                result.add(i, count, self._name(i) if count else None)
        result.checksum = int(checksum.item())
        return result

    def _name(self, i: int) -> str:
        e = i % EPOCHS_PER_PASS
        return name_failure(self.output(i), self.expected[e], self.local[e],
                            self.expected[(i - 1) % EPOCHS_PER_PASS])
