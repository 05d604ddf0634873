"""Matplotlib figures for report and compare (Agg backend: no display needed).

Conventions every figure follows: message size on a log2 axis labelled 4K/1M/...; one colour
per backend variant, the same in every figure; CUDA-graph timings solid, eager dashed; the
p10-p90 band shaded; measurements that failed their check marked in red, one marker shape
per backend, named in the legend.
"""

from __future__ import annotations

import math
import textwrap
from pathlib import Path
from typing import Any, Iterable

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.axes import Axes  # noqa: E402
from matplotlib.collections import PathCollection  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402
from matplotlib.lines import Line2D  # noqa: E402
from matplotlib.ticker import FixedLocator, FuncFormatter, LogLocator, NullLocator  # noqa: E402

from commbench.analysis.curves import Curve, baseline_curve, counterpart  # noqa: E402
from commbench.files import naming  # noqa: E402
from commbench.results import Measurement  # noqa: E402
from commbench.units import format_bytes  # noqa: E402

FAILED_COLOR = "#d62728"
_PALETTE = [c for c in plt.get_cmap("tab10").colors if c != plt.get_cmap("tab10").colors[3]]  # red is for failures
_PALETTE += list(plt.get_cmap("Dark2").colors)


def colors_for(variants: Iterable[str]) -> dict[str, tuple]:
    return {v: _PALETTE[i % len(_PALETTE)] for i, v in enumerate(sorted(set(variants)))}


def _style(curve: Curve) -> str:
    return "-" if curve.key.mode == "graph" else "--"


def _size_axis(ax: Axes, sizes: Iterable[int]) -> None:
    sizes = sorted(set(sizes))
    ax.set_xscale("log", base=2)
    if sizes:
        lo, hi = int(math.log2(sizes[0])), int(math.ceil(math.log2(sizes[-1])))
        step = max(1, math.ceil((hi - lo + 1) / 10))
        ax.xaxis.set_major_locator(FixedLocator([2.0 ** e for e in range(lo, hi + 1, step)]))
    ax.xaxis.set_minor_locator(NullLocator())
    ax.xaxis.set_major_formatter(FuncFormatter(lambda x, _: format_bytes(int(round(x)))))
    ax.set_xlabel("message size (bytes each rank contributes)")
    ax.grid(True, which="major", alpha=0.3)


def _log_y(ax: Axes) -> None:
    """Log y axis with plain numbers at 1, 2, 5 of every decade (a few decades at most here)."""
    ax.set_yscale("log")
    plain = FuncFormatter(lambda y, _: f"{y:g}")
    ax.yaxis.set_major_locator(LogLocator(base=10))
    ax.yaxis.set_minor_locator(LogLocator(base=10, subs=(2.0, 5.0)))
    ax.yaxis.set_major_formatter(plain)
    ax.yaxis.set_minor_formatter(plain)
    ax.tick_params(axis="y", which="minor", labelsize=8)


_RATIO_TICKS = [1 / 16, 1 / 8, 1 / 4, 1 / 2, 2 / 3, 1, 1.5, 2, 3, 4, 6, 8, 12, 16, 24, 32, 64]


def _ratio_y(ax: Axes) -> None:
    ax.set_yscale("log", base=2)
    ax.yaxis.set_major_locator(FixedLocator(_RATIO_TICKS))
    ax.yaxis.set_minor_locator(NullLocator())
    ax.yaxis.set_major_formatter(FuncFormatter(lambda y, _: f"{y:.2g}x"))


# More entries than this do not fit beside a plot: its axes would shrink to nothing (a run with a
# hundred variants). The failed-check markers are always named; curves past the limit are counted.
LEGEND_ENTRIES_MAX = 24


