"""`commbench recommend`: which allreduce backend to run for a model, TP size and concurrency range.

For each decode batch size the message is concurrency x hidden x dtype bytes; the fastest trusted
curve there wins. Its margin over the runner-up and over NCCL's default is only worth acting on
when it is larger than the p10-p90 spread both sides measured.
"""

from __future__ import annotations

import argparse
from dataclasses import asdict, dataclass
from typing import Sequence

from commbench.analysis import models
from commbench import engines
from commbench.analysis.curves import (Candidate, Curve, baseline_curve, baseline_name, cautions, decode_curves,
                              exceeds_spread, ranking, run_world_size)
from commbench.files import check_file_target, write_json
from commbench.analysis.models import Model
from commbench.results import Run
from commbench.runs import load_run
from commbench.analysis.text import fmt_us, render
from commbench.units import format_bytes, parse_int_list

HELP = "backend per message size for a model, TP size and concurrency range, with engine settings"


@dataclass
class Margin:
    other: str
    delta_us: float
    ratio: float                # other latency / winner latency
    beyond_spread: bool | None  # None: a spread is unknown


@dataclass
class Choice:
    concurrency: int
    message_bytes: int
    backend: str | None          # None: no trusted curve covers this size
    latency_us: float | None
    runner_up: Margin | None
    vs_baseline: Margin | None
    note: str = ""


def _margin(win: Candidate, other: Curve, point) -> Margin:
    delta = point.latency_us - win.point.latency_us
    return Margin(other.label, delta, point.latency_us / win.point.latency_us, exceeds_spread(delta, win.point, point))


def choose(model: Model, curves: list[Curve], concurrency: int, baseline: str | None) -> Choice:
    size = model.message_bytes(concurrency)
    ranked = ranking(curves, size)
    if not ranked:
        spans = ", ".join(sorted({c.range_text() for c in curves}))
        return Choice(concurrency, size, None, None, None, None, f"not measured (curves cover {spans})")
    win = ranked[0]
    runner = _margin(win, ranked[1].curve, ranked[1].point) if len(ranked) > 1 else None
    base = baseline_curve(curves, baseline, win.curve)
    base_point = base.at(size) if base is not None else None
    versus = _margin(win, base, base_point) if base is not None and base_point is not None and base is not win.curve else None
    note = "interpolated" if win.interpolated else ""
    return Choice(concurrency, size, win.curve.label, win.point.latency_us, runner, versus, note)


def _beyond(m: Margin | None) -> str:
    if m is None:
        return "-"
    return {True: "yes", False: "no", None: "unknown"}[m.beyond_spread]


def _margin_text(m: Margin | None) -> str:
    return "-" if m is None else f"+{fmt_us(m.delta_us)} us {m.ratio:.2f}x"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run_dir", help="results dir written by commbench sweep")
    models.add_model_arguments(parser)
    parser.add_argument("--tp", type=int, help="tensor-parallel size (default: the run's world size)")
    parser.add_argument("--concurrency", help="decode batch sizes, e.g. 1,8,64 (default 1,2,4,...,256)")
    parser.add_argument("--mode", choices=("auto", "graph", "eager"), default="auto",
                        help="which timings: auto = CUDA-graph where measured, else eager")
    parser.add_argument("--json", metavar="FILE", help="also write the choices as JSON ('-' for stdout)")


def inert_here(run: Run, tp: int | None) -> list[engines.InertSetting]:
    """The engine settings the run's own probe snapshot says would change nothing."""
    snapshot = run.info.get("snapshot")
    if not isinstance(snapshot, dict) or not snapshot.get("gpus"):
        return []
    return engines.inert_settings(snapshot, tp or run_world_size(run))


def recorded_settings(run: Run, curve: Curve) -> engines.Settings | None:
    """What the backend declared in this run (run.json backend_facts), under the curve's process env."""
    declared = ((run.info.get("backend_facts") or {}).get(curve.backend) or {}).get("engine_settings")
    return engines.Settings.from_dict(declared).with_process_env(curve.env_setting) if declared else None


