"""`commbench attribute`: what does the engine pay for allreduce now?

Reads serving profiler traces (PyTorch/kineto Chrome traces as vLLM, SGLang and torch.profiler
write them, one per rank or merged; Nsight Systems sqlite exports), names the library of every
allreduce kernel, splits the trace into steps and measures the allreduce share of each; given
every rank of a group, splits each call into the wait for the last rank and the transfer
(commbench.analysis.skew); with --run, sets every call (its transfer, where known) against the
same library's floor measured on this box. No torch here.
"""

from __future__ import annotations

import argparse
import re
import statistics
from collections import Counter, defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from commbench import engines
from commbench.analysis import decide, provenance, render, results_out
from commbench.analysis.attribute_nccl import (HOW_TO_LOG, LogLine, NcclLog, has_nccl, log_lines, log_text,
                                                 read_nccl_logs)
from commbench.analysis.attribute_floor import FloorLine, floor_lines, floor_text
from commbench.analysis.attribution import RULES, RankResult, Step
from commbench.analysis.skew import CLOCK_MODES, Skew
from commbench.analysis.skew_text import Spread, skew_json, skew_text, spread_text, spreads
from commbench.analysis.render import fmt_us
from commbench.analysis.traces import analyse_traces, cross_rank, first_apart_text, size_hint, trace_provenance
from commbench.errors import UsageError
from commbench.files import LazyList
from commbench.ops import ALLREDUCE
from commbench.results import Run, percentile
from commbench.runs import load_run
from commbench.units import format_bytes, positive_finite

KERNEL_NAME_CHARS = 30


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("traces", nargs="+", type=Path, metavar="TRACE",
                        help="profiler traces: .json/.json.gz (one per rank or merged) or nsys .sqlite")
    parser.add_argument("--run", help="results dir of a sweep on the same box: price each call against its floor")
    parser.add_argument("--model", help="model preset: hidden size and dtype for calls without a recorded size")
    parser.add_argument("--hidden", type=int, help="hidden size, for calls without a recorded size")
    parser.add_argument("--batch", type=int, help="tokens per decode step (message = batch x hidden x dtype)")
    parser.add_argument("--dtype", default=None, help="activation dtype with --hidden: bf16 (default), fp16, fp32")
    parser.add_argument("--steps", choices=("auto", *RULES), default="auto",
                        help="how to split steps: auto = graph replays, else annotations, else gaps")
    parser.add_argument("--step-annotation", help="regex of the engine's step annotation (annotation rule)")
    parser.add_argument("--gap-us", type=float, help="gap rule: idle time that starts a new step (default: auto)")
    parser.add_argument("--engine", choices=tuple(engines.ENGINE_NAMES),
                        help="with --run: also price the fastest path this engine can take on that box")
    decide.add_engine_source_arguments(parser)
    parser.add_argument("--nccl-log", nargs="+", type=Path, metavar="FILE",
                        help="the engine's NCCL INFO log(s) (NCCL_DEBUG=INFO NCCL_DEBUG_SUBSYS=INIT,TUNING,COLL): "
                             "the algorithm/protocol NCCL ran at each size")
    parser.add_argument("--clock", choices=CLOCK_MODES, default="auto",
                        help="several ranks: shared = one host's clock; align = by the calls' end times; "
                             "auto = shared where the ends agree as recorded")
    parser.add_argument("--brief", action="store_true",
                        help="the answer only: provenance, wait and transfer, late ranks, the floor; no per-rank "
                             "rules, no step and kernel tables, no notes")
    parser.add_argument("--plot", type=Path, metavar="PNG",
                        help="several ranks: a plot per rank of wait and transfer over the calls of the median step")
    parser.add_argument("--json", metavar="FILE", help="also write the result as JSON ('-' for stdout: JSON alone)")
    results_out.add_arguments(parser)
    render.add_arguments(parser)


def run_provenance(run: Run) -> str:
    return provenance.describe(run)


def clip(text: str, chars: int) -> str:
    return text if len(text) <= chars else text[:chars - 3] + "..."


