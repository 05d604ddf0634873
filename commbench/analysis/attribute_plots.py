"""The `report` section for serving traces (`commbench report RUN --trace TRACE ...`): a timeline
of one representative step with the allreduce kernels highlighted, per-call bars of the
engine's median against the run's floor for the same library and size, and, given every rank,
each rank's wait and transfer over the calls of the median step (also `attribute --plot`)."""

from __future__ import annotations

import argparse
import html
import statistics
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402

from commbench.analysis import traces  # noqa: E402
from commbench.analysis.attribute_floor import FloorLine, floor_lines, floor_text  # noqa: E402
from commbench.analysis.attribution import Step  # noqa: E402
from commbench.analysis.plots import FAILED_COLOR, save  # noqa: E402
from commbench.analysis.skew_plots import median_step, skew_figure  # noqa: E402
from commbench.analysis.skew_text import skew_text  # noqa: E402
from commbench.analysis.trace_kernels import classify  # noqa: E402
from commbench.results import Run  # noqa: E402
from commbench.units import format_bytes  # noqa: E402

ALLREDUCE_COLOR = FAILED_COLOR
COMMUNICATION_COLOR = "#ff7f0e"
COMPUTE_COLOR = "#9e9e9e"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("serving trace (a section of its own; see commbench attribute)")
    group.add_argument("--trace", type=Path, action="append", default=None,
                       help="profiler trace(s) of an engine on this box (repeatable: one per rank)")
    group.add_argument("--trace-hidden", type=int, help="hidden size, for calls whose trace recorded no size")
    group.add_argument("--trace-batch", type=int, help="tokens per decode step, with --trace-hidden")


def representative(steps: list[Step]) -> Step | None:
    """The decode step (else any step) of the first rank whose wall is the median."""
    pool = [s for s in steps if s.phase == "decode"] or steps
    if not pool:
        return None
    pool = [s for s in pool if s.rank == pool[0].rank]
    median = statistics.median_low([s.wall_us for s in pool])
    return next(s for s in pool if s.wall_us == median)


def timeline_figure(step: Step, title: str) -> Figure:
    streams = sorted({k.stream for k in step.kernels})
    fig, ax = plt.subplots(figsize=(10, 1.6 + 0.5 * len(streams)))
    for row, stream in enumerate(streams):
        for k in (k for k in step.kernels if k.stream == stream):
            kind = classify(k.name).kind if k.is_kernel else "compute"
            color = {"allreduce": ALLREDUCE_COLOR, "communication": COMMUNICATION_COLOR}.get(kind, COMPUTE_COLOR)
            ax.broken_barh([(k.ts_us - step.start_us, k.dur_us)], (row - 0.4, 0.8), color=color)
    ax.set_yticks(range(len(streams)), [f"stream {s}" for s in streams])
    ax.set_xlabel("us from the step's first kernel")
    ax.set_title(title, fontsize=9)
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in (ALLREDUCE_COLOR, COMMUNICATION_COLOR, COMPUTE_COLOR)]
    ax.legend(handles, ["allreduce", "unclassified communication", "other kernels"], fontsize=8, ncol=3,
              loc="lower center", bbox_to_anchor=(0.5, 1.08), frameon=False)
    fig.tight_layout()
    return fig


def floor_figure(lines: list[FloorLine], title: str) -> Figure | None:
    priced = [f for f in lines if f.floor is not None]
    if not priced:
        return None
    fig, ax = plt.subplots(figsize=(8, 1.5 + 0.6 * len(priced)))
    labels = [f"{f.library[:40]}\n{format_bytes(f.message_bytes or 0)}" for f in priced]
    y = range(len(priced))
    ax.barh([i + 0.2 for i in y], [f.engine_p50_us for f in priced], height=0.4, color=ALLREDUCE_COLOR,
            label="engine, median call")
    ax.barh([i - 0.2 for i in y], [f.floor.latency_us for f in priced], height=0.4,  # type: ignore[union-attr]
            color="#1f77b4", label="floor: the run's fastest row of the same library")
    ax.set_yticks(list(y), labels, fontsize=8)
    ax.set_xlabel("us per call")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def report_section(args: argparse.Namespace, run: Run, plot_dir: Path) -> tuple[str, list[tuple[Path, str]]]:
    """HTML for the section and its plots (png, alt text); empty when no --trace was given."""
    if not args.trace:
        return "", []
    hint = traces.size_hint(None, args.trace_hidden, args.trace_batch, None)
    ranks, results = traces.analyse_traces(args.trace, hint)
    skew = traces.cross_rank(args.trace, ranks, results)
    steps = [s for r in results for s in r.steps]
    lines = floor_lines(run, ranks, results, None, args.trace_batch)
    images: list[tuple[Path, str]] = []
    parts = ["<h2>Serving trace: what the engine pays for allreduce</h2>",
             f"<p><b>{html.escape(traces.trace_provenance(ranks))}</b></p>",
             "<p class='note'>" + html.escape("; ".join(f"rank {r.rank}: {r.rule} rule ({r.rule_detail}), "
                                                     f"{len(r.steps)} steps" for r in results)) + "</p>",
             f"<pre>{html.escape(floor_text(lines))}</pre>"]
    if skew is not None:
        parts.append(f"<pre>{html.escape(chr(10).join(skew_text(skew, results)))}</pre>")
    step = representative(steps)
    if step is not None:
        title = (f"rank {step.rank}, step {step.index} ({step.phase}): {len(step.calls)} allreduce calls, "
                 f"{100 * step.share:.1f}% of {step.wall_us:.0f} us")
        images.append((save(timeline_figure(step, title), plot_dir / "trace_timeline")[0], "one step's timeline"))
    position = median_step(skew, results) if skew is not None and skew.clock.mode != "refused" else None
    if skew is not None and position is not None:
        images.append((save(skew_figure(skew, results, position), plot_dir / "trace_skew")[0],
                       "wait and transfer per rank"))
    fig = floor_figure(lines, "engine calls against the floor measured in this run")
    if fig is not None:
        images.append((save(fig, plot_dir / "trace_floor")[0], "calls against the floor"))
    return "\n".join(parts), images
