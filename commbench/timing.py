"""Timing: eager loops with per-iteration CUDA events, CUDA-graph replays, and CPU timing.

Eager (GPU): ops are launched back to back with an event between each pair, so one sample is
the steady-state time of one call including its launch cost when the host is the bottleneck.
Graph: K calls are captured into one graph; one sample is one replay divided by K.
CPU (gloo): every call is preceded by a barrier and timed with perf_counter.
The caller gathers the per-iteration samples from all ranks and takes the max per iteration.
"""

from __future__ import annotations

import time
import warnings
from typing import Callable

import torch

from commbench.context import RunContext


def time_eager(ctx: RunContext, call: Callable[[], None], iterations: int, warmup: int) -> list[float]:
    """Per-iteration microseconds of `call` on this rank."""
    for _ in range(warmup):
        call()
    if not ctx.is_cuda:
        samples = []
        for _ in range(iterations):
            ctx.barrier()
            start = time.perf_counter()
            call()
            samples.append((time.perf_counter() - start) * 1e6)
        return samples
    torch.cuda.synchronize()
    ctx.barrier()
    events = [torch.cuda.Event(enable_timing=True) for _ in range(iterations + 1)]
    events[0].record()
    for i in range(iterations):
        call()
        events[i + 1].record()
    torch.cuda.synchronize()
    return [events[i].elapsed_time(events[i + 1]) * 1e3 for i in range(iterations)]


def capture_graph(call: Callable[[], None], ops: int) -> torch.cuda.CUDAGraph:
    """Capture `ops` back-to-back calls into one graph (kept, so its nodes can be counted)."""
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph(keep_graph=True)
    with warnings.catch_warnings():
        # An empty capture is reported by count_work_nodes as a `no_work` row, not as a warning.
        warnings.filterwarnings("ignore", message="The CUDA Graph is empty")
        with torch.cuda.graph(graph):
            for _ in range(ops):
                call()
    graph.instantiate()
    torch.cuda.synchronize()
    return graph


def time_graph(ctx: RunContext, graph: torch.cuda.CUDAGraph, ops: int, iterations: int,
               warmup: int) -> list[float]:
    """Per-call microseconds: each sample is one replay of `ops` calls divided by `ops`."""
    for _ in range(warmup):
        graph.replay()
    torch.cuda.synchronize()
    ctx.barrier()
    events = [torch.cuda.Event(enable_timing=True) for _ in range(iterations + 1)]
    events[0].record()
    for i in range(iterations):
        graph.replay()
        events[i + 1].record()
    torch.cuda.synchronize()
    return [events[i].elapsed_time(events[i + 1]) * 1e3 / ops for i in range(iterations)]


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


def percentile(sorted_values: list[float], q: float) -> float:
    """Linear-interpolated percentile of an already sorted list (q in [0, 100])."""
    if not sorted_values:
        raise ValueError("no samples")
    position = (len(sorted_values) - 1) * q / 100.0
    low = int(position)
    high = min(low + 1, len(sorted_values) - 1)
    return sorted_values[low] + (sorted_values[high] - sorted_values[low]) * (position - low)


def max_over_ranks(per_rank_samples: list[list[float]]) -> list[float]:
    """Per-iteration max over ranks: the slowest rank decides each iteration."""
    return [max(values) for values in zip(*per_rank_samples)]


def latency_stats(samples_us: list[float]) -> dict[str, float]:
    ordered = sorted(samples_us)
    return {
        "latency_p50_us": percentile(ordered, 50),
        "latency_p10_us": percentile(ordered, 10),
        "latency_p90_us": percentile(ordered, 90),
        "latency_p99_us": percentile(ordered, 99),
        "latency_min_us": ordered[0],
        "latency_max_us": ordered[-1],
    }


def bandwidths_gbps(message_bytes: int, latency_us: float, world_size: int) -> tuple[float, float]:
    """algbw = bytes / time; allreduce busbw = algbw * 2(n-1)/n (nccl-tests' definition)."""
    if latency_us <= 0:
        return 0.0, 0.0
    algbw = message_bytes / (latency_us * 1e-6) / 1e9
    return algbw, algbw * 2 * (world_size - 1) / world_size
