"""`commbench floor`: how much of each decode token allreduce costs, from a measured curve.

Per decode step every layer reduces [concurrency x hidden] activations ar_per_layer times, so

    floor_ms_per_token = layers x ar_per_layer x latency_us(concurrency x hidden x dtype bytes) / 1000

is the step time if compute were free, and concurrency / floor the tokens/s ceiling. With a
measured step time the step splits into allreduce and everything else, and swapping the
allreduce backend changes only the first part.
"""

from __future__ import annotations

import argparse
import csv
import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Sequence

from commbench.analysis import models
from commbench.analysis.curves import Curve, CurveKey, Point, baseline_name, cautions, decode_curves, ranking
from commbench.files import check_file_target, read_text, write_json
from commbench.errors import UsageError
from commbench.analysis.models import Model
from commbench.runs import load_run
from commbench.analysis.text import fmt_num, fmt_us, render
from commbench.units import format_bytes, parse_bytes, parse_int_list, positive_finite

HELP = "per-token allreduce floor for decode, per model, TP size and concurrency"


@dataclass
class FloorRow:
    concurrency: int
    message_bytes: int
    allreduces_per_token: int
    backend: str
    latency_us: float | None          # None: the size is outside the measured range
    floor_ms_per_token: float | None
    max_tokens_per_s: float | None    # all sequences together, if compute were free
    latency_source: str               # measured | interpolated | out of range <lo>-<hi>


def floor_row(model: Model, curve: Curve, concurrency: int) -> FloorRow:
    size = model.message_bytes(concurrency)
    n = model.allreduces_per_token
    point = curve.at(size)
    if point is None:
        return FloorRow(concurrency, size, n, curve.label, None, None, None,
                        f"out of range {curve.range_text()}")
    floor_ms = n * point.latency_us / 1000.0
    source = "measured" if curve.point(size) is not None else "interpolated"
    return FloorRow(concurrency, size, n, curve.label, point.latency_us, floor_ms,
                    concurrency * 1000.0 / floor_ms, source)


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
    key = CurveKey(f"table:{path.name}", "", "any", "allreduce")
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


def rows_for(model: Model, curves: list[Curve], concurrencies: list[int], shown: list[Curve] | None) -> list[FloorRow]:
    """Per concurrency: the named curves, or else the fastest trusted curve and the baseline."""
    out = []
    base = baseline_name(curves, None)
    for concurrency in concurrencies:
        if shown is not None:
            picks = shown
        else:
            ranked = ranking(curves, model.message_bytes(concurrency))
            picks = [ranked[0].curve] if ranked else []
            picks += [c for c in curves if c.backend == base and not c.env_setting
                      and c.key.op == "allreduce" and c not in picks]
            if not picks:   # nothing covers this size: say so with the widest curve's range
                picks = [max(curves, key=lambda c: len(c.points))]
        out.extend(floor_row(model, curve, concurrency) for curve in picks)
    return out


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


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run_dir", nargs="?", help="results dir of a sweep (or use --latency-table)")
    parser.add_argument("--latency-table", type=Path, help="CSV with columns bytes,latency_us instead of a run")
    models.add_model_arguments(parser)
    parser.add_argument("--tp", type=int, help="tensor-parallel size (default: the run's world size)")
    parser.add_argument("--concurrency", help="decode batch sizes, e.g. 1,8,64 (default 1,2,4,...,256)")
    parser.add_argument("--backend", action="append", default=None,
                        help="show this backend variant (repeatable; default: the fastest and NCCL's default)")
    parser.add_argument("--mode", choices=("auto", "graph", "eager"), default="auto",
                        help="which timings: auto = CUDA-graph where measured, else eager")
    parser.add_argument("--step-ms", type=float, help="a measured decode step (ms): split it and show the what-if")
    parser.add_argument("--current", help="backend the measured step used (default: NCCL's default)")
    parser.add_argument("--json", metavar="FILE", help="also write the rows as JSON ('-' for stdout)")


