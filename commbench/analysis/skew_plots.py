"""Each rank's wait and transfer over the calls of one step (`attribute --plot`, `report --trace`):
the picture of a late rank, one row of bars per rank."""

from __future__ import annotations

import statistics
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402

from commbench.analysis.attribution import RankResult  # noqa: E402
from commbench.analysis.skew import Skew  # noqa: E402
from commbench.errors import UsageError  # noqa: E402

WAIT_COLOR = "#ff7f0e"
TRANSFER_COLOR = "#1f77b4"


def median_step(skew: Skew, results: list[RankResult]) -> int | None:
    """The position of the step (decode where there is one) whose allreduce time on the first
    rank is the median."""
    steps = results[0].steps
    pool = [i for i, s in enumerate(steps) if s.phase == "decode" and s.calls] or [i for i, s in enumerate(steps)
                                                                                    if s.calls]
    if not pool:
        return None
    target = statistics.median_low([steps[i].allreduce_us for i in pool])
    return next(i for i in pool if steps[i].allreduce_us == target)


def skew_figure(skew: Skew, results: list[RankResult], position: int) -> Figure:
    calls = [m for m in skew.calls if m.step == position]
    fig, axes = plt.subplots(len(skew.ranks), 1, figsize=(10, 1.2 + 1.3 * len(skew.ranks)), sharex=True,
                             sharey=True, squeeze=False)
    x = range(len(calls))
    for k, (rank, ax) in enumerate(zip(skew.ranks, axes[:, 0])):
        waits = [m.calls[k].wait_us or 0.0 for m in calls]
        transfers = [m.calls[k].transfer_us for m in calls]
        ax.bar(x, waits, color=WAIT_COLOR, label="wait for the last rank")
        ax.bar(x, transfers, bottom=waits, color=TRANSFER_COLOR, label="transfer")
        for i, m in enumerate(calls):
            if m.late_rank == rank and m.cause is not None:
                ax.annotate("late", (i, transfers[i]), ha="center", va="bottom", fontsize=7)
        ax.set_ylabel(f"rank {rank}\nus", fontsize=8)
    axes[-1, 0].set_xlabel("allreduce calls of the step, in order")
    axes[-1, 0].set_xticks(list(x))
    step = results[0].steps[position]
    axes[0, 0].set_title(f"wait and transfer per rank: step {step.index} ({step.phase}), {len(calls)} calls; "
                         "'late' marks the late rank of a notably late call", fontsize=9)
    axes[0, 0].legend(fontsize=8, loc="upper right")
    fig.tight_layout()
    return fig


def save_skew_plot(skew: Skew, results: list[RankResult], path: Path) -> str:
    position = median_step(skew, results)
    if position is None:
        return "plot: no step with allreduce calls to draw"
    fig = skew_figure(skew, results, position)
    try:
        fig.savefig(path, dpi=110)
    except OSError as exc:
        raise UsageError(f"--plot {path}: cannot write ({exc.strerror})") from None
    finally:
        plt.close(fig)
    return f"plot: {path} (wait and transfer per rank over the calls of the median step)"
