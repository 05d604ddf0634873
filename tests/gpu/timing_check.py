"""What a timer costs, on one GPU: torch's copy_ of one message timed the two ways commbench
could time it, and CUDA graphs of 1 to 128 copies (the per-replay cost that sets --graph-ops).

  python3 tests/gpu/timing_check.py [--bytes 8192] [--calls 200]

Eager: one CUDA event per call (the jitter pass) against one timer around the loop (the
headline). Graph: per-copy time of a graph of K copies, from one timer around R replays; the
difference between K = 1 and K = 128 is the replay's own cost. Prints a table, then a JSON
summary as its last line. Nothing here communicates: it measures the timer, not a fabric.
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch

GRAPH_SIZES = (1, 10, 100, 128)
REPEATS = 5          # every figure is the median of this many measurements


def events_per_call_us(copy, calls: int) -> float:
    events = [torch.cuda.Event(enable_timing=True) for _ in range(calls + 1)]
    events[0].record()
    for i in range(calls):
        copy()
        events[i + 1].record()
    torch.cuda.synchronize()
    return statistics.median(events[i].elapsed_time(events[i + 1]) * 1e3 for i in range(calls))


def loop_us(step, count: int) -> float:
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    begin.record()
    for _ in range(count):
        step()
    end.record()
    torch.cuda.synchronize()
    return begin.elapsed_time(end) * 1e3 / count


def graph_per_copy_us(copy, ops: int, replays: int) -> float:
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(ops):
            copy()
    graph.replay()
    torch.cuda.synchronize()
    return loop_us(graph.replay, replays) / ops


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--bytes", type=int, default=8192)
    parser.add_argument("--calls", type=int, default=200)
    args = parser.parse_args()
    src = torch.ones(args.bytes // 2, dtype=torch.bfloat16, device="cuda")
    dst = torch.empty_like(src)

    def copy() -> None:
        dst.copy_(src)

    for _ in range(50):
        copy()
    torch.cuda.synchronize()
    eager_events = statistics.median(events_per_call_us(copy, args.calls) for _ in range(REPEATS))
    eager_loop = statistics.median(loop_us(copy, args.calls) for _ in range(REPEATS))
    graph = {ops: statistics.median(graph_per_copy_us(copy, ops, max(20, 2000 // ops)) for _ in range(REPEATS))
             for ops in GRAPH_SIZES}
    replay_overhead_us = (graph[1] - graph[128]) * 128 / 127
    print(f"copy_ {args.bytes} B, {torch.cuda.get_device_name()}")
    print(f"  eager, event per call (median): {eager_events:8.2f} us")
    print(f"  eager, one timer / calls:       {eager_loop:8.2f} us")
    for ops, us in graph.items():
        print(f"  graph of {ops:3d} copies, per copy:  {us:8.2f} us")
    print(f"  one replay's own cost:          {replay_overhead_us:8.2f} us")
    print(json.dumps({"bytes": args.bytes, "eager_event_per_call_us": eager_events, "eager_loop_us": eager_loop,
                      "graph_per_copy_us": graph, "replay_overhead_us": replay_overhead_us}))


if __name__ == "__main__":
    main()