def main(args: argparse.Namespace, argv: Sequence[str] = ()) -> int:
    check_file_target(args.json, "--json")
    model = models.requested(args)
    if model is None:
        return 0
    if (args.run_dir is None) == (args.latency_table is None):
        raise UsageError("give a results dir or --latency-table FILE (one of them)")
    if args.step_ms is not None:
        positive_finite(args.step_ms, "--step-ms", "milliseconds")
    if args.concurrency:
        concurrencies = parse_int_list(args.concurrency, "--concurrency")
    else:
        concurrencies = [1] if args.step_ms is not None else models.DEFAULT_CONCURRENCIES
    if args.step_ms is not None and len(concurrencies) != 1:
        raise UsageError("--step-ms is one measured step: give the one concurrency it ran at (--concurrency N)")

    if args.latency_table is not None:
        curves = [table_curve(args.latency_table)]
        origin = f"latency table {args.latency_table}"
        tp = args.tp
    else:
        run = load_run(args.run_dir)
        curves = decode_curves(run, args.tp, model.dtype, args.mode)
        origin = f"run {run.info.get('run_id', run.path.name)} ({run.path})"
        tp = args.tp or run.info.get("world_size")
    shown = match_curves(curves, args.backend) if args.backend else None
    rows = rows_for(model, curves, concurrencies, shown)

    if args.latency_table is None and run.emulation_line():
        print(run.emulation_line())
    print(f"{model.describe()}; TP {tp or '?'}; curve: {origin}")
    print(f"source: {model.source}")
    if model.note:
        print(f"note: {model.note}")
    print()
    print(render(["concurrency", "message", "ARs/token", "backend", "latency_us", "floor_ms/token",
                  "max_tok/s", "latency from"],
                 [[str(r.concurrency), format_bytes(r.message_bytes), str(r.allreduces_per_token), r.backend,
                   fmt_us(r.latency_us), fmt_num(r.floor_ms_per_token),
                   fmt_num(r.max_tokens_per_s, 0), r.latency_source] for r in rows],
                 right=(0, 1, 2, 4, 5, 6)))
    if any(r.latency_us is None for r in rows):
        print("\nout of range: the curve does not reach that size; sweep it (never extrapolated)")

    report = None
    if args.step_ms is not None:
        current = match_curves(curves, [args.current])[0] if args.current else None
        if current is None:
            base = baseline_name(curves, None)
            plain = [c for c in curves if c.backend == base and not c.env_setting and c.key.op == "allreduce"]
            current = plain[0] if plain else curves[0]
        report = what_if(model, curves, current, concurrencies[0], args.step_ms)
        print()
        print(what_if_text(report))

    # Every backend shown above (a row, the what-if's best) that failed its check at some size.
    by_label = {c.label: c for c in curves}
    shown = [r.backend for r in rows] + ([report.best.backend] if report else [])
    warned = cautions(run.rows, [by_label[label] for label in shown]) if args.latency_table is None else []
    for line in warned:
        print(f"\ncaution: {line}")

    write_json(args.json, {"model": asdict(model), "allreduces_per_token": model.allreduces_per_token, "tp": tp,
                           "curve": origin, "rows": [asdict(r) for r in rows],
                           "what_if": asdict(report) if report else None, "cautions": warned})
    return 0


def what_if_text(w: WhatIf) -> str:
    now_ms = w.current.floor_ms_per_token or 0.0
    lines = [f"measured step {w.step_ms:.2f} ms at concurrency {w.concurrency} = "
             f"{now_ms:.2f} ms allreduce ({100 * w.comm_fraction:.0f}%, {w.current.backend}) "
             f"+ {w.rest_ms:.2f} ms everything else"]
    if w.best is w.current:
        lines.append("no faster trusted backend covers this size: the step stays as measured")
    else:
        best_ms = w.best.floor_ms_per_token or 0.0
        lines.append(f"with {w.best.backend}: {best_ms:.2f} ms allreduce -> step {w.new_step_ms:.2f} ms, "
                     f"{w.tokens_per_s_new:.1f} tokens/s (now {w.tokens_per_s_now:.1f}, "
                     f"{100 * (w.tokens_per_s_new / w.tokens_per_s_now - 1):+.0f}%)")
    return "\n".join(lines)