def _legend(ax: Axes) -> None:
    handles, labels = ax.get_legend_handles_labels()
    if not handles:
        return
    if len(handles) > LEGEND_ENTRIES_MAX:
        entries = list(zip(handles, labels))
        failed = [e for e in entries if isinstance(e[0], PathCollection)]
        curves = [e for e in entries if not isinstance(e[0], PathCollection)]
        kept = curves[:max(0, LEGEND_ENTRIES_MAX - 1 - len(failed))]
        more = (Line2D([], [], linestyle="none"), f"and {len(curves) - len(kept)} more curves, not named here")
        handles, labels = (list(x) for x in zip(*(kept + [more] + failed)))
    ax.legend(handles, labels, loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, frameon=False)


def _new(title: str, height: float = 4.8) -> tuple[Figure, Axes]:
    fig, ax = plt.subplots(figsize=(10.5, height), layout="constrained")
    ax.set_title(title, fontsize=11)
    return fig, ax


# One red marker shape per backend whose rows failed their check, so the legend can say whose.
_FAILED_MARKERS = ("x", "+", "1", "*", "d", "s")
LEGEND_LABEL_CHARS = 40


def _failed_label(backend: str, rows: list[Measurement]) -> str:
    by_status: dict[str, list[Measurement]] = {}
    for row in sorted(rows, key=lambda r: r.message_bytes):
        by_status.setdefault(row.status, []).append(row)
    parts = [f"{status} at {', '.join(format_bytes(r.message_bytes) for r in group)}"
             + ("" if all(r.latency_us for r in group) else " (no latency: drawn at top)")
             for status, group in by_status.items()]
    # Wrapped: one long legend entry would squeeze this plot narrower than its neighbours.
    return textwrap.fill(f"{backend} failed: {'; '.join(parts)}", width=LEGEND_LABEL_CHARS)


def _mark_failed(ax: Axes, failed: list[Measurement]) -> None:
    """Red marks at the measured latency of wrong rows, hangs (no latency) along the top edge;
    whose they are is said in the legend, where no name can cover a curve or another name."""
    backends = sorted({r.backend for r in failed})
    for i, backend in enumerate(backends):
        rows = [r for r in failed if r.backend == backend]
        style = {"marker": _FAILED_MARKERS[i % len(_FAILED_MARKERS)], "s": 70, "color": FAILED_COLOR,
                 "linewidths": 2, "zorder": 5}
        label: str | None = _failed_label(backend, rows)
        measured = [r for r in rows if r.latency_us]
        hung = [r.message_bytes for r in rows if not r.latency_us]
        if measured:
            ax.scatter([r.message_bytes for r in measured], [r.latency_us for r in measured], label=label, **style)
            label = None
        if hung:
            ax.scatter(hung, [0.97] * len(hung), transform=ax.get_xaxis_transform(), clip_on=False, label=label,
                       **style)


# A curve of more measured sizes than this is drawn as a line alone: markers there are a smear,
# and drawing them is most of a large run's plotting time (SVG and PNG).
MARKED_POINTS_MAX = 100


def _markers(points: int) -> dict[str, Any]:
    return {"marker": "o", "markersize": 3} if points <= MARKED_POINTS_MAX else {}


def latency_figure(curves: list[Curve], failed: list[Measurement], title: str) -> Figure:
    fig, ax = _new(title)
    colors = colors_for(c.key.variant for c in curves)
    for curve in curves:
        xs = curve.sizes()
        color = colors[curve.key.variant]
        ax.plot(xs, [p.latency_us for p in curve.points], _style(curve), **_markers(len(xs)),
                color=color, label=curve.label)
        if all(p.p10_us is not None and p.p90_us is not None for p in curve.points):
            ax.fill_between(xs, [p.p10_us for p in curve.points], [p.p90_us for p in curve.points],
                            color=color, alpha=0.15, linewidth=0)
    _mark_failed(ax, failed)
    _log_y(ax)
    ax.set_ylabel("latency (us), band: jitter p10-p90")
    _size_axis(ax, [s for c in curves for s in c.sizes()] + [r.message_bytes for r in failed])
    _legend(ax)
    return fig


