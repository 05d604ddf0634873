"""What one rank's trace spends on allreduce: its kernels classified, split into steps, measured.

Step rules, tried in this order unless one is asked for (the rule used is always printed):

- graph: every CUDA-graph replay is one step (its kernels share the correlation id of the
  cudaGraphLaunch, and carry a "graph id" where the profiler records one); kernels outside replays (eager work, prefill) belong to no step. An engine
  that replays several graph pieces per step (piecewise capture) shows one step per piece: use
  the annotation rule for it.
- annotation: the engine's step annotations (vLLM's "gpu_model_runner: forward", torch.profiler's
  "ProfilerStep#N", then any annotation whose name holds "step", such as a user's own
  record_function("decode_step_3"); or --step-annotation REGEX); a kernel belongs to the
  annotation that encloses its launch on the host thread, or, without launch records, its GPU
  annotation.
- gap: the device goes idle longer than the gap threshold (default: the larger of 100 us and 20x
  the median idle gap between kernels).

Per step: wall (first kernel start to last kernel end), GPU-busy (union of kernels, copies and
sets), the allreduce calls and their time, their share of the wall, and how much of each
allreduce ran beside compute on another stream.

The first step after the profiler starts often carries the profiler's own start (a replay of
hundreds of ms against a median of one): where it is over FIRST_STEP_FACTOR x the median of
the others, set_first_apart takes it out of the steps on every rank and says so.
"""

from __future__ import annotations

import bisect
import re
import statistics
from collections import defaultdict
from dataclasses import dataclass, field

from commbench.analysis.trace_kernels import Classification, classify
from commbench.analysis.trace_read import HostSpan, Kernel, RankTrace
from commbench.errors import UsageError
from commbench.ops import ALLREDUCE
from commbench.results import percentile

RULES = ("graph", "annotation", "gap")
# vLLM v1 vllm/v1/worker/gpu_model_runner.py ("gpu_model_runner: forward"; 0.33.0 line 4167; the
# 0.34.0 worker, vllm/v1/worker/gpu/, annotates no step); torch.profiler's schedule marks each
# profiler step as ProfilerStep#N; then any annotation naming a step (a user's own
# record_function("decode_step_3")); it must enclose kernel launches to make a step.
ENGINE_STEP_ANNOTATION = re.compile(r"^gpu_model_runner: forward$")
PROFILER_STEP_ANNOTATION = re.compile(r"^ProfilerStep#\d+$")
ANY_STEP_ANNOTATION = re.compile(r"step", re.IGNORECASE)
DEFAULT_STEP_ANNOTATIONS = (ENGINE_STEP_ANNOTATION, PROFILER_STEP_ANNOTATION, ANY_STEP_ANNOTATION)
FIRST_STEP_FACTOR = 3.0
MIN_STEPS_FOR_APART = 3
GRAPH_LAUNCH = re.compile(r"GraphLaunch", re.IGNORECASE)   # cudaGraphLaunch, cuGraphLaunch
MIN_GAP_US = 100.0
GAP_MEDIAN_FACTOR = 20.0
# How far back, among a host thread's collective ops sorted by start, a launch looks for the op
# that encloses it (ops nest only a few deep).
ENCLOSING_LOOKBACK = 64


@dataclass(slots=True)   # one per allreduce kernel: a decode trace holds 10^5 and more
class Call:
    """One allreduce kernel."""
    name: str
    library: str
    floor_variants: str
    note: str
    ts_us: float
    dur_us: float
    stream: int
    in_graph: bool
    message_bytes: int | None = None
    size_from: str = "unknown"      # "recorded" | "--hidden x --batch" | "unknown"
    op: str = ALLREDUCE             # what the kernel computes (its TRACE_KERNELS entry's op)
    hidden: int | None = None       # where the size is --batch x --hidden: the shape's hidden
    overlap_us: float = 0.0         # time beside compute kernels on other streams
    wait_us: float | None = None    # for the last rank's arrival, where every rank's trace is given

    @property
    def end_us(self) -> float:
        return self.ts_us + self.dur_us

    @property
    def transfer_us(self) -> float:
        """The kernel's own time: its duration less the wait where that is known."""
        return self.dur_us - (self.wait_us or 0.0)


