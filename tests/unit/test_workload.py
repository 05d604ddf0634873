"""The per-call check of a pass, on the CPU in one process: every pair's output is compared
with its own epoch's answer, failures are located and named, and ranks can be compared by the
bits of what they checked."""

from __future__ import annotations

import pytest
import torch

from commbench.backends.base import Backend
from commbench.runtime.context import RunContext
from commbench.runtime.workload import EPOCHS_PER_PASS, AllreduceWorkload, ReturnedOutputError, expected_sum


class Solo(Backend):
    """World size 1: the sum is the input. `fault(i, x, out)` spoils chosen calls."""

    name = "solo"

    def __init__(self, in_place: bool = False, fault=None):
        self.in_place = in_place
        self.fault = fault
        self.calls = 0
        self.last: torch.Tensor | None = None

    def setup(self, ctx, max_bytes, dtype) -> None:
        pass

    def allreduce(self, x: torch.Tensor, out: torch.Tensor) -> None:
        if not self.in_place:
            out.copy_(x)
        if self.fault:
            self.fault(self, x, out)
        self.calls += 1
        self.last = out


def cpu_ctx() -> RunContext:
    return RunContext(rank=0, world_size=1, local_rank=0, local_world_size=1, device=torch.device("cpu"),
                      control_group=None)


def run_pass(backend: Solo, pairs: int = 10, count: int = 100, dtype=torch.float32):
    workload = AllreduceWorkload(backend, cpu_ctx(), count, dtype, pairs)
    workload.prepare(30)
    for i in range(pairs):
        workload.call(i)
    return workload, workload.verify(0, pairs)


def test_every_call_is_checked_against_its_own_epoch():
    workload, check = run_pass(Solo())
    assert (check.calls, check.wrong_calls, check.first_wrong_call) == (10, 0, None)
    for i in range(10):
        expected = expected_sum(30 + i % EPOCHS_PER_PASS, 100, 1, torch.device("cpu"), torch.float32)
        assert torch.equal(workload.output(i), expected)
    # Adjacent calls expect different answers, so a repeated answer cannot pass.
    assert not torch.equal(workload.output(0), workload.output(1))


def test_one_wrong_call_in_the_middle_is_found_and_located():
    def spoil_call_6(backend, x, out):
        if backend.calls == 6:
            out[3] += 1
    _, check = run_pass(Solo(fault=spoil_call_6))
    assert (check.wrong_elements, check.wrong_calls, check.first_wrong_call, check.kinds) == \
        (1, 1, 6, {"values": 1})


def test_the_previous_calls_answer_is_stale_and_an_unwritten_output_says_so():
    def previous(backend, x, out):
        if backend.calls == 4:
            out.copy_(backend.last)
    _, check = run_pass(Solo(fault=previous))
    assert (check.first_wrong_call, check.kinds, check.wrong_calls) == (4, {"stale": 1}, 1)

    def skip(backend, x, out):
        if backend.calls == 2:
            out.fill_(float("nan"))
    _, check = run_pass(Solo(fault=skip))
    assert (check.first_wrong_call, check.kinds) == (2, {"unwritten": 1})


def test_a_result_that_the_next_call_overwrites_fails_every_call_but_the_last():
    def clobber_previous(backend, x, out):
        if backend.last is not None:
            backend.last.zero_()
    _, check = run_pass(Solo(fault=clobber_previous))
    assert (check.wrong_calls, check.first_wrong_call) == (9, 0)


def test_in_place_backends_get_one_input_per_call_and_a_no_op_is_named():
    workload, check = run_pass(Solo(in_place=True))
    assert workload.inputs.shape[0] == 10 and workload.outputs is workload.inputs
    assert check.wrong_calls == 0
    shared = AllreduceWorkload(Solo(), cpu_ctx(), 100, torch.float32, 10)
    assert shared.inputs.shape[0] == EPOCHS_PER_PASS and shared.outputs.shape[0] == 10


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_checksum_tells_bit_identical_outputs_from_different_ones(dtype):
    _, first = run_pass(Solo(), dtype=dtype)
    _, again = run_pass(Solo(), dtype=dtype)
    assert first.checksum == again.checksum

    def nudge(backend, x, out):
        if backend.calls == 3:
            out[0] = -0.0 if float(out[0]) == 0.0 else out[0]
            out[1] += 0.0
            out[2] = out[2] + 1
    _, other = run_pass(Solo(fault=nudge), dtype=dtype)
    assert other.checksum != first.checksum


def test_pairs_start_aligned_for_vector_kernels():
    # 1000 bf16 elements are 2000 bytes: every pair still starts 256 bytes past its buffer's
    # start, which CUDA's allocator aligns to 512.
    workload = AllreduceWorkload(Solo(), cpu_ctx(), 1000, torch.bfloat16, 5)
    assert all((workload.output(i).data_ptr() - workload.outputs.data_ptr()) % 256 == 0 for i in range(5))
    assert all((workload.input(i).data_ptr() - workload.inputs.data_ptr()) % 256 == 0 for i in range(3))


class Returns(Solo):
    """Hands back a tensor of its own, as an engine's kernel does: a fresh one per call, x itself
    (in place), or, like a CUDA graph's captured output, one kept per call and rewritten."""

    def __init__(self, how: str = "fresh", in_place: bool = False, fault=None):
        super().__init__(in_place, fault)
        self.how = how
        self.kept: dict[int, torch.Tensor] = {}
        self.skip_writes = False

    def allreduce(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if self.how == "input":
            return x
        if self.how == "fresh":
            return x.clone()
        result = self.kept.setdefault(self.calls % 10, torch.empty_like(x))
        if not self.skip_writes:
            result.copy_(x)
        return result


@pytest.mark.parametrize("how, in_place", [("fresh", False), ("input", True), ("kept", False)])
def test_a_returned_tensor_is_the_output_that_is_checked(how, in_place):
    backend = Returns(how, in_place)
    workload, check = run_pass(backend)
    assert (check.calls, check.wrong_calls) == (10, 0)
    # The harness's own outputs were never written: the returned tensors were checked.
    assert in_place or bool(torch.isnan(workload.outputs).all())


def test_a_returned_tensor_left_unwritten_in_the_next_pass_is_caught():
    backend = Returns("kept")
    workload, check = run_pass(backend)
    assert check.wrong_calls == 0
    backend.skip_writes = True      # a replay that wrote nothing: last pass's answers were poisoned
    workload.prepare(40)
    for i in range(10):
        workload.call(i)
    check = workload.verify(0, 10)
    assert (check.wrong_calls, check.kinds) == (10, {"unwritten": 10})


def test_a_returned_tensor_that_cannot_be_the_output_is_an_error_naming_it():
    workload = AllreduceWorkload(Returns("fresh"), cpu_ctx(), 100, torch.float32, 2)
    workload.prepare(30)
    workload.backend.allreduce = lambda x, out: x[:50].clone()
    with pytest.raises(ReturnedOutputError, match="returned a tensor of 50 float32 on cpu for an input of 100"):
        workload.call(0)
    workload.backend.allreduce = lambda x, out: x.to(torch.float64)
    with pytest.raises(ReturnedOutputError, match="returned a tensor of 100 float64"):
        workload.call(0)
    workload.backend.allreduce = lambda x, out: [x]
    with pytest.raises(ReturnedOutputError, match="returned list, not a tensor or None"):
        workload.call(0)