def busbw_figure(curves: list[Curve], title: str) -> Figure:
    fig, ax = _new(title)
    colors = colors_for(c.key.variant for c in curves)
    for curve in curves:
        pts = [p for p in curve.points if p.busbw_gbps]
        if pts:
            ax.plot([p.message_bytes for p in pts], [p.busbw_gbps for p in pts], _style(curve), **_markers(len(pts)),
                    color=colors[curve.key.variant], label=curve.label)
    _log_y(ax)
    ax.set_ylabel("bus bandwidth (GB/s, nccl-tests definition)")
    _size_axis(ax, [s for c in curves for s in c.sizes()])
    _legend(ax)
    return fig


def speedup_figure(curves: list[Curve], baseline: str, title: str) -> Figure:
    """baseline latency / variant latency at sizes both measured: above 1 means faster than the baseline."""
    fig, ax = _new(title)
    colors = colors_for(c.key.variant for c in curves)
    ax.axhline(1.0, color="black", linewidth=1)
    for curve in curves:
        base = baseline_curve(curves, baseline, curve)
        if base is None or base is curve:
            continue
        pairs = [(p.message_bytes, base.point(p.message_bytes)) for p in curve.points]
        pts = [(size, b.latency_us / curve.point(size).latency_us) for size, b in pairs if b is not None]  # type: ignore[union-attr]
        if pts:
            ax.plot([p[0] for p in pts], [p[1] for p in pts], _style(curve), **_markers(len(pts)),
                    color=colors[curve.key.variant], label=curve.label)
    _ratio_y(ax)
    ax.set_ylabel(f"speedup over {baseline} (same mode)")
    _size_axis(ax, [s for c in curves for s in c.sizes()])
    _legend(ax)
    return fig


def curve_name(curve: Curve) -> str:
    """A curve's label with its dtype, for figures and lists that hold several dtypes."""
    return f"{curve.label} {curve.key.dtype}" if curve.key.dtype else curve.label


def compare_figure(before: list[Curve], after: list[Curve], name_a: str, name_b: str, title: str) -> Figure:
    """Top: both runs' latency (A dashed and faint, B solid). Bottom: B/A per size."""
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(10.5, 7.2), sharex=True, layout="constrained",
                                      gridspec_kw={"height_ratios": [3, 2]})
    top.set_title(title, fontsize=11)
    # One colour per curve (eager and graph, bf16 and fp32 apart): the line style tells A from B.
    colors = colors_for(curve_name(c) for c in before + after)
    for curve in before:
        label = curve_name(curve)
        color = colors[label]
        top.plot(curve.sizes(), [p.latency_us for p in curve.points], "--", color=color, alpha=0.6,
                 label=f"{label} A")
        other = counterpart(curve, after, before)
        if other is None:
            continue
        top.plot(other.sizes(), [p.latency_us for p in other.points], "-", **_markers(len(other.points)), color=color,
                 label=f"{label} B")
        shared = [(s, curve.point(s), other.point(s)) for s in curve.sizes() if other.point(s) is not None]
        bottom.plot([s for s, _, _ in shared], [b.latency_us / a.latency_us for _, a, b in shared],  # type: ignore[union-attr]
                    "-", **_markers(len(shared)), color=color, label=label)
    _log_y(top)
    top.set_ylabel("latency (us)")
    _legend(top)
    top.grid(True, alpha=0.3)
    bottom.axhline(1.0, color="black", linewidth=1)
    _ratio_y(bottom)
    bottom.set_ylabel(f"latency B / A  (above 1: B slower)\nA = {name_a}, B = {name_b}", fontsize=8)
    _size_axis(bottom, [s for c in before + after for s in c.sizes()])
    return fig


def save(fig: Figure, stem: Path) -> list[Path]:
    """Write stem.png and stem.svg and free the figure."""
    paths = [stem.with_suffix(".png"), stem.with_suffix(".svg")]
    for path in paths:
        if path.is_symlink():   # replaced, never written through (a run dir may come from anyone)
            path.unlink()
    for path, dpi in zip(paths, (110, None)):
        with naming(path):
            fig.savefig(path, dpi=dpi)
    plt.close(fig)
    return paths