@dataclass
class Step:
    rank: int
    index: int
    phase: str                      # "decode" | "prefill" | "-" (not told apart)
    start_us: float
    end_us: float
    busy_us: float
    calls: list[Call] = field(default_factory=list)
    other_comm: list[Kernel] = field(default_factory=list)   # unclassified communication
    kernels: list[Kernel] = field(default_factory=list)

    @property
    def wall_us(self) -> float:
        return self.end_us - self.start_us

    @property
    def allreduce_us(self) -> float:
        return sum(c.dur_us for c in self.calls)

    @property
    def share(self) -> float:
        return self.allreduce_us / self.wall_us if self.wall_us > 0 else 0.0

    @property
    def overlap_us(self) -> float:
        return sum(c.overlap_us for c in self.calls)

    def call_percentile(self, q: float) -> float | None:
        values = sorted(c.dur_us for c in self.calls)
        return percentile(values, q) if values else None


@dataclass
class RankResult:
    rank: int
    source: str
    rule: str
    rule_detail: str
    steps: list[Step]
    outside_kernels: int            # kernels in no step (eager work between graph replays, ...)
    outside_allreduce: list[Call]   # allreduce kernels in no step
    unclassified: dict[str, int]    # kernel name -> count
    first_apart: Step | None = None  # the first step, set apart as the profiler's start


@dataclass
class SizeHint:
    """--hidden x --batch (x dtype bytes): the size of a call whose trace recorded none."""
    message_bytes: int | None
    text: str
    hidden: int | None = None       # the shape's hidden, where message_bytes is given


def union_length(intervals: list[tuple[float, float]]) -> float:
    total, cur_start, cur_end = 0.0, None, None
    for start, end in sorted(intervals):
        if cur_end is None or start > cur_end:
            if cur_end is not None:
                total += cur_end - cur_start  # type: ignore[operator]
            cur_start, cur_end = start, end
        else:
            cur_end = max(cur_end, end)
    if cur_end is not None:
        total += cur_end - cur_start  # type: ignore[operator]
    return total


def _merged(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[tuple[float, float]] = []
    for start, end in sorted(intervals):
        if out and start <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], end))
        else:
            out.append((start, end))
    return out


def _overlap(start: float, end: float, merged: list[tuple[float, float]]) -> float:
    i = bisect.bisect_left(merged, (start, start)) - 1
    total = 0.0
    for a, b in merged[max(i, 0):]:
        if a >= end:
            break
        total += max(0.0, min(b, end) - max(a, start))
    return total


class _SizeFinder:
    """The recorded size of the host collective op that launched a kernel."""

    def __init__(self, trace: RankTrace):
        self.launches = trace.launches
        by_thread: dict[int, list[HostSpan]] = defaultdict(list)
        for op in trace.collective_ops:
            if op.message_bytes is not None:
                by_thread[op.thread].append(op)
        self.ops = {t: sorted(ops, key=lambda o: o.ts_us) for t, ops in by_thread.items()}
        self.starts = {t: [o.ts_us for o in ops] for t, ops in self.ops.items()}

    def size(self, kernel: Kernel) -> int | None:
        launch = self.launches.get(kernel.correlation) if kernel.correlation is not None else None
        if launch is None or launch.thread not in self.ops:
            return None
        ops, starts = self.ops[launch.thread], self.starts[launch.thread]
        i = bisect.bisect_right(starts, launch.ts_us)
        best: HostSpan | None = None
        for op in reversed(ops[max(0, i - ENCLOSING_LOOKBACK):i]):
            if op.ts_us <= launch.ts_us <= op.end_us and (best is None or op.dur_us < best.dur_us):
                best = op
        return best.message_bytes if best else None


def _replayed(trace: RankTrace, kernel: Kernel) -> bool:
    """Run by a CUDA-graph replay: the kernel carries a graph id, or (profilers that record none,
    as torch 2.11's kineto on an H200 did) its correlation id is that of a graph launch."""
    if kernel.graph_id is not None:
        return True
    launch = trace.launches.get(kernel.correlation) if kernel.correlation is not None else None
    return launch is not None and GRAPH_LAUNCH.search(launch.name) is not None


