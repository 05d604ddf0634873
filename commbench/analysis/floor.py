"""`commbench floor`: how much of each decode token allreduce costs, from a measured curve.

Per decode step every layer reduces [concurrency x hidden] activations ar_per_layer times, so

    floor_ms_per_token = layers x ar_per_layer x latency_us(concurrency x hidden x dtype bytes) / 1000

is the step time if compute were free, and concurrency / floor the tokens/s ceiling. With a
measured step time the step splits into allreduce and everything else, and swapping the
allreduce backend changes only the first part.

Per serving engine (--engine): the floor of the path it takes by default and of the fastest path
it can take here (commbench.analysis.decide); kernels no engine can run here are headroom, shown
apart, and the --step-ms what-if only swaps in a path the engine can take.
"""

from __future__ import annotations

import argparse
import csv
import math
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Sequence

from commbench import models
from commbench.analysis import configure_text, decide, fastest, provenance, question, render, results_out
from commbench.analysis.configure import NCCL_SCOPE, Configuration
from commbench.analysis.curves import Curve, CurveKey, Point, cautions, price, ranking
from commbench.analysis.fastest import FastestAt
from commbench.analysis.decide import Headroom
from commbench.analysis.question import EngineRecord, FloorRow, priced_row, row
from commbench.files import read_text
from commbench.errors import UsageError
from commbench.models import Model
from commbench.ops import ALLREDUCE
from commbench.analysis.render import fmt_num, fmt_us
from commbench.units import format_bytes, parse_bytes, positive_finite


def floor_row(model: Model, curve: Curve, concurrency: int) -> FloorRow:
    p = price(curve, model.message_bytes(concurrency))
    return row(model, concurrency, p.latency_us, curve.label, p.said())


def table_curve(path: Path) -> Curve:
    """A latency curve from a CSV with columns bytes,latency_us (bytes may use K/M/G)."""
    reader = csv.DictReader(read_text(path, "a latency table (CSV with columns bytes,latency_us)").splitlines())
    if not reader.fieldnames or not {"bytes", "latency_us"} <= {f.strip() for f in reader.fieldnames}:
        raise UsageError(f"{path}: latency table needs a header with columns bytes,latency_us")
    points: dict[int, Point] = {}
    for line_no, record in enumerate(reader, start=2):
        record = {k.strip(): (v or "").strip() for k, v in record.items() if k}
        try:
            size = parse_bytes(record["bytes"])
            latency_us = float(record["latency_us"])
        except (UsageError, ValueError):
            raise UsageError(f"{path}:{line_no}: expected bytes,latency_us, got "
                             f"{record.get('bytes')!r},{record.get('latency_us')!r}") from None
        if not 0 < latency_us < math.inf:
            raise UsageError(f"{path}:{line_no}: latency_us must be a positive, finite number, got {latency_us:g}")
        points[size] = Point(size, latency_us)
    if not points:
        raise UsageError(f"{path}: latency table has no rows")
    key = CurveKey(f"table:{path.name}", "", "any", ALLREDUCE)
    return Curve(key, key.variant, {}, [points[s] for s in sorted(points)])


@dataclass
class WhatIf:
    concurrency: int
    step_ms: float
    current: FloorRow
    rest_ms: float
    best: FloorRow
    new_step_ms: float
    tokens_per_s_now: float
    tokens_per_s_new: float

    @property
    def comm_fraction(self) -> float:
        return (self.current.floor_ms_per_token or 0.0) / self.step_ms


def what_if(model: Model, curves: list[Curve], current: Curve, concurrency: int, step_ms: float) -> WhatIf:
    """The step with `current` swapped for the fastest of `curves`: pass only curves the engine
    can take here (the configuration's), never a kernel it cannot run."""
    now = floor_row(model, current, concurrency)
    if now.floor_ms_per_token is None:
        raise UsageError(f"{current.label}: {format_bytes(now.message_bytes)} is outside its measured range "
                         f"{current.range_text()}; sweep that size first")
    if now.floor_ms_per_token > step_ms:
        raise UsageError(f"the allreduce floor with {current.label} ({now.floor_ms_per_token:.2f} ms) is longer "
                         f"than the measured step ({step_ms:.2f} ms): check --tp, the model and --concurrency")
    ranked = ranking(curves, now.message_bytes)
    best = floor_row(model, ranked[0].curve, concurrency) if ranked else now
    if best.floor_ms_per_token is None or best.floor_ms_per_token >= now.floor_ms_per_token:
        best = now
    rest = step_ms - now.floor_ms_per_token
    new_step = rest + (best.floor_ms_per_token or 0.0)
    return WhatIf(concurrency, step_ms, now, rest, best, new_step,
                  concurrency * 1000.0 / step_ms, concurrency * 1000.0 / new_step)


