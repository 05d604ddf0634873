"""A trace's allreduce calls against the floor measured on the same box (`attribute --run`).

Per library and message size: the engine's median call, the same library's fastest trusted
variant in the run at that size (the kernel's owner names which variants are its floor:
TRACE_KERNELS' third field), and the saving per call, per step, per token and as a share of
the step were the calls at that floor. What the engine could run instead is a second,
optional comparison: `against_floor(..., alternative=...)` takes a function that, given the
run's curves and a message size, returns the curve of the path the engine could take there
(the engine-aware choice); without one, only the library's own floor is shown. Every line also
names the fastest kernel the run measured at that size, any backend, where it is not the floor
itself, and (given `whose`) whose it is: what headroom is measured against.

Where every rank's trace was given (commbench.analysis.skew), each call's wait for the last
rank is known: the price is then set on the transfer alone (the kernel's own time, what a
faster kernel could save) and the wait is reported apart as skew per step. Per-step figures
are over the median step wall, never the mean (a profiler's first replay can last 600x a step).
"""


from __future__ import annotations

import re
import statistics
from collections import defaultdict
from dataclasses import dataclass
from typing import Callable

from commbench.analysis.attribution import Call, Step
from commbench.analysis.curves import Curve, ranking
from commbench.ops import ALLREDUCE

# (the run's trusted curves for this world size and dtype, message bytes) -> the engine's best path
Alternative = Callable[[list[Curve], int], "Curve | None"]


@dataclass
class Priced:
    variant: str
    latency_us: float
    source: str                      # measured | interpolated
    saving_per_call_us: float
    saving_per_step_us: float
    saving_per_token_us: float | None
    share_of_step: float             # saving per step / median step wall


@dataclass
class FloorLine:
    library: str
    message_bytes: int | None
    size_from: str
    calls_per_step: float
    engine_p50_us: float             # the calls' median duration
    floor: Priced | None
    why_no_floor: str                # set when floor is None
    alternative: Priced | None = None
    transfer_p50_us: float | None = None   # median transfer, where the wait is known (priced on it)
    wait_per_step_us: float | None = None  # skew: the calls' wait per step (median over the steps)
    fastest: Priced | None = None    # the run's fastest plain allreduce at this size, any backend (None: the floor)
    fastest_whose: str = ""


def _price(curve: Curve, size: int, engine_us: float, per_step: float, batch: int | None,
           step_us: float) -> Priced | None:
    point = curve.at(size)
    if point is None:
        return None
    per_call = engine_us - point.latency_us
    return Priced(curve.label, point.latency_us, "measured" if curve.point(size) else "interpolated",
                  per_call, per_call * per_step, per_call * per_step / batch if batch else None,
                  per_call * per_step / step_us if step_us > 0 else 0.0)


def against_floor(steps: list[Step], curves: list[Curve], batch: int | None,
                  alternative: Alternative | None = None, whose: Callable[[Curve], str] | None = None
                  ) -> list[FloorLine]:
    if not steps:
        return []
    groups: dict[tuple[str, str, int | None, str], list[Call]] = defaultdict(list)
    for step in steps:
        for call in step.calls:
            groups[(call.library, call.floor_variants, call.message_bytes, call.size_from)].append(call)
    step_us = statistics.median(s.wall_us for s in steps)
    out = []
    for (library, floor_variants, size, size_from), calls in sorted(groups.items(), key=lambda g: -len(g[1])):
        per_step = len(calls) / len(steps)
        line = FloorLine(library, size, size_from, per_step, statistics.median(c.dur_us for c in calls), None, "")
        if all(c.wait_us is not None for c in calls):
            line.transfer_p50_us = statistics.median(c.transfer_us for c in calls)
            mine = {id(c) for c in calls}
            line.wait_per_step_us = statistics.median(sum(c.wait_us or 0.0 for c in s.calls if id(c) in mine)
                                                      for s in steps)
        engine_us = line.engine_p50_us if line.transfer_p50_us is None else line.transfer_p50_us
        own = [c for c in curves if floor_variants and re.search(floor_variants, c.key.variant)]
        if size is None:
            line.why_no_floor = "message size unknown (give --hidden and --batch, or --model and --batch)"
        elif not floor_variants:
            line.why_no_floor = "no commbench backend measures this library"
        elif not own:
            line.why_no_floor = "the run has no trusted rows of this library"
        else:
            ranked = ranking(own, size)
            if ranked:
                line.floor = _price(ranked[0].curve, size, engine_us, per_step, batch, step_us)
            else:
                line.why_no_floor = f"size outside the run's measured range ({own[0].range_text()})"
        if alternative is not None and size is not None:
            curve = alternative(curves, size)
            if curve is not None:
                line.alternative = _price(curve, size, engine_us, per_step, batch, step_us)
        if size is not None:
            ranked = ranking([c for c in curves if c.key.op == ALLREDUCE], size)
            if ranked and (line.floor is None or ranked[0].curve.label != line.floor.variant):
                line.fastest = _price(ranked[0].curve, size, engine_us, per_step, batch, step_us)
                line.fastest_whose = whose(ranked[0].curve) if whose is not None else ""
        out.append(line)
    return out