def short_name(name: str) -> str:
    """A kernel name without 'void', template arguments and parameters."""
    text = name[5:] if name.startswith("void ") else name
    text = text.replace("(anonymous namespace)", "{anon}")
    out, depth = [], 0
    for ch in text:
        if ch in "<(":
            if depth == 0:
                out.append("<>" if ch == "<" else "")
            depth += 1
        elif ch in ">)":
            depth = max(0, depth - 1)
        elif depth == 0:
            out.append(ch)
    short = "".join(out).strip()
    while len(short) > KERNEL_NAME_CHARS and "::" in short:   # namespaces go first
        short = short.split("::", 1)[1]
    return clip(short, KERNEL_NAME_CHARS)


@dataclass
class StepSummary:
    steps: int
    phase: str
    wall_us: float
    busy_us: float
    allreduce_calls: float
    allreduce_us: float
    call_p50_us: float | None
    call_p90_us: float | None
    share: float
    overlap_us: float


def summarise(steps: list[Step], phase: str) -> StepSummary | None:
    chosen = [s for s in steps if s.phase == phase]
    phase = "other" if phase == "-" else phase
    if not chosen:
        return None
    calls = sorted(c.dur_us for s in chosen for c in s.calls)

    def med(values: list[float]) -> float:
        return statistics.median(values)
    return StepSummary(len(chosen), phase, med([s.wall_us for s in chosen]), med([s.busy_us for s in chosen]),
                       med([len(s.calls) for s in chosen]), med([s.allreduce_us for s in chosen]),
                       percentile(calls, 50) if calls else None, percentile(calls, 90) if calls else None,
                       med([s.share for s in chosen]), med([s.overlap_us for s in chosen]))


@dataclass
class KernelRow:
    library: str
    kernel: str
    calls: int
    per_step: float
    sizes: list[int]
    size_from: str
    p50_us: float
    p90_us: float
    note: str


def kernel_rows(results: list[RankResult]) -> list[KernelRow]:
    steps = sum(len(r.steps) for r in results)
    by_name: dict[str, list[Any]] = defaultdict(list)
    for r in results:
        for s in r.steps:
            for c in s.calls:
                by_name[c.name].append(c)
    rows = []
    for name, calls in sorted(by_name.items(), key=lambda kv: -len(kv[1])):
        durations = sorted(c.dur_us for c in calls)
        rows.append(KernelRow(calls[0].library, name, len(calls), len(calls) / steps if steps else 0.0,
                              sorted({c.message_bytes for c in calls if c.message_bytes is not None}),
                              calls[0].size_from, percentile(durations, 50), percentile(durations, 90), calls[0].note))
    return rows


def main(args: argparse.Namespace, argv: Sequence[str] = ()) -> int:
    results_out.check_targets(args)
    if args.plot is not None and args.plot.suffix != ".png":
        raise UsageError(f"--plot {args.plot}: give a .png file name")
    found = compute(args)
    print("\n".join(text(found, args)))   # with --json -, to stderr (cli.py)
    results_out.write(args, found.result, "attribute")
    return 0