def rows_for(model: Model, curves: list[Curve], concurrencies: list[int]) -> list[FloorRow]:
    """Per concurrency, the floor of each named curve (--backend, --latency-table)."""
    return [floor_row(model, curve, c) for c in concurrencies for curve in curves]


def match_curves(curves: list[Curve], names: list[str]) -> list[Curve]:
    out = []
    for name in names:
        # An exact variant or label first: 'nccl' means NCCL's default, not also nccl[NCCL_...=...].
        hits = ([c for c in curves if name in (c.key.variant, c.label)]
                or [c for c in curves if name == c.backend])
        if not hits:
            raise UsageError(f"backend {name!r} has no trusted rows here (have: "
                             f"{', '.join(sorted({c.key.variant for c in curves}))})")
        out.extend(h for h in hits if h not in out)
    return out


@dataclass(frozen=True)
class FusedFloor:
    """At one decode size where an engine's default is a fused kernel: the floor of that default as
    its own kernel measured it (None: not measured in this run) and of the fastest stand-in for it,
    which no engine runs (fused_headroom.py); both times include the norm."""

    default: FloorRow | None
    stand_in: FloorRow
    said: str                 # which engines run the fused path by default at this size


def fused_floors(model: Model, rooms: tuple[Headroom, ...]) -> tuple[FusedFloor, ...]:
    return tuple(FusedFloor(priced_row(model, r.concurrency, r.versus) if r.versus else None,
                            priced_row(model, r.concurrency, r.cost), r.said) for r in rooms)


@dataclass(frozen=True)
class EngineWhatIf:
    """--step-ms for one engine: its measured step with the configuration swapped in, or why none."""

    engine: str
    what_if: WhatIf | None
    why_not: str | None


@dataclass(frozen=True)
class FloorResult:
    """What `floor` answers; its JSON is dataclasses.asdict of this (docs/results.md), and its text
    is drawn from it alone. From a run: provenance, engines, headroom; from --latency-table:
    curve (and what_if with --step-ms)."""

    provenance: dict[str, Any] | None
    curve: str | None
    model: Model
    allreduces_per_token: int
    tp: int | None
    step_ms: float | None                # --step-ms: the measured step the what-ifs split
    facts: tuple[str, ...]               # where each engine's facts (and chain) come from
    box_hint: str | None                 # an import without a probe snapshot: the one command that prices the rest
    engines: tuple[EngineRecord, ...]    # the same record recommend gives (question.EngineRecord)
    what_ifs: tuple[EngineWhatIf, ...]   # with --step-ms, per engine
    headroom: tuple[FloorRow, ...]
    fastest: tuple[FastestAt, ...]       # per size, the fastest kernel measured: what headroom is measured against
    backends: tuple[str, ...]            # --backend: the variants asked for
    rows: tuple[FloorRow, ...]           # --backend (a run) or the table's curve
    what_if: WhatIf | None               # --latency-table with --step-ms
    cautions: tuple[str, ...]
    fused_headroom: tuple[FusedFloor, ...] = ()   # per size where an engine's default is a fused kernel


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run_dir", nargs="?", help="results dir of a sweep (or use --latency-table)")
    parser.add_argument("--latency-table", type=Path, help="CSV with columns bytes,latency_us instead of a run")
    models.add_model_arguments(parser)
    parser.add_argument("--tp", type=int, help="tensor-parallel size (default: the run's world size)")
    question.add_arguments(parser)
    parser.add_argument("--backend", action="append", default=None,
                        help="also show this backend variant as measured (repeatable)")
    parser.add_argument("--mode", choices=("auto", "graph", "eager"), default="auto",
                        help="which timings: auto = CUDA-graph where measured, else eager")
    decide.add_engine_arguments(parser)
    parser.add_argument("--step-ms", type=float, help="a measured decode step (ms): split it and show the what-if")
    parser.add_argument("--current", help="backend the measured step used (default: the engine's default path)")
    parser.add_argument("--json", metavar="FILE", help="also write the rows as JSON ('-' for stdout)")
    results_out.add_arguments(parser)
    render.add_arguments(parser)


