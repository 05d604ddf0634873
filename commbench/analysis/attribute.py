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
import textwrap
from collections import Counter, defaultdict
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Sequence

from commbench import engines
from commbench.engines import log as engine_log
from commbench import models
from commbench.analysis import decide, fastest, provenance, render
from commbench.analysis.attribute_nccl import HOW_TO_LOG, LogLine, has_nccl, log_lines, log_text, read_nccl_logs
from commbench.analysis.attribute_floor import Alternative, FloorLine, Priced, against_floor
from commbench.analysis.attribution import RULES, RankResult, SizeHint, Step, analyse_rank, set_first_apart
from commbench.analysis.skew import CLOCK_MODES, Skew, split
from commbench.analysis.skew_text import skew_json, skew_text, spread_text, spreads
from commbench.analysis.curves import Curve, decode_curves
from commbench.analysis.render import fmt_us
from commbench.analysis.trace_read import RankTrace, read_trace
from commbench.errors import UsageError
from commbench.files import check_file_target, write_json
from commbench.results import Run, percentile
from commbench.runs import load_run
from commbench.units import DTYPE_BYTES, dtype_name, format_bytes, positive_finite, shape_bytes

SGLANG_RANK = re.compile(r"-TP-(\d+)")
KERNEL_NAME_CHARS = 30
WIDTH = 100


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
    render.add_arguments(parser)


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
        return SizeHint(message_bytes, f"{batch} x {hidden} x {act}")
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


def floor_lines(run: Run, ranks: list[tuple[int, RankTrace]], results: list[RankResult], dtype: str | None,
                batch: int | None, alternative: Alternative | None = None,
                engine: str | None = None, chain: engine_log.Chain | None = None) -> list[FloorLine]:
    """The decode steps' calls (all steps where none is told to be decode) against the run;
    `alternative` (attribute_floor.Alternative), or `engine`'s fastest path on the run's box
    (engine_alternative), adds what the engine could take instead."""
    world = ranks[0][1].world_size or len(ranks)
    dtype_text = dtype_name(dtype) if dtype else "bf16"
    curves = decode_curves(run, world, dtype_text, "auto")
    if alternative is None and engine is not None:
        alternative = engine_alternative(engine, run, world, dtype_text, chain)
    steps = [s for r in results for s in r.steps]
    decode = [s for s in steps if s.phase == "decode"] or steps
    return against_floor(decode, curves, batch, alternative, lambda curve: fastest.whose(run, curve))


def engine_alternative(engine: str, run: Run, world_size: int, dtype: str,
                       chain: engine_log.Chain | None = None) -> Alternative:
    """recommend's choice at one size: the fastest path `engine` can take on the run's box, priced
    by the engine's own kernel or a library it runs (a stand-in for a kernel is no price)."""
    def choose(curves: list[Curve], message_bytes: int) -> Curve | None:
        _, price = decide.best_path_at(engine, run, curves, world_size, dtype, message_bytes, chain)
        if price is None or price.stand_in:
            return None
        return next((c for c in curves if c.label == price.curve), None)
    return choose


def trace_provenance(ranks: list[tuple[int, RankTrace]]) -> str:
    first = ranks[0][1]
    what = first.provenance or "a profiler trace as given"
    world = first.world_size
    device = f", {first.device_name}" if first.device_name else ""
    numbers = ", ".join(str(r) for r, _ in ranks)
    of_world = f" of world size {world}" if world else ""
    return f"trace: {what}; rank(s) {numbers}{of_world}; {first.trace_format} format{device}"


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
    check_file_target(args.json, "--json")
    if args.plot is not None and args.plot.suffix != ".png":
        raise UsageError(f"--plot {args.plot}: give a .png file name")
    write_json(args.json, _attribute(args))   # with --json -, the text goes to stderr (cli.py)
    return 0