def details(results: list[RankResult], summaries: list[StepSummary], kernels: list[KernelRow],
            apart: str | None, wide: bool) -> list[str]:
    """The per-rank step rules, the step and kernel tables and their notes (left out by --brief)."""
    out = []
    for r in results:
        phases = ", ".join(f"{n} {p if p != '-' else 'other'}" for p, n in
                           sorted(Counter(s.phase for s in r.steps).items()))
        out.append(render.fill(f"rank {r.rank}: {r.rule} rule ({r.rule_detail}): {phases or 'no steps'}; "
                               f"{r.outside_kernels} kernels outside steps", wide))
    if apart:
        out.append(render.fill(apart, wide))
    out.append("")
    out.append(render.table(["phase", "steps", "wall_us", "busy_us", "ARs", "AR_us", "p50/call", "p90/call", "share",
                             "overlap_us"],
                            [[s.phase, str(s.steps), fmt_us(s.wall_us), fmt_us(s.busy_us), f"{s.allreduce_calls:g}",
                              fmt_us(s.allreduce_us), fmt_us(s.call_p50_us), fmt_us(s.call_p90_us),
                              f"{100 * s.share:.1f}%", fmt_us(s.overlap_us)] for s in summaries],
                            right=range(1, 10), wide=wide))
    out.append(render.fill("(medians over the steps of all ranks; share = allreduce time / step wall; overlap = "
                           "allreduce time beside compute on another stream; other = steps not told apart as decode "
                           "or prefill)", wide, " "))
    out.append("")
    if kernels:
        out.append(render.table(["library", "kernel", "calls", "/step", "size", "p50_us", "p90_us"],
                                [[k.library, short_name(k.kernel), str(k.calls), f"{k.per_step:.1f}",
                                  "/".join(format_bytes(b) for b in k.sizes) or "unknown", fmt_us(k.p50_us),
                                  fmt_us(k.p90_us)] for k in kernels], right=(2, 3, 5, 6), wide=wide))
        out += [render.fill(f"note: {note}", wide)
                for note in dict.fromkeys(f"{k.library}: {k.note}" for k in kernels if k.note)]
    else:
        out.append("no allreduce kernel in any step")
    outside = sum(len(r.outside_allreduce) for r in results)
    if outside:
        out.append(render.fill(f"{outside} allreduce kernels ran outside the steps (eager work or prefill between "
                               "replays)", wide))
    unclassified: Counter[str] = Counter()
    for r in results:
        for name, n in r.unclassified.items():
            unclassified[name] += n
    out += [render.fill(f"unclassified communication (counted neither as compute nor as allreduce): "
                        f"{short_name(name)} x{n}", wide)
            for name, n in sorted(unclassified.items(), key=lambda kv: -kv[1])]
    return out


@dataclass(frozen=True)
class Attributed:
    """The result, and the objects its text and plot are drawn from (the traces' steps and calls,
    the skew, NCCL's log: far more than the answer keeps)."""

    result: AttributeResult
    results: list[RankResult]
    skew: Skew | None
    nccl_log: NcclLog | None
    world: int


def compute(args: argparse.Namespace) -> Attributed:
    """Everything the command answers, before a line is printed."""
    hint = size_hint(args.model, args.hidden, args.batch, args.dtype)
    if args.gap_us is not None:
        positive_finite(args.gap_us, "--gap-us", "us")
    try:
        annotation = re.compile(args.step_annotation) if args.step_annotation else None
    except re.error as exc:
        raise UsageError(f"--step-annotation: not a regular expression ({exc})") from None
    if args.engine and not args.run:
        raise UsageError("--engine prices the engine's fastest path from a sweep of the box: give --run too")
    sources = decide.engine_sources(args)
    run = load_run(args.run) if args.run else None
    nccl_log = read_nccl_logs(args.nccl_log) if args.nccl_log else None
    ranks, results = analyse_traces(args.traces, hint, args.steps, annotation, args.gap_us)
    skew = cross_rank(args.traces, ranks, results, args.clock)
    steps = [s for r in results for s in r.steps]
    world = ranks[0][1].world_size or len(ranks)
    summaries = [s for s in (summarise(steps, p) for p in ("decode", "prefill", "-")) if s]
    logged = log_lines(nccl_log, results, world) if nccl_log is not None else []
    floor = (floor_lines(run, ranks, results, args.dtype, args.batch, engine=args.engine, sources=sources)
             if run is not None else [])
    spread = (spreads(results, floor) if (skew is None and world > 1)
              or (skew is not None and skew.clock.mode == "refused") else None)
    result = AttributeResult(
        trace_provenance(ranks), run_provenance(run) if run else None,
        tuple({"rank": r.rank, "source": r.source, "rule": r.rule, "rule_detail": r.rule_detail,
               "outside_kernels": r.outside_kernels, "outside_allreduce": len(r.outside_allreduce),
               "first_apart": step_json(r.first_apart) if r.first_apart else None,
               "unclassified": r.unclassified,
               # every step and call, made as --json writes them (never held as dicts)
               "steps": LazyList(count=len(r.steps), make=lambda r=r: map(step_json, r.steps))}
              for r in results),
        tuple(summaries), tuple(kernel_rows(results)), tuple(floor),
        None if nccl_log is None else NcclLogResult(tuple(nccl_log.files), tuple(logged)),
        first_apart_text(results), skew_json(skew, results) if skew else None,
        tuple(spread) if spread is not None else None)
    return Attributed(result, results, skew, nccl_log, world)