HEADERS = ["concurrency", "message", "backend", "us/call", "floor ms/step", "max tok/s", "latency"]


def _cells(r: FloorRow) -> list[str]:
    return [str(r.concurrency), format_bytes(r.message_bytes), r.backend, fmt_us(r.latency_us),
            fmt_num(r.floor_ms_per_token), fmt_num(r.max_tokens_per_s, 0), r.latency_source]


def _table(rows: list[FloorRow], title: str, wide: bool, roles: list[str] | None = None) -> str:
    """Rows under HEADERS; `roles` adds a first column that says what each row is."""
    if roles is None:
        return render.table(HEADERS, [_cells(r) for r in rows], right=(0, 1, 3, 4, 5), title=title, wide=wide)
    return render.table(["path", *HEADERS], [[role, *_cells(r)] for role, r in zip(roles, rows)],
                        right=(1, 2, 4, 5, 6), title=title, wide=wide)


def _engine_what_if(model: Model, c: Configuration, curves: list[Curve], args: argparse.Namespace,
                    ) -> tuple[WhatIf | None, str]:
    """The what-if for one engine: its measured step with the configuration swapped in, or why
    there is none."""
    by_label = {curve.label: curve for curve in curves}
    cell = c.cells[0] if c.cells else None
    if args.current:
        current = match_curves(curves, [args.current])[0]
    elif cell is None or cell.default_curve is None:
        why = c.why or "its default was not measured by its own kernel in this run"
        return None, f"{c.name}: no what-if: {why}; give --current BACKEND (what your measured step ran)"
    else:
        current = by_label[cell.default_curve]
    chosen = ([by_label[cell.chosen_curve]] if cell is not None and cell.chosen_curve in by_label
              and not c.is_default else [])
    return what_if(model, chosen, current, c.loads[0].concurrency, args.step_ms), ""


def main(args: argparse.Namespace, argv: Sequence[str] = ()) -> int:
    results_out.check_targets(args)
    model = question.requested_model(args)
    if model is None:
        return 0
    if (args.run_dir is None) == (args.latency_table is None):
        raise UsageError("give a results dir or --latency-table FILE (one of them)")
    if args.step_ms is not None:
        positive_finite(args.step_ms, "--step-ms", "milliseconds")
    asked = question.from_args(args, model, [1] if args.step_ms is not None else models.DEFAULT_CONCURRENCIES)
    concurrencies = asked.concurrencies
    if args.step_ms is not None and len(concurrencies) != 1:
        raise UsageError("--step-ms is one measured step: give the one concurrency it ran at (--concurrency N)")
    result = (table_result(args, model, concurrencies) if args.latency_table is not None
              else compute(question.answer(asked), asked, args))
    print(text(result, args.wide))
    results_out.write(args, result, f"floor {result.curve or args.run_dir}")
    return 0


