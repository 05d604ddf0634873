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

A kernel that computes another op than a plain allreduce (its TRACE_KERNELS entry says which:
FlashInfer's allreduce + residual + RMSNorm fusion) is set only against rows of that op at the
call's shape (--batch tokens x the hidden of --model or --hidden): its floor is its library's
fused rows, the fastest beside it the fastest row of that op and shape (commbench's p2p:fused
where the run has it), and no engine path is offered instead (a fused time includes the norm:
never against a bare allreduce).

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

from commbench.analysis import decide, fastest, render
from commbench.analysis.attribution import Call, RankResult, Step
from commbench.analysis.curves import Curve, CurvePrice, decode_curves, price, ranking
from commbench.analysis.render import fmt_us
from commbench.analysis.trace_read import RankTrace
from commbench.engines.registry import BY_KEY
from commbench.ops import ALLREDUCE, OP_WORDS, SHAPED_OPS
from commbench.results import Run
from commbench.units import dtype_name, format_bytes


# (the run's trusted curves for this world size and dtype, message bytes) -> the engine's best path
Alternative = Callable[[list[Curve], int], "Curve | None"]


@dataclass(frozen=True)
class Priced:
    price: CurvePrice                # curves.price() at the calls' size: measured or interpolated
    saving_per_call_us: float
    saving_per_step_us: float
    saving_per_token_us: float | None
    share_of_step: float             # saving per step / median step wall

    @property
    def variant(self) -> str:
        return self.price.curve

    @property
    def latency_us(self) -> float:
        return self.price.point.latency_us  # type: ignore[union-attr]   # _priced keeps covered sizes only

    @property
    def source(self) -> str:
        return self.price.how


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
    fastest: Priced | None = None    # the run's fastest row of the op at this size, any backend (None: the floor)
    fastest_whose: str = ""
    op: str = ALLREDUCE              # what the calls' kernel computes: its rows are of that op (and shape)


def _priced(curve: Curve, size: int, engine_us: float, per_step: float, batch: int | None,
            step_us: float) -> Priced | None:
    """The saving per call, step and token, were the calls at `curve`'s price; None out of its range."""
    p = price(curve, size)
    if p.latency_us is None:
        return None
    per_call = engine_us - p.latency_us
    return Priced(p, per_call, per_call * per_step, per_call * per_step / batch if batch else None,
                  per_call * per_step / step_us if step_us > 0 else 0.0)


def against_floor(steps: list[Step], curves: list[Curve], batch: int | None,
                  alternative: Alternative | None = None, whose: Callable[[Curve], str] | None = None
                  ) -> list[FloorLine]:
    if not steps:
        return []
    groups: dict[tuple[str, str, int | None, str, str, int | None], list[Call]] = defaultdict(list)
    for step in steps:
        for call in step.calls:
            groups[(call.library, call.floor_variants, call.message_bytes, call.size_from, call.op,
                    call.hidden)].append(call)
    step_us = statistics.median(s.wall_us for s in steps)
    out = []
    for (library, floor_variants, size, size_from, op, hidden), calls in sorted(groups.items(),
                                                                               key=lambda g: -len(g[1])):
        per_step = len(calls) / len(steps)
        line = FloorLine(library, size, size_from, per_step, statistics.median(c.dur_us for c in calls), None, "",
                         op=op)
        if all(c.wait_us is not None for c in calls):
            line.transfer_p50_us = statistics.median(c.transfer_us for c in calls)
            mine = {id(c) for c in calls}
            line.wait_per_step_us = statistics.median(sum(c.wait_us or 0.0 for c in s.calls if id(c) in mine)
                                                      for s in steps)
        engine_us = line.engine_p50_us if line.transfer_p50_us is None else line.transfer_p50_us
        # a shaped op's rows answer only its shape: the curves hold those of the calls' hidden (floor_lines)
        shaped = op in SHAPED_OPS
        same = [c for c in curves if c.key.op == op] if not shaped or hidden is not None else []
        own = [c for c in same if floor_variants and re.search(floor_variants, c.key.variant)]
        if size is None:
            line.why_no_floor = "message size unknown (give --hidden and --batch, or --model and --batch)"
        elif shaped and hidden is None:
            line.why_no_floor = (f"its shape is unknown: it computes {OP_WORDS[op]}, priced only by rows of its tokens "
                                 "x hidden (give --batch with --model or --hidden)")
        elif not floor_variants:
            line.why_no_floor = "no commbench backend measures this library"
        elif not own:
            line.why_no_floor = ("the run has no trusted rows of this library" if not shaped else
                                 f"the run has no trusted {OP_WORDS[op]} rows of this library at hidden {hidden}")
        else:
            ranked = ranking(own, size)
            if ranked:
                line.floor = _priced(ranked[0].curve, size, engine_us, per_step, batch, step_us)
            else:
                line.why_no_floor = f"size outside the run's measured range ({own[0].range_text()})"
        if alternative is not None and size is not None and op == ALLREDUCE:
            curve = alternative(curves, size)
            if curve is not None:
                line.alternative = _priced(curve, size, engine_us, per_step, batch, step_us)
        if size is not None:
            ranked = ranking(same, size)
            if ranked and (line.floor is None or ranked[0].curve.label != line.floor.variant):
                line.fastest = _priced(ranked[0].curve, size, engine_us, per_step, batch, step_us)
                line.fastest_whose = whose(ranked[0].curve) if whose is not None else ""
        out.append(line)
    return out


def floor_lines(run: Run, ranks: list[tuple[int, RankTrace]], results: list[RankResult], dtype: str | None,
                batch: int | None, alternative: Alternative | None = None,
                engine: str | None = None, sources: decide.EngineSources | None = None) -> list[FloorLine]:
    """The decode steps' calls (all steps where none is told to be decode) against the run;
    `alternative` (attribute_floor.Alternative), or `engine`'s fastest path on the run's box
    (engine_alternative), adds what the engine could take instead."""
    world = ranks[0][1].world_size or len(ranks)
    dtype_text = dtype_name(dtype) if dtype else "bf16"
    steps = [s for r in results for s in r.steps]
    # every call sized by --batch x --hidden shares that hidden: the shape a fused call's rows must have
    hidden = next((c.hidden for s in steps for c in s.calls if c.hidden is not None), None)
    curves = decode_curves(run, world, dtype_text, "auto", hidden=hidden)
    if alternative is None and engine is not None:
        alternative = engine_alternative(engine, run, world, dtype_text, sources)
    decode = [s for s in steps if s.phase == "decode"] or steps
    return against_floor(decode, curves, batch, alternative, lambda curve: fastest.whose(run, curve))


def engine_alternative(engine: str, run: Run, world_size: int, dtype: str,
                       sources: decide.EngineSources | None = None) -> Alternative:
    """recommend's choice at one size: the fastest path `engine` can take on the run's box, priced
    by the engine's own kernel or a library it runs (a stand-in for a kernel is no price)."""
    facts = sources.facts[engine] if sources is not None else BY_KEY[engine].facts
    chain = sources.chains.get(engine) if sources is not None else None
    box = decide.box_of(run, world_size)

    def choose(curves: list[Curve], message_bytes: int) -> Curve | None:
        _, price = decide.best_path_at(BY_KEY[engine], facts, run, curves, box, dtype, message_bytes, chain,
                                       sources is not None and sources.deterministic)
        if price is None or price.stand_in:
            return None
        return next((c for c in curves if c.label == price.curve), None)
    return choose


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
                         "of step"], rows, right=range(1, 9), wide=wide)]
    for f in lines:
        p = getattr(f, which)
        if p is not None:
            said = word if f.op == ALLREDUCE else \
                f"{word.rstrip(':')} ({OP_WORDS.get(f.op, f.op)} at this shape, the norm included):"
            out.append(render.prose(f"{f.library} at {format_bytes(f.message_bytes or 0)}: {said} {p.variant} "
                                    f"({p.source}); size from {f.size_from}", wide, indent="    ", first="  "))
    return out