def text(found: Attributed, args: argparse.Namespace) -> list[str]:
    """The answer's lines; --plot is drawn where its line goes."""
    result, results, skew = found.result, found.results, found.skew
    out = [render.fill(result.trace, args.wide)]
    if result.run is not None:
        out.append(render.fill(result.run, args.wide))
    if not args.brief:
        out += details(results, list(result.summary), list(result.kernels), result.first_apart, args.wide)
    if found.nccl_log is not None and result.nccl_log is not None:
        out.append("")
        out += [render.prose(line.lstrip(), args.wide, indent="    " if line.startswith("  ") else "  ",
                             first=line[:len(line) - len(line.lstrip())])
                for line in log_text(found.nccl_log, list(result.nccl_log.lines))]
    elif found.world > 1 and has_nccl(results):   # at world size 1 NCCL chooses no algorithm
        out.append(render.fill(f"note: NCCL's log tells the protocol: run the engine with {HOW_TO_LOG} and give "
                               "its log as --nccl-log", args.wide))
    out.append("")
    if skew is not None:
        out += skew_text(skew, results, args.wide, args.brief)
    if result.likely_waiting is not None:
        why = "one rank's trace" if skew is None else "the ranks' clocks could not be aligned"
        steps = sum(len(r.steps) for r in results)
        out += spread_text(list(result.likely_waiting), why, steps // len(results), args.wide)
    if args.plot is not None and result.likely_waiting is None and skew is not None:
        from commbench.analysis.skew_plots import save_skew_plot   # matplotlib only when asked
        out.append(save_skew_plot(skew, results, args.plot))
    elif args.plot is not None:
        out.append(f"plot: none written to {args.plot}: wait and transfer need every rank's trace on one clock")
    if result.run is not None:
        out.append("")
        out.append(floor_text(list(result.floor), args.wide, args.brief))
        plain = [f for f in result.floor if f.op == ALLREDUCE]   # a fused call is offered no bare allreduce
        if args.engine and plain and not any(f.alternative for f in plain):
            out.append(render.fill(f"what {engines.ENGINE_NAMES[args.engine]} could take instead: no path it can "
                                   "take on this box was measured in the run at these sizes (its own kernels or a "
                                   "library it runs; a stand-in is no price; recommend on this run says why per "
                                   "path)", args.wide))
    return out


@dataclass(frozen=True)
class NcclLogResult:
    files: tuple[str, ...]
    lines: tuple[LogLine, ...]       # per (library, size) of the trace: what the log shows NCCL chose


@dataclass(frozen=True)
class AttributeResult:
    """What `attribute` answers; its --json is dataclasses.asdict of this (docs/results.md). A
    rank's steps (every call of every step) and the skew are kept as the records they are
    written as: their objects hold the trace's kernels, far more than the answer."""

    trace: str
    run: str | None
    ranks: tuple[dict[str, Any], ...]
    summary: tuple[StepSummary, ...]
    kernels: tuple[KernelRow, ...]
    floor: tuple[FloorLine, ...]
    nccl_log: NcclLogResult | None
    first_apart: str | None
    skew: dict[str, Any] | None
    likely_waiting: tuple[Spread, ...] | None


def step_json(s: Step) -> dict[str, Any]:
    return {"index": s.index, "phase": s.phase, "start_us": s.start_us, "wall_us": s.wall_us, "busy_us": s.busy_us,
            "allreduce_calls": len(s.calls), "allreduce_us": s.allreduce_us, "share": s.share,
            "call_p50_us": s.call_percentile(50), "call_p90_us": s.call_percentile(90), "overlap_us": s.overlap_us,
            "unclassified_calls": len(s.other_comm),
            "calls": [{"library": c.library, "kernel": c.name, "ts_us": c.ts_us, "dur_us": c.dur_us,
                       "message_bytes": c.message_bytes, "size_from": c.size_from, "overlap_us": c.overlap_us,
                       "wait_us": c.wait_us}
                      for c in s.calls]}