def compute(found: question.Answer, asked: question.Question, args: argparse.Namespace) -> FloorResult:
    """Per engine the floor of its default and of its configuration (and the what-if with
    --step-ms), the headroom, the --backend rows and the cautions of every curve they show."""
    model, curves = asked.model, found.curves
    named = match_curves(curves, args.backend) if args.backend else []
    what_ifs = []
    for e in found.records:
        if args.step_ms is not None:
            report, why = _engine_what_if(model, e.configuration, curves, args)
            what_ifs.append(EngineWhatIf(e.engine, report, why or None))
    room_rows = [priced_row(model, r.concurrency, r.cost) for r in decide.fastest_headroom(found.headroom)]
    named_rows = rows_for(model, named, asked.concurrencies)
    shown: list[str] = []   # in the order the text shows them
    for e in found.records:
        shown += [r.backend for pair in e.floors for r in (pair.default,) + (() if e.configuration.is_default
                                                                             else (pair.configured,))
                  if r.latency_us is not None]
    shown += [w.what_if.best.backend for w in what_ifs if w.what_if is not None]
    fused = fused_floors(model, found.fused_headroom)
    shown += [r.backend for r in room_rows] + [f.stand_in.backend for f in fused] + [c.label for c in named]
    by_label = {c.label: c for c in curves}
    warned = cautions(found.run.rows, [by_label[label] for label in dict.fromkeys(shown) if label in by_label])
    return FloorResult(provenance.of(found.run).to_dict(), None, model, model.allreduces_per_token, found.tp,
                       args.step_ms, found.facts, found.box_hint, found.records, tuple(what_ifs),
                       tuple(room_rows),
                       found.fastest,
                       tuple(args.backend or ()), tuple(named_rows), None, tuple(warned), fused)


def table_result(args: argparse.Namespace, model: Model, concurrencies: list[int]) -> FloorResult:
    """A latency table: one curve, no engine to answer for."""
    curve = table_curve(args.latency_table)
    report = what_if(model, [curve], curve, concurrencies[0], args.step_ms) if args.step_ms is not None else None
    return FloorResult(None, f"latency table {args.latency_table}", model, model.allreduces_per_token, args.tp,
                       args.step_ms, (), None, (), (), (), (), (), tuple(rows_for(model, [curve], concurrencies)),
                       report, ())


def text(result: FloorResult, wide: bool = False) -> str:
    """The human answer, drawn from the result alone (its JSON holds the same)."""
    if result.curve is not None:
        return _table_text(result, wide)
    origin = result.provenance or {}    # a run's result always has one
    model, tag = result.model, decide.kind_tag(origin.get("kind", ""))
    out = [render.prose(origin.get("line", ""), wide),
           render.prose(f"{model.describe()}; TP {result.tp or '?'}", wide),
           render.prose(f"source: {model.source}", wide),
           "\n".join(render.prose(line, wide) for line in result.facts)]
    if result.box_hint:
        out.append(render.prose(result.box_hint, wide))
    if model.note:
        out.append(render.prose(f"note: {model.note}", wide))
    out.append(render.prose(f"floor_ms/step = {model.allreduces_per_token} allreduces x latency: each sequence's time "
                            f"per output token if compute were free ({tag}). Per engine, its default and the one "
                            "configuration recommend picks for this mix of concurrencies.", wide))
    tables: list[str | None] = []
    what_ifs = {w.engine: w for w in result.what_ifs}
    for e in result.engines:
        c = e.configuration
        out.append("")
        if e.version_note:
            out.append(render.prose(f"caution: {e.version_note}", wide))
        if not e.floors:   # nothing to tabulate: why, and the command that would price it
            out.append(f"== {e.name} ==")
            out.append("\n".join(configure_text.block(c, tag, wide, brief=True)))
            tables.append(None)
        else:
            base = "NCCL" if c.scope == NCCL_SCOPE else "default"
            rows = [r for pair in e.floors for r in (pair.default,) + (() if c.is_default else (pair.configured,))]
            roles = [base] * len(e.floors) if c.is_default else [base, "configured"] * len(e.floors)
            table = _table(rows, "", wide, roles).split("\n", 1)[1]
            said = ("its NCCL path (which sizes the engine sends it needs the box's probe snapshot)"
                    if c.scope == NCCL_SCOPE and c.is_default
                    else f"its NCCL path, then the NCCL setting {c.chosen}" if c.scope == NCCL_SCOPE
                    else "its default: nothing to set" if c.is_default
                    else f"its default, then the configuration {c.chosen}")
            if table in tables:
                out.append(render.prose(f"{e.name}: {said}: the same as "
                                        f"{result.engines[tables.index(table)].name}'s, above", wide))
            else:
                out.append(render.prose(f"{e.name}: per concurrency {said} ({tag})", wide))
                out.append(table)
            tables.append(table)
        w = what_ifs.get(e.engine)
        if w is not None:
            out.append(what_if_text(w.what_if, f"{e.name} ({tag})", wide) if w.what_if
                       else render.prose(w.why_not or "", wide))
    if result.headroom:
        out += ["", _table(list(result.headroom), f"headroom ({tag}): the fastest kernel measured here that no "
                                                  "requested engine takes here, per size; for comparison only", wide)]
    out.append("\n".join(fastest.fastest_table(result.fastest, tag, wide)))
    fused = _fused_text(result, tag, wide)
    out += fused[1:] if fused and not out[-1] else fused   # no table of the fastest kernels above: one blank line
    if result.rows:
        out += ["", _table(list(result.rows), f"as measured: {', '.join(result.backends)} ({tag})", wide)]
    out += ["\n" + render.prose(f"caution: {line}", wide) for line in result.cautions]
    return "\n".join(out)


