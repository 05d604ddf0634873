"""Timing: one timer around a loop of back-to-back calls (the headline), and per-step samples
(a separate, labelled jitter pass).

The headline is what nccl-tests measures: a timer around the whole loop on every rank, total
divided by the calls, then the max over ranks (nccl-tests ``-a 3``; the mean over ranks, its
``-a 1``, is recorded beside it). Timing each call instead costs host time per call (an event
record is a few microseconds, which inflated eager rows by 40% and more) and keeps every late
sample, so per-step samples only feed the jitter fields (p10..p99), never the headline.

GPU: CUDA events on the current stream, so a sample is device time from the end of the step
before the loop to the end of the last step. CPU (gloo): perf_counter, the calls are blocking.
A CUDA graph is timed the same way, one step being one replay of K captured calls.
"""

from __future__ import annotations

import time
import warnings
from typing import Callable

import torch

from commbench.results import percentile
from commbench.runtime.context import RunContext

Step = Callable[[int], None]


def synchronize(ctx: RunContext) -> None:
    if ctx.is_cuda:
        torch.cuda.synchronize(ctx.device)


def loop_total_us(ctx: RunContext, step: Step, count: int) -> float:
    """Microseconds for step(0) .. step(count - 1) back to back, one timer around them."""
    if not ctx.is_cuda:
        start = time.perf_counter()
        for i in range(count):
            step(i)
        return (time.perf_counter() - start) * 1e6
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    begin.record()
    for i in range(count):
        step(i)
    end.record()
    end.synchronize()
    return begin.elapsed_time(end) * 1e3


def per_step_us(ctx: RunContext, step: Step, count: int) -> list[float]:
    """Microseconds of each step, with a timer between every two steps (the jitter pass)."""
    if not ctx.is_cuda:
        samples = []
        for i in range(count):
            start = time.perf_counter()
            step(i)
            samples.append((time.perf_counter() - start) * 1e6)
        return samples
    events = [torch.cuda.Event(enable_timing=True) for _ in range(count + 1)]
    events[0].record()
    for i in range(count):
        step(i)
        events[i + 1].record()
    events[-1].synchronize()
    return [events[i].elapsed_time(events[i + 1]) * 1e3 for i in range(count)]


def capture_graph(step: Step, ops: int) -> torch.cuda.CUDAGraph:
    """Capture step(0) .. step(ops - 1) into one graph (kept, so its nodes can be counted)."""
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph(keep_graph=True)
    with warnings.catch_warnings():
        # An empty capture is reported by count_work_nodes as a `no_work` row, not as a warning.
        warnings.filterwarnings("ignore", message="The CUDA Graph is empty")
        with torch.cuda.graph(graph):
            for i in range(ops):
                step(i)
    graph.instantiate()
    torch.cuda.synchronize()
    return graph


# cudaGraphNodeType values that do no work of their own (empty, event wait/record).
_NO_WORK_NODE_TYPES = {5, 6, 7}
_CHILD_GRAPH_NODE_TYPE = 4


def count_work_nodes(graph: torch.cuda.CUDAGraph) -> int | None:
    """Kernel/copy/memset/... nodes in a captured graph; None when cuda-python is unavailable."""
    try:
        from cuda.bindings import runtime as cudart
    except ImportError:
        return None
    return _count_nodes(cudart, cudart.cudaGraph_t(init_value=graph.raw_cuda_graph()))


def _count_nodes(cudart, handle) -> int:
    err, _, count = cudart.cudaGraphGetNodes(handle, 0)
    if err != cudart.cudaError_t.cudaSuccess:
        raise RuntimeError(f"cudaGraphGetNodes failed: {err}")
    if count == 0:
        return 0
    err, nodes, count = cudart.cudaGraphGetNodes(handle, count)
    total = 0
    for node in nodes[:count]:
        err, node_type = cudart.cudaGraphNodeGetType(node)
        kind = int(node_type)
        if kind == _CHILD_GRAPH_NODE_TYPE:
            err, child = cudart.cudaGraphChildGraphNodeGetGraph(node)
            total += _count_nodes(cudart, child)
        elif kind not in _NO_WORK_NODE_TYPES:
            total += 1
    return total


def headline_us(per_rank_total_us: list[float], calls: int) -> dict[str, float]:
    """Per-call time from each rank's loop total: the slowest rank (the headline) and the mean."""
    per_call = [total / calls for total in per_rank_total_us]
    return {"latency_us": max(per_call), "latency_rank_mean_us": sum(per_call) / len(per_call)}


def max_over_ranks(per_rank_samples: list[list[float]]) -> list[float]:
    """Per-step max over ranks: the slowest rank decides each step."""
    return [max(values) for values in zip(*per_rank_samples)]


def jitter_stats(per_rank_samples: list[list[float]], calls_per_step: int) -> dict[str, float | int]:
    """Percentiles of the per-call time over the jitter pass's steps, max over ranks per step."""
    ordered = sorted(s / calls_per_step for s in max_over_ranks(per_rank_samples))
    return {
        "jitter_samples": len(ordered),
        "jitter_p10_us": percentile(ordered, 10),
        "jitter_p50_us": percentile(ordered, 50),
        "jitter_p90_us": percentile(ordered, 90),
        "jitter_p99_us": percentile(ordered, 99),
        "jitter_min_us": ordered[0],
        "jitter_max_us": ordered[-1],
    }
