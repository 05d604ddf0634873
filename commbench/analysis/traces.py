"""A serving trace read, checked and split into steps: what `attribute` and `report --trace`
share (typed: report calls these with its --trace-hidden / --trace-batch, never a Namespace)."""

from __future__ import annotations

import re
import statistics
from pathlib import Path

from commbench import models
from commbench.analysis.attribution import RankResult, SizeHint, analyse_rank, set_first_apart
from commbench.analysis.skew import Skew, split
from commbench.analysis.trace_read import RankTrace, read_trace
from commbench.errors import UsageError
from commbench.units import DTYPE_BYTES, dtype_name, shape_bytes

SGLANG_RANK = re.compile(r"-TP-(\d+)")


def size_hint(model_name: str | None, hidden: int | None, batch: int | None, dtype: str | None) -> SizeHint:
    """The allreduce size a trace's steps send, from --model or --hidden with --batch (typed: report
    calls it with its --trace-hidden / --trace-batch)."""
    if model_name and hidden:
        raise UsageError("give --model or --hidden, not both")
    act = dtype_name(dtype) if dtype else "bf16"
    if model_name:
        model = models.lookup(model_name)
        hidden, act = model.hidden, dtype_name(dtype) if dtype else model.dtype
    # the sweep's shape bounds, each flag alone too
    message_bytes = shape_bytes(1 if batch is None else batch, 1 if hidden is None else hidden,
                                DTYPE_BYTES[act], "--batch", "--hidden")
    if hidden and batch:
        return SizeHint(message_bytes, f"{batch} x {hidden} x {act}", hidden)
    return SizeHint(None, "unknown")


def load_ranks(paths: list[Path]) -> list[tuple[int, RankTrace]]:
    """Every rank of every file, numbered; bad or mismatched input raises UsageError."""
    traces: list[RankTrace] = []
    for path in paths:
        for trace in read_trace(path):
            if not any(k.is_kernel for k in trace.kernels):
                raise UsageError(f"{path}: no GPU kernels in this trace (a CPU-only profile? record with "
                                 "ProfilerActivity.CUDA)")
            if trace.rank is None and (m := SGLANG_RANK.search(path.name)):
                trace.rank = int(m.group(1))
            traces.append(trace)
    worlds = {t.world_size for t in traces if t.world_size is not None}
    if len(worlds) > 1:
        raise UsageError(f"mismatched ranks: the traces come from world sizes {sorted(worlds)}")
    if all(t.rank is None for t in traces):
        return list(enumerate(traces))
    seen: dict[int, str] = {}
    for t in traces:
        if t.rank is None:
            raise UsageError(f"mismatched ranks: {t.source} names no rank, the other traces do")
        if t.rank in seen:
            raise UsageError(f"mismatched ranks: rank {t.rank} in both {seen[t.rank]} and {t.source}")
        if worlds and not 0 <= t.rank < next(iter(worlds)):
            raise UsageError(f"mismatched ranks: {t.source} is rank {t.rank} of world size {next(iter(worlds))}")
        seen[t.rank] = t.source
    return sorted(((t.rank, t) for t in traces), key=lambda x: x[0])  # type: ignore[misc]


def analyse_traces(paths: list[Path], hint: SizeHint, rule: str = "auto", annotation: re.Pattern[str] | None = None,
                   gap_us: float | None = None) -> tuple[list[tuple[int, RankTrace]], list[RankResult]]:
    ranks = load_ranks(paths)
    results = [analyse_rank(t, rank, hint, rule, annotation, gap_us) for rank, t in ranks]
    set_first_apart(results)
    return ranks, results


def first_apart_text(results: list[RankResult]) -> str | None:
    apart = [r for r in results if r.first_apart is not None]
    if not apart:
        return None
    walls = "; ".join(f"rank {r.rank} {r.first_apart.wall_us:,.0f} us against a median of "  # type: ignore[union-attr]
                      f"{statistics.median(s.wall_us for s in r.steps):,.0f} us" for r in apart if r.steps)
    return f"the first step is set apart (the profiler's start: over 3x the median step), not in the figures: {walls}"


def cross_rank(paths: list[Path], ranks: list[tuple[int, RankTrace]], results: list[RankResult],
               clock: str = "auto") -> Skew | None:
    """Wait and transfer per call where several ranks of one group are given; None for one rank."""
    if len(results) < 2:
        return None
    return split(results, [t.kernels for _, t in ranks], clock, one_file=len(set(paths)) == 1,
                 world_size=ranks[0][1].world_size)


def trace_provenance(ranks: list[tuple[int, RankTrace]]) -> str:
    first = ranks[0][1]
    what = first.provenance or "a profiler trace as given"
    world = first.world_size
    device = f", {first.device_name}" if first.device_name else ""
    numbers = ", ".join(str(r) for r, _ in ranks)
    of_world = f" of world size {world}" if world else ""
    return f"trace: {what}; rank(s) {numbers}{of_world}; {first.trace_format} format{device}"