def main(args: argparse.Namespace, argv: Sequence[str] = ()) -> int:
    check_file_target(args.json, "--json")
    model = models.requested(args)
    if model is None:
        return 0
    concurrencies = parse_int_list(args.concurrency, "--concurrency") if args.concurrency else models.DEFAULT_CONCURRENCIES
    run = load_run(args.run_dir)
    curves = decode_curves(run, args.tp, model.dtype, args.mode)
    baseline = baseline_name(curves, None)
    tp = args.tp or run_world_size(run)
    choices = [choose(model, curves, c, baseline) for c in concurrencies]

    if run.emulation_line():
        print(run.emulation_line())
    print(f"{model.describe()}; TP {tp}; run {run.info.get('run_id', run.path.name)}")
    print("margins are latency differences; 'beyond spread' = larger than the jitter pass's p10-p90 spread "
          "of both sides\n")
    print(render(["concurrency", "message", "use", "latency us", "runner-up", "margin", "beyond spread",
                  f"vs {baseline or 'baseline'}", "beyond spread", "note"],
                 [[str(c.concurrency), format_bytes(c.message_bytes), c.backend or "-", fmt_us(c.latency_us),
                   c.runner_up.other if c.runner_up else "-", _margin_text(c.runner_up), _beyond(c.runner_up),
                   _margin_text(c.vs_baseline), _beyond(c.vs_baseline), c.note] for c in choices],
                 right=(0, 1, 3, 5, 7)))

    winners: dict[str, list[Choice]] = {}
    for c in choices:
        if c.backend is not None:
            winners.setdefault(c.backend, []).append(c)
    by_label = {curve.label: curve for curve in curves}
    print()
    if not winners:
        print("no trusted measurement covers these message sizes: sweep them first")
    elif len(winners) > 1:
        print("different backends win at different concurrencies; engines switch paths by size themselves, "
              "so set up the one for the concurrency you serve most:")
    for label, won in winners.items():
        curve = by_label[label]
        span = "concurrency " + ", ".join(str(c.concurrency) for c in won)
        vs = [c.vs_baseline for c in won if c.vs_baseline is not None]
        if curve.backend == baseline and not curve.env_setting:
            verdict = f"{baseline} default is fastest here: nothing to change"
        elif vs and not any(m.beyond_spread for m in vs):
            verdict = f"within the measured spread of {baseline}: keep the default unless an end-to-end run agrees"
        else:
            verdict = "faster than the default beyond the measured spread"
        print(f"\n## {label} wins {span} ({verdict})")
        chosen = recorded_settings(run, curve)
        print(engines.render(chosen, tp) if chosen else
              f"# no engine settings recorded for {curve.backend} in this run's run.json (runs record what "
              "each backend declares since results schema 3)")
    warned = cautions(run.rows, [by_label[label] for label in winners])
    for line in warned:
        print(f"\ncaution: {line}")
    inert = inert_here(run, tp)
    if inert:
        print("\nsettings that do nothing on this box (from its probe snapshot):")
        for rule in inert:
            print(f"  - {rule.setting}: {rule.why} ({rule.source})")
    print("\nA microbenchmark win is a hypothesis: confirm it with an end-to-end decode run at your concurrency "
          "(on a 16-GPU PCIe-switch server, Kimi K2.6 at TP8 decoded faster with the custom allreduce off at "
          "short context: 157 vs 139 tok/s at concurrency 1; voipmonitor/rtx6kpro benchmarks, 2026-04-25).")

    write_json(args.json, {"model": asdict(model), "tp": tp, "baseline": baseline,
                           "choices": [asdict(c) for c in choices], "cautions": warned,
                           "settings": [chosen.to_dict() for label in winners
                                        if (chosen := recorded_settings(run, by_label[label])) is not None],
                           "engine_versions": engines.versions()})
    return 0