def print_details(results: list[RankResult], summaries: list[StepSummary], kernels: list[KernelRow],
                  apart: str | None, wide: bool) -> None:
    """The per-rank step rules, the step and kernel tables and their notes (left out by --brief)."""
    for r in results:
        phases = ", ".join(f"{n} {p if p != '-' else 'other'}" for p, n in
                           sorted(Counter(s.phase for s in r.steps).items()))
        print(textwrap.fill(f"rank {r.rank}: {r.rule} rule ({r.rule_detail}): {phases or 'no steps'}; "
                            f"{r.outside_kernels} kernels outside steps", WIDTH, subsequent_indent="  "))
    if apart:
        print(textwrap.fill(apart, WIDTH, subsequent_indent="  "))
    print()
    print(render.table(["phase", "steps", "wall_us", "busy_us", "ARs", "AR_us", "p50/call", "p90/call", "share",
                  "overlap_us"],
                 [[s.phase, str(s.steps), fmt_us(s.wall_us), fmt_us(s.busy_us), f"{s.allreduce_calls:g}",
                   fmt_us(s.allreduce_us), fmt_us(s.call_p50_us), fmt_us(s.call_p90_us), f"{100 * s.share:.1f}%",
                   fmt_us(s.overlap_us)] for s in summaries], right=range(1, 10), wide=wide, width=WIDTH))
    print("(medians over the steps of all ranks; share = allreduce time / step wall; overlap = allreduce\n"
          " time beside compute on another stream; other = steps not told apart as decode or prefill)")
    print()
    if kernels:
        print(render.table(["library", "kernel", "calls", "/step", "size", "p50_us", "p90_us"],
                     [[k.library, short_name(k.kernel), str(k.calls), f"{k.per_step:.1f}",
                       "/".join(format_bytes(b) for b in k.sizes) or "unknown", fmt_us(k.p50_us), fmt_us(k.p90_us)]
                      for k in kernels], right=(2, 3, 5, 6), wide=wide, width=WIDTH))
        for note in dict.fromkeys(f"{k.library}: {k.note}" for k in kernels if k.note):
            print(textwrap.fill(f"note: {note}", WIDTH, subsequent_indent="  "))
    else:
        print("no allreduce kernel in any step")
    outside = sum(len(r.outside_allreduce) for r in results)
    if outside:
        print(f"{outside} allreduce kernels ran outside the steps (eager work or prefill between replays)")
    unclassified: Counter[str] = Counter()
    for r in results:
        for name, n in r.unclassified.items():
            unclassified[name] += n
    for name, n in sorted(unclassified.items(), key=lambda kv: -kv[1]):
        print(textwrap.fill(f"unclassified communication (counted neither as compute nor as allreduce): "
                            f"{short_name(name)} x{n}", WIDTH, subsequent_indent="  "))


