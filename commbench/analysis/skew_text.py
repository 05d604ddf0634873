"""`commbench attribute`'s wait/transfer section as text and JSON (commbench.analysis.skew), and the
one-rank fallback: where wait cannot be separated, the calls' spread and the ones likely waiting."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import asdict, dataclass
from typing import Any

from commbench.analysis import render
from commbench.analysis.attribute_floor import FloorLine
from commbench.analysis.attribution import Call, RankResult
from commbench.analysis.render import fmt_us
from commbench.analysis.skew import LateRow, Matched, Skew, phase_splits
from commbench.files import LazyList
from commbench.results import percentile
from commbench.units import format_bytes

# A call lasting over this many times its floor is likely waiting for a late rank.
LIKELY_WAITING_FACTOR = 2.0
OWN_FLOOR_PERCENTILE = 10
RULE = (f"likely waiting = a call over {LIKELY_WAITING_FACTOR:g}x its floor: the run's floor row at that size "
        f"(--run), else the p{OWN_FLOOR_PERCENTILE} of the same kernel and size in this trace")


def _fill(text: str, wide: bool, indent: str = "  ") -> str:
    return render.fill(text, wide, indent)


def _cause_text(row: LateRow, notable_us: float) -> str:
    kind = max(row.causes, key=lambda k: row.causes[k])
    what = (f"it ran a median {row.extra_busy_p50_us:.1f} us more GPU work than the other ranks before them"
            if kind == "GPU work" else
            f"its GPU idled a median {row.extra_idle_p50_us:.1f} us longer than the other ranks' before them "
            "(host-side: its launches came late)")
    only = ", ".join(f"{name[:60]} x{n}" for name, n in sorted(row.kernels.items(), key=lambda kv: -kv[1])[:3])
    mixed = "" if len(row.causes) == 1 else " (" + ", ".join(f"{k}: {n}" for k, n in row.causes.items()) + ")"
    return (f"rank {row.rank} was late by >= {notable_us:.0f} us on {row.notable_calls} calls{mixed}: {what}"
            + (f"; only it ran: {only}" if only else ""))


def skew_text(skew: Skew, results: list[RankResult], wide: bool = False, brief: bool = False) -> list[str]:
    """The clock, the wait/transfer split per phase, the late-rank table and what the late ranks
    did; `brief` leaves out the explanations in parentheses."""
    if not skew.calls:
        return ["wait and transfer: no allreduce call in the ranks' steps to set side by side"]
    out = [_fill(skew.clock.text, wide)]
    if skew.clock.mode == "refused":
        return out
    if skew.world_size and len(skew.ranks) < skew.world_size:
        out.append(_fill(f"note: {len(skew.ranks)} of {skew.world_size} ranks given: the last arrival is the last "
                         "among those given (a missing rank may be later still)", wide))
    splits = phase_splits(results)
    out += ["", render.prose("waiting or moving: each call's wait for the last rank to arrive, and its transfer after "
                             "it", wide),
            render.table(["phase", "steps", "AR_us", "wait_us", "transfer_us", "wait share"],
                         [[p.phase, str(p.steps), fmt_us(p.allreduce_us), fmt_us(p.wait_us), fmt_us(p.transfer_us),
                           f"{100 * p.wait_share:.0f}%"] for p in splits], right=range(1, 6), wide=wide),
            render.prose("(per step, medians over the steps of every rank, each its own; AR = wait + transfer per "
                         "step)", wide), "",
            render.table(["rank", "last on", "calls", "late by p50_us", f"late >= {skew.notable_us:.0f} us"],
                         [[str(r.rank), f"{100 * r.last_share:.0f}%", str(r.last_calls), fmt_us(r.late_by_p50_us),
                           str(r.notable_calls)] for r in skew.late], right=range(1, 5), wide=wide),
            _fill(f"(late rank: the one whose kernel started last; last on = its share of the {len(skew.calls)} "
                  "matched calls; late by = how much later than the others it arrived: the others' mean wait)", wide)]
    if brief:
        out = [line for line in out if line and not line.startswith("(")]
    out += [_fill(_cause_text(r, skew.notable_us), wide) for r in skew.late if r.causes]
    return out


def skew_json(skew: Skew, results: list[RankResult]) -> dict[str, Any]:
    """The skew as --json writes it; every matched call made as it is written (LazyList)."""
    return {"clock": asdict(skew.clock), "notable_us": skew.notable_us, "late": [asdict(r) for r in skew.late],
            "phases": [asdict(p) for p in phase_splits(results)],
            "calls": LazyList(count=len(skew.calls), make=lambda: map(_call_json, skew.calls))}


def _call_json(m: Matched) -> dict[str, Any]:
    return {"step": m.step, "index": m.index, "phase": m.phase, "library": m.library,
            "message_bytes": m.message_bytes, "late_rank": m.late_rank, "wait_us": m.wait_us, "skew_us": m.skew_us,
            "transfer_us": m.transfer_us, "rank_wait_us": [c.wait_us for c in m.calls],
            "cause": asdict(m.cause) if m.cause else None}


@dataclass
class Spread:
    """One (library, size) of a trace whose ranks cannot be set side by side."""
    library: str
    message_bytes: int | None
    calls: int
    p10_us: float
    p50_us: float
    p90_us: float
    max_us: float
    floor_us: float
    floor_from: str                  # "run" | "trace p10"
    likely_waiting: int
    above_floor_us: float            # the likely-waiting calls' time over their floor, in all


def spreads(results: list[RankResult], floor: list[FloorLine]) -> list[Spread]:
    groups: dict[tuple[str, int | None], list[Call]] = defaultdict(list)
    for r in results:
        for s in r.steps:
            for c in s.calls:
                groups[(c.library, c.message_bytes)].append(c)
    floors = {(f.library, f.message_bytes): f.floor.latency_us for f in floor if f.floor is not None}
    out = []
    for (library, size), calls in sorted(groups.items(), key=lambda g: -len(g[1])):
        durations = sorted(c.dur_us for c in calls)
        run_floor = floors.get((library, size))
        floor_us = run_floor if run_floor is not None else percentile(durations, OWN_FLOOR_PERCENTILE)
        waiting = [d for d in durations if d > LIKELY_WAITING_FACTOR * floor_us]
        out.append(Spread(library, size, len(durations), percentile(durations, 10), percentile(durations, 50),
                          percentile(durations, 90), durations[-1], floor_us,
                          "run" if run_floor is not None else f"trace p{OWN_FLOOR_PERCENTILE}", len(waiting),
                          sum(d - floor_us for d in waiting)))
    return out


def spread_text(rows: list[Spread], why: str, steps: int, wide: bool = False) -> list[str]:
    out = [_fill(f"wait and transfer: {why}: a call's duration holds its wait for the last rank, which "
                 "cannot be separated here (give every rank's trace of the group)", wide)]
    if not rows:
        return out
    out.append(render.table(["library", "size", "calls", "p10_us", "p50_us", "p90_us", "max_us", "floor_us",
                             "likely waiting", "over floor/step"],
                            [[r.library, format_bytes(r.message_bytes) if r.message_bytes is not None else "unknown",
                              str(r.calls), fmt_us(r.p10_us), fmt_us(r.p50_us), fmt_us(r.p90_us), fmt_us(r.max_us),
                              fmt_us(r.floor_us), f"{r.likely_waiting} ({100 * r.likely_waiting / r.calls:.0f}%)",
                              fmt_us(r.above_floor_us / steps if steps else None)] for r in rows],
                            right=range(2, 10), wide=wide))
    out.append(_fill(f"({RULE}; over floor/step = their time above the floor per step)", wide, " "))
    return out