def _graph_groups(trace: RankTrace, kernels: list[Kernel]) -> list[list[Kernel]] | None:
    replayed = [k for k in kernels if k.correlation is not None and _replayed(trace, k)]
    if not replayed:
        return None
    groups: dict[int, list[Kernel]] = defaultdict(list)
    for k in replayed:
        groups[k.correlation].append(k)  # type: ignore[index]
    return sorted(groups.values(), key=lambda g: min(k.ts_us for k in g))


def _annotation_groups(trace: RankTrace, kernels: list[Kernel], pattern: re.Pattern[str] | None
                       ) -> tuple[list[tuple[str, list[Kernel]]], str] | None:
    patterns = [pattern] if pattern else list(DEFAULT_STEP_ANNOTATIONS)
    for pat in patterns:
        host = sorted((a for a in trace.annotations if pat.search(a.name)), key=lambda a: a.ts_us)
        gpu = sorted((a for a in trace.gpu_annotations if pat.search(a.name)), key=lambda a: a.ts_us)
        groups: list[tuple[str, list[Kernel]]] = []
        if host and trace.launches:
            # Per host thread, the annotations by start: a launch belongs to the last one that
            # started before it on its thread, if that one has not ended.
            by_thread: dict[int, list[int]] = defaultdict(list)
            for i, a in enumerate(host):
                by_thread[a.thread].append(i)
            starts = {t: [host[i].ts_us for i in idx] for t, idx in by_thread.items()}
            members: dict[int, list[Kernel]] = defaultdict(list)
            for k in kernels:
                launch = trace.launches.get(k.correlation) if k.correlation is not None else None
                if launch is None or launch.thread not in by_thread:
                    continue
                j = bisect.bisect_right(starts[launch.thread], launch.ts_us) - 1
                if j >= 0 and host[by_thread[launch.thread][j]].end_us >= launch.ts_us:
                    members[by_thread[launch.thread][j]].append(k)
            groups = [(host[i].name, members[i]) for i in sorted(members)]
        elif gpu:
            starts = [a.ts_us for a in gpu]
            members = defaultdict(list)
            for k in kernels:
                i = bisect.bisect_right(starts, k.ts_us) - 1
                if i >= 0 and gpu[i].end_us >= k.ts_us:
                    members[i].append(k)
            groups = [(gpu[i].name, members[i]) for i in sorted(members)]
        if groups:
            return groups, f"annotation /{pat.pattern}/"
    return None


def gap_threshold_us(kernels: list[Kernel]) -> float:
    gaps, end = [], None
    for k in kernels:
        if end is not None and k.ts_us > end:
            gaps.append(k.ts_us - end)
        end = k.end_us if end is None else max(end, k.end_us)
    return max(MIN_GAP_US, GAP_MEDIAN_FACTOR * statistics.median(gaps)) if gaps else MIN_GAP_US


def _gap_groups(kernels: list[Kernel], gap_us: float) -> list[list[Kernel]]:
    groups: list[list[Kernel]] = []
    end = None
    for k in kernels:
        if end is None or k.ts_us - end > gap_us:
            groups.append([])
        groups[-1].append(k)
        end = k.end_us if end is None else max(end, k.end_us)
    return groups


def _phase(annotation: str | None, replayed: bool) -> str:
    """Decode where the step is a graph replay (engines capture decode only) or says so."""
    text = (annotation or "").lower()
    if "prefill" in text or "extend" in text:
        return "prefill"
    if "decode" in text or replayed:
        return "decode"
    return "-"