def floor_text(lines: list[FloorLine], wide: bool = False, brief: bool = False) -> str:
    if not lines:
        return "against the floor: no allreduce calls in the steps"
    out = [render.prose("against the floor: the same library's fastest trusted rows in the run at that size", wide)]
    if not brief:
        out.append(render.fill("(d = engine minus floor: + = the engine pays more; of step = d/step over the median "
                               "step wall)", wide, " "))
    if not brief and any(f.transfer_p50_us is not None for f in lines):
        out.append(render.fill("(engine_us = the calls' median transfer: with every rank's trace the wait for the last "
                               "rank is taken out)", wide, " "))
    out += _priced_table(lines, "floor", "floor_us", "floor row", wide)
    for f in lines:
        if f.floor is None:
            size = format_bytes(f.message_bytes) if f.message_bytes is not None else "unknown"
            out.append(render.fill(f"no floor: {f.library} at {size}: {f.why_no_floor}", wide))
    for f in lines:
        if f.transfer_p50_us is not None and f.wait_per_step_us is not None:
            size = format_bytes(f.message_bytes) if f.message_bytes is not None else "unknown"
            within = (f"within {f.floor.saving_per_call_us:+.1f} us of the floor" if f.floor is not None
                      else f"{fmt_us(f.transfer_p50_us)} us (no floor: {f.why_no_floor})")
            out.append(render.fill(f"{f.library} at {size}: the kernel itself is {within}; {f.wait_per_step_us:.1f} "
                                   f"us per step is skew (the wait for the last rank; calls last "
                                   f"{fmt_us(f.engine_p50_us)} us at the median)", wide))
    alternatives = _priced_table(lines, "alternative", "instead_us", "instead:", wide)
    if alternatives:
        out += ["", render.prose("what the engine could take instead, measured in the same run (d = engine minus that "
                                 "path)", wide), *alternatives]
    fastest_rows = _priced_table(lines, "fastest", "fastest_us", "fastest:", wide)
    if fastest_rows:
        out += ["", render.prose("the fastest kernel measured in the same run at that size, any backend (d = engine "
                                 "minus it)", wide), *fastest_rows]
        whose = {f.fastest.variant: f.fastest_whose for f in lines if f.fastest is not None and f.fastest_whose}
        out += [render.prose(f"{variant}: {who}", wide, indent="    ", first="  ") for variant, who in whose.items()]
    return "\n".join(out)