def _attribute(args: argparse.Namespace) -> dict[str, Any]:
    """Prints the text and returns the JSON payload."""
    hint = size_hint(args.model, args.hidden, args.batch, args.dtype)
    if args.gap_us is not None:
        positive_finite(args.gap_us, "--gap-us", "us")
    try:
        annotation = re.compile(args.step_annotation) if args.step_annotation else None
    except re.error as exc:
        raise UsageError(f"--step-annotation: not a regular expression ({exc})") from None
    if args.engine and not args.run:
        raise UsageError("--engine prices the engine's fastest path from a sweep of the box: give --run too")
    chains = decide.engine_chains(args)
    run = load_run(args.run) if args.run else None
    nccl_log = read_nccl_logs(args.nccl_log) if args.nccl_log else None
    ranks, results = analyse_traces(args.traces, hint, args.steps, annotation, args.gap_us)
    skew = cross_rank(args.traces, ranks, results, args.clock)
    steps = [s for r in results for s in r.steps]
    world = ranks[0][1].world_size or len(ranks)

    print(textwrap.fill(trace_provenance(ranks), WIDTH, subsequent_indent="  "))
    if run is not None:
        print(textwrap.fill(run_provenance(run), WIDTH, subsequent_indent="  "))
    apart = first_apart_text(results)
    summaries = [s for s in (summarise(steps, p) for p in ("decode", "prefill", "-")) if s]
    kernels = kernel_rows(results)
    if not args.brief:
        print_details(results, summaries, kernels, apart, args.wide)

    logged: list[LogLine] = []
    if nccl_log is not None:
        logged = log_lines(nccl_log, results, world)
        print()
        for line in log_text(nccl_log, logged):
            print(textwrap.fill(line, WIDTH, subsequent_indent="    " if line.startswith("  ") else "  ",
                                break_on_hyphens=False))
    elif world > 1 and has_nccl(results):   # at world size 1 NCCL chooses no algorithm
        print(textwrap.fill(f"note: NCCL's log tells the protocol: run the engine with {HOW_TO_LOG} and give its "
                            "log as --nccl-log", WIDTH, subsequent_indent="  "))

    floor: list[FloorLine] = []
    if run is not None:
        floor = floor_lines(run, ranks, results, args.dtype, args.batch, engine=args.engine,
                            chain=chains.get(args.engine or ""))
    print()
    spread = None
    if skew is not None:
        print("\n".join(skew_text(skew, results, args.wide, args.brief)))
    if (skew is None and world > 1) or (skew is not None and skew.clock.mode == "refused"):
        spread = spreads(results, floor)
        why = "one rank's trace" if skew is None else "the ranks' clocks could not be aligned"
        print("\n".join(spread_text(spread, why, len(steps) // len(results), args.wide)))
    if args.plot is not None and spread is None and skew is not None:
        from commbench.analysis.skew_plots import save_skew_plot   # matplotlib only when asked
        print(save_skew_plot(skew, results, args.plot))
    elif args.plot is not None:
        print(f"plot: none written to {args.plot}: wait and transfer need every rank's trace on one clock")
    if run is not None:
        print()
        print(floor_text(floor, args.wide, args.brief))
        if args.engine and floor and not any(f.alternative for f in floor):
            print(textwrap.fill(f"what {engines.ENGINE_NAMES[args.engine]} could take instead: no path it can take "
                                "on this box was measured in the run at these sizes (its own kernels or a library "
                                "it runs; a stand-in is no price; `commbench recommend` says why per path)",
                                WIDTH, subsequent_indent="  "))
    return {
        "trace": trace_provenance(ranks), "run": run_provenance(run) if run else None,
        "ranks": [{"rank": r.rank, "source": r.source, "rule": r.rule, "rule_detail": r.rule_detail,
                   "outside_kernels": r.outside_kernels, "outside_allreduce": len(r.outside_allreduce),
                   "first_apart": step_json(r.first_apart) if r.first_apart else None,
                   "unclassified": r.unclassified,
                   "steps": [step_json(s) for s in r.steps]} for r in results],
        "summary": [asdict(s) for s in summaries], "kernels": [asdict(k) for k in kernels],
        "floor": [asdict(f) for f in floor],
        "nccl_log": None if nccl_log is None else {"files": nccl_log.files, "lines": [asdict(x) for x in logged]},
        "first_apart": apart, "skew": skew_json(skew, results) if skew else None,
        "likely_waiting": [asdict(x) for x in spread] if spread is not None else None}


def step_json(s: Step) -> dict[str, Any]:
    return {"index": s.index, "phase": s.phase, "start_us": s.start_us, "wall_us": s.wall_us, "busy_us": s.busy_us,
            "allreduce_calls": len(s.calls), "allreduce_us": s.allreduce_us, "share": s.share,
            "call_p50_us": s.call_percentile(50), "call_p90_us": s.call_percentile(90), "overlap_us": s.overlap_us,
            "unclassified_calls": len(s.other_comm),
            "calls": [{"library": c.library, "kernel": c.name, "ts_us": c.ts_us, "dur_us": c.dur_us,
                       "message_bytes": c.message_bytes, "size_from": c.size_from, "overlap_us": c.overlap_us,
                       "wait_us": c.wait_us}
                      for c in s.calls]}


def _priced_cells(f: FloorLine, p: Priced, size: str) -> list[str]:
    engine_us = f.engine_p50_us if f.transfer_p50_us is None else f.transfer_p50_us
    return [f.library, size, f"{f.calls_per_step:g}", fmt_us(engine_us), fmt_us(p.latency_us),
            f"{p.saving_per_call_us:+.1f}", f"{p.saving_per_step_us:+.0f}",
            "-" if p.saving_per_token_us is None else f"{p.saving_per_token_us:+.1f}", f"{100 * p.share_of_step:+.1f}%"]


def _priced_table(lines: list[FloorLine], which: str, head: str, word: str, wide: bool) -> list[str]:
    rows = [_priced_cells(f, getattr(f, which), format_bytes(f.message_bytes or 0))
            for f in lines if getattr(f, which) is not None]
    if not rows:
        return []
    out = [render.table(["library", "size", "/step", "engine_us", head, "d/call", "d/step_us", "d/token_us",
                         "of step"], rows, right=range(1, 9), wide=wide, width=WIDTH)]
    for f in lines:
        p = getattr(f, which)
        if p is not None:
            out.append(textwrap.fill(f"{f.library} at {format_bytes(f.message_bytes or 0)}: {word} {p.variant} "
                                     f"({p.source}); size from {f.size_from}", WIDTH,
                                     initial_indent="  ", subsequent_indent="    "))
    return out


def floor_text(lines: list[FloorLine], wide: bool = False, brief: bool = False) -> str:
    if not lines:
        return "against the floor: no allreduce calls in the steps"
    out = ["against the floor: the same library's fastest trusted rows in the run at that size"]
    if not brief:
        out[0] += "\n(d = engine minus floor: + = the engine pays more; of step = d/step over the median step wall)"
    if not brief and any(f.transfer_p50_us is not None for f in lines):
        out[0] += ("\n(engine_us = the calls' median transfer: with every rank's trace the wait for the last "
                   "rank is\n taken out)")
    out += _priced_table(lines, "floor", "floor_us", "floor row", wide)
    for f in lines:
        if f.floor is None:
            size = format_bytes(f.message_bytes) if f.message_bytes is not None else "unknown"
            out.append(textwrap.fill(f"no floor: {f.library} at {size}: {f.why_no_floor}", WIDTH,
                                     subsequent_indent="  "))
    for f in lines:
        if f.transfer_p50_us is not None and f.wait_per_step_us is not None:
            size = format_bytes(f.message_bytes) if f.message_bytes is not None else "unknown"
            within = (f"within {f.floor.saving_per_call_us:+.1f} us of the floor" if f.floor is not None
                      else f"{fmt_us(f.transfer_p50_us)} us (no floor: {f.why_no_floor})")
            out.append(textwrap.fill(f"{f.library} at {size}: the kernel itself is {within}; {f.wait_per_step_us:.1f} "
                                     f"us per step is skew (the wait for the last rank; calls last "
                                     f"{fmt_us(f.engine_p50_us)} us at the median)", WIDTH, subsequent_indent="  "))
    alternatives = _priced_table(lines, "alternative", "instead_us", "instead:", wide)
    if alternatives:
        out += ["", "what the engine could take instead, measured in the same run (d = engine minus that path)",
                *alternatives]
    fastest_rows = _priced_table(lines, "fastest", "fastest_us", "fastest:", wide)
    if fastest_rows:
        out += ["", "the fastest kernel measured in the same run at that size, any backend (d = engine minus it)",
                *fastest_rows]
        whose = {f.fastest.variant: f.fastest_whose for f in lines if f.fastest is not None and f.fastest_whose}
        out += [textwrap.fill(f"{variant}: {who}", WIDTH, initial_indent="  ", subsequent_indent="    ")
                for variant, who in whose.items()]
    return "\n".join(out)
