"""The sweep plan (commbench/sweep/plan.py): default sizes, calls per size, graph captures, model
shapes, the cells of each variant, and the flags it refuses."""

from __future__ import annotations

import pytest
import torch

from commbench.errors import UsageError
from commbench.ops import ALLREDUCE
from commbench.sweep.plan import Shape, build_plan
from helpers import sweep_args


def test_default_plans_gpu_decode_to_prefill_and_short_cpu() -> None:
    gpu = build_plan(sweep_args(), on_gpu=True)
    assert gpu.shapes[0].message_bytes == 4 << 10 and gpu.shapes[-1].message_bytes == 256 << 20
    assert len(gpu.shapes) == 17 and gpu.modes == ["eager", "graph"] and gpu.dtypes == [torch.bfloat16]
    cpu = build_plan(sweep_args(), on_gpu=False)
    assert [s.message_bytes for s in cpu.shapes] == [1024, 4096, 16384, 65536, 262144]
    assert cpu.modes == ["eager"] and cpu.dtypes == [torch.float32]


def test_iterations_scale_down_with_size_within_bounds() -> None:
    plan = build_plan(sweep_args(), on_gpu=True)
    counts = [plan.iterations_for(s.message_bytes) for s in plan.shapes]
    assert counts[0] == 200 and counts == sorted(counts, reverse=True)
    # Every timed output is kept for the check: 2 GiB of them at most, so 8 calls at 256 MiB.
    assert plan.iterations_for(64 << 20) == 20 and counts[-1] == plan.iterations_for(256 << 20) == 8
    assert build_plan(sweep_args("--iters", "7"), on_gpu=True).iterations_for(1 << 30) == 7


def test_graphs_capture_enough_calls_to_hide_the_replay_overhead() -> None:
    plan = build_plan(sweep_args(), on_gpu=True)
    ops = {size: plan.graph_ops_for(size) for size in (4 << 10, 1 << 20, 2 << 20, 4 << 20, 64 << 20, 256 << 20)}
    assert ops == {4 << 10: 128, 1 << 20: 128, 2 << 20: 128, 4 << 20: 64, 64 << 20: 4, 256 << 20: 1}
    assert [plan.graph_replays_for(s) for s in (4 << 10, 4 << 20, 256 << 20)] == [50, 20, 20]
    fixed = build_plan(sweep_args("--graph-ops", "10", "--iters", "30"), on_gpu=True)
    assert (fixed.graph_ops_for(4 << 10), fixed.graph_replays_for(4 << 10)) == (10, 30)


def test_model_shapes_and_explicit_lists() -> None:
    plan = build_plan(sweep_args("--tokens", "1,8", "--hidden", "7168"), on_gpu=True)
    assert plan.shapes == [Shape(14336, 1, 7168), Shape(8 * 14336, 8, 7168)]
    plan = build_plan(sweep_args("--sizes", "12K,8K", "--dtype", "fp16,fp32"), on_gpu=True)
    assert [s.message_bytes for s in plan.shapes] == [8192, 12288]
    assert plan.sizes_for(torch.float32) == plan.shapes


def test_the_plan_yields_each_variants_cells_in_the_order_they_are_measured() -> None:
    plan = build_plan(sweep_args("--sizes", "12K,8K", "--dtype", "fp16,fp32"), on_gpu=True)
    cells = plan.cells("nccl:proto=LL", ALLREDUCE, {"NCCL_B": "2", "NCCL_A": "1"})
    assert [(c.dtype, c.shape.message_bytes, c.mode) for c in cells[:3]] == [
        ("fp16", 8192, "eager"), ("fp16", 8192, "graph"), ("fp16", 12288, "eager")]
    assert len(set(cells)) == len(cells) == 8 and {c.dtype for c in cells[4:]} == {"fp32"}
    # The setting is kept sorted: the order it was written in never makes two cells differ.
    assert cells[0].env_setting == (("NCCL_A", "1"), ("NCCL_B", "2"))
    assert cells == plan.cells("nccl:proto=LL", ALLREDUCE, {"NCCL_A": "1", "NCCL_B": "2"})
    assert cells[0].library == "" and cells[0].backend == "nccl:proto=LL" and cells[0].op == ALLREDUCE


@pytest.mark.parametrize("argv, message", [
    (["-b", "4K", "--sizes", "8K"], "two ways"),
    (["--hidden", "4096"], "need both"),
    (["--tokens", "1", "--hidden", "4096", "--dtype", "bf16,fp32"], "one --dtype"),
    (["--mode", "fast"], "unknown mode"),
    (["-f", "1"], "step factor"),
    (["--timeout", "0"], "--timeout"),
    (["--setup-timeout", "-1"], "--setup-timeout must be a positive, finite number of seconds"),
])
def test_plan_rejects_contradictions(argv: list[str], message: str) -> None:
    with pytest.raises(UsageError, match=message):
        build_plan(sweep_args(*argv), on_gpu=True)