def _fused_text(result: FloorResult, tag: str, wide: bool) -> list[str]:
    """Per size where an engine's default is a fused kernel: that default's floor and the fastest
    stand-in's, and which engines run it by default where."""
    if not result.fused_headroom:
        return []
    pairs = [(role, r) for f in result.fused_headroom
             for role, r in (("default", f.default), ("stand-in", f.stand_in)) if r is not None]
    suffix = fastest.mode_suffix([r.backend for _, r in pairs])   # ' (graph allreduce_residual_rmsnorm)'
    rows = [replace(r, backend=r.backend.removesuffix(suffix)) for _, r in pairs]
    defaults: dict[str, list[int]] = {}
    for f in result.fused_headroom:
        defaults.setdefault(f.said, []).append(f.stand_in.concurrency)
    timed = f"; {suffix[2:-1].split()[0]} mode" if suffix else ""
    title = (f"fused allreduce + residual + RMSNorm ({tag}{timed}): where an engine's default is a fused kernel, "
             "the floor of that default and of the fastest stand-in measured here, which no engine runs (headroom, "
             "for comparison only); the norm included, never set against a bare allreduce")
    return ["", render.prose(title, wide),
            _table(rows, "", wide, [role for role, _ in pairs]).split("\n", 1)[1],
            *(render.prose(f"c={', '.join(map(str, sizes))}: {said}", wide, indent="    ", first="  ")
              for said, sizes in defaults.items())]


def _table_text(result: FloorResult, wide: bool) -> str:
    """A latency table's floor: its rows, and the what-if with --step-ms."""
    out = [render.prose(f"data: {result.curve}, not a commbench run: no engine path or provenance to check", wide),
           render.prose(f"{result.model.describe()}; TP {result.tp or '?'}", wide),
           render.prose(f"source: {result.model.source}", wide), "", _table(list(result.rows), result.curve or "", wide)]
    if any(r.latency_us is None for r in result.rows):
        out.append("\nout of range: the curve does not reach that size; sweep it (never extrapolated)")
    if result.what_if is not None:
        out += ["", what_if_text(result.what_if, "this curve", wide)]
    return "\n".join(out)


def what_if_text(w: WhatIf, who: str, wide: bool = False) -> str:
    now_ms = w.current.floor_ms_per_token or 0.0
    lines = [f"{who} what-if: measured step {w.step_ms:.2f} ms at concurrency {w.concurrency} = "
             f"{now_ms:.2f} ms allreduce ({100 * w.comm_fraction:.0f}%, {w.current.backend}) "
             f"+ {w.rest_ms:.2f} ms everything else"]
    if w.best == w.current:   # what_if() keeps the current row when nothing is faster
        lines.append("no faster path this engine can take covers this size: the step stays as measured")
    else:
        best_ms = w.best.floor_ms_per_token or 0.0
        lines.append(f"with {w.best.backend}: {best_ms:.2f} ms allreduce -> step {w.new_step_ms:.2f} ms, "
                     f"{w.tokens_per_s_new:.1f} tokens/s (now {w.tokens_per_s_now:.1f}, "
                     f"{100 * (w.tokens_per_s_new / w.tokens_per_s_now - 1):+.0f}%)")
    return "\n".join(render.prose(line, wide) for line in lines)