def analyse_rank(trace: RankTrace, rank: int, size_hint: SizeHint, rule: str = "auto",
                 annotation: re.Pattern[str] | None = None, gap_us: float | None = None) -> RankResult:
    items = sorted(trace.kernels, key=lambda k: k.ts_us)
    kernels = [k for k in items if k.is_kernel]
    kinds: dict[str, Classification] = {}
    for k in kernels:
        if k.name not in kinds:
            kinds[k.name] = classify(k.name)

    groups: list[tuple[str | None, list[Kernel]]] = []
    used, detail = "", ""
    if rule in ("auto", "graph"):
        graph = _graph_groups(trace, items)
        if graph:
            groups = [(None, g) for g in graph]
            used, detail = "graph", "one CUDA-graph replay per step"
    if not groups and rule in ("auto", "annotation"):
        found = _annotation_groups(trace, items, annotation)
        if found:
            named, detail = found
            groups = [(name, g) for name, g in named]
            used = "annotation"
    if not groups and rule == "graph":
        raise UsageError(f"{trace.source}: no CUDA-graph replays in this trace (use --steps annotation or gap)")
    if not groups and rule == "annotation":
        wanted = annotation.pattern if annotation else " or ".join(p.pattern for p in DEFAULT_STEP_ANNOTATIONS)
        raise UsageError(f"{trace.source}: no step annotation matching {wanted} encloses a kernel's launch "
                         "(give --step-annotation REGEX, or use --steps gap)")
    if not groups and rule in ("auto", "gap"):
        threshold = gap_us if gap_us is not None else gap_threshold_us(items)
        groups = [(None, g) for g in _gap_groups(items, threshold)]
        used, detail = "gap", f"a new step after the GPU idles > {threshold:.0f} us"
    sizes = _SizeFinder(trace)

    def call_of(k: Kernel) -> Call:
        c = kinds[k.name]
        call = Call(k.name, c.library, c.floor_variants, c.note, k.ts_us, k.dur_us, k.stream, _replayed(trace, k),
                    op=c.op)
        recorded = sizes.size(k)
        if recorded is not None:
            call.message_bytes, call.size_from = recorded, "recorded"
        elif size_hint.message_bytes is not None:
            call.message_bytes, call.size_from, call.hidden = size_hint.message_bytes, size_hint.text, size_hint.hidden
        return call

    steps: list[Step] = []
    in_steps = 0
    for annotation_name, members in groups:
        members.sort(key=lambda k: k.ts_us)   # each group's list is its own: sorted where it is
        if not members:
            continue
        in_steps += len(members)
        replayed = all(_replayed(trace, k) for k in members)
        step = Step(rank, len(steps), _phase(annotation_name, replayed),
                    members[0].ts_us, max(k.end_us for k in members),
                    union_length([(k.ts_us, k.end_us) for k in members]), kernels=members)
        compute_by_stream: dict[int, list[tuple[float, float]]] = defaultdict(list)
        for k in members:
            if k.is_kernel and kinds[k.name].kind == "compute":
                compute_by_stream[k.stream].append((k.ts_us, k.end_us))
        for k in members:
            if not k.is_kernel:
                continue
            kind = kinds[k.name].kind
            if kind == "allreduce":
                call = call_of(k)
                others = _merged([iv for s, ivs in compute_by_stream.items() if s != k.stream for iv in ivs])
                call.overlap_us = _overlap(k.ts_us, k.end_us, others)
                step.calls.append(call)
            elif kind == "communication":
                step.other_comm.append(k)
        steps.append(step)
    outside = _outside(kernels, items, steps, in_steps)
    unclassified: dict[str, int] = defaultdict(int)
    for k in kernels:
        if kinds[k.name].kind == "communication":
            unclassified[k.name] += 1
    return RankResult(rank, trace.source, used, detail, steps, len(outside),
                      [call_of(k) for k in outside if kinds[k.name].kind == "allreduce"], dict(unclassified))


def _outside(kernels: list[Kernel], items: list[Kernel], steps: list[Step], in_steps: int) -> list[Kernel]:
    """The kernels in no step. Where the steps hold every kernel and copy (the gap rule always,
    a trace of graph replays alone), none, without a set of every kernel's id (~70 bytes a kernel
    at the peak of a large trace)."""
    if in_steps == len(items):
        return []
    in_step = {id(k) for step in steps for k in step.kernels}
    return [k for k in kernels if id(k) not in in_step]


def set_first_apart(results: list[RankResult]) -> str | None:
    """Takes the first step out of every rank's steps where, on any rank, it lasts over
    FIRST_STEP_FACTOR x the median of that rank's other steps; what was done, or None."""
    outliers = []
    for r in results:
        if len(r.steps) >= MIN_STEPS_FOR_APART:
            rest = statistics.median(s.wall_us for s in r.steps[1:])
            if r.steps[0].wall_us > FIRST_STEP_FACTOR * rest:
                outliers.append(f"rank {r.rank} {r.steps[0].wall_us:,.0f} us against a median of {rest:,.0f} us")
    if not outliers:
        return None
    for r in results:
        if r.steps:
            r.first_apart = r.steps.pop(0)
    return ("the first step is set apart (the profiler's start), not in the figures: " + "; ".join(outliers))
