"""`commbench recommend`: per serving engine, the allreduce paths it can take on the run's box at
this TP, the one it takes by default, what each costs at a model's decode sizes, and the fastest
one with its exact settings; kernels no engine can run here are headroom, shown apart.

How it decides (docs/decisions.md): the message of one decode step is concurrency x hidden x
dtype bytes. A path is priced by the rows of the backends that declare it (the engine's own
kernels, else a named stand-in). A saving is quoted only against the engine's default path
measured in the same run, same dtype and mode, and a margin inside both sides' p10-p90 spread
is "no measurable difference".
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from typing import Any, Iterable, Sequence

from commbench import engines
from commbench import models
from commbench.analysis import configure, configure_text, decide, fastest, provenance, question, render, results_out
from commbench.analysis.curves import Curve, cautions, run_world_size
from commbench.analysis.decide import EngineDecision, Headroom, Option, Price, Saving
from commbench.models import Model
from commbench.analysis.render import fmt_us
from commbench.results import OK, Measurement, Run
from commbench.results.text import capped
from commbench.units import format_bytes


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run_dir", help="results dir written by commbench sweep")
    models.add_model_arguments(parser)
    parser.add_argument("--tp", type=int, help="tensor-parallel size (default: the run's world size)")
    question.add_arguments(parser)
    parser.add_argument("--mode", choices=("auto", "graph", "eager"), default="auto",
                        help="which timings: auto = CUDA-graph where measured, else eager")
    decide.add_engine_arguments(parser)
    parser.add_argument("--brief", action="store_true",
                        help="the decision alone: per engine its default path and cost per size, the fastest "
                             "path with its settings and saving, the headroom (no path, cost or inert table)")
    parser.add_argument("--json", metavar="FILE", help="also write the decision as JSON ('-' for stdout)")
    results_out.add_arguments(parser)
    render.add_arguments(parser)


def inert_here(run: Run, tp: int | None) -> list[engines.InertSetting]:
    """The engine settings the run's own probe snapshot says would change nothing."""
    snapshot = run.info.snapshot
    if not snapshot or not snapshot.get("gpus"):
        return []
    return engines.inert_settings(snapshot, tp or run_world_size(run) or 0)


def _cost(price: Price | None) -> str:
    if price is None:
        return "not measured"
    marks = ("*" if price.stand_in else "") + ("~" if price.interpolated else "")
    return f"{fmt_us(price.latency_us)}{marks}"


def _availability(state: Any) -> str:
    if state.available is None:
        return state.why if state.why.startswith("cannot tell") else f"cannot tell here: {state.why}"
    return ("available" if state.available else "off") + f": {state.why}"


def _paths_table(d: EngineDecision, args: argparse.Namespace) -> str:
    measured = {o.state.path for o in d.options}
    rows = [[s.rule.title, "on" if s.default_on else f"opt-in ({s.rule.turn_on})", _availability(s),
             "yes" if s.path in measured else "not measured"] for s in d.states]
    sources = [render.prose(f"{s.rule.title}: {s.source}", args.wide, indent="  ") for s in d.states]
    return (f"{d.name} paths at TP {args.tp_shown}, in dispatch order\n"
            + render.table(["path", "by default", "on this box", "in this run"], rows, wide=args.wide)
            + "\nwhere each rule comes from:\n" + "\n".join(sources))


def _letter(i: int) -> str:
    return chr(ord("A") + i) if i < 26 else f"Z{i - 25}"


IMPLEMENTATION_CHARS = 160   # run files are untrusted: a row's text is shown on one line, this long at most


def measured_implementations(rows: Iterable[Measurement]) -> dict[str, str]:
    """Per backend, what its rows say they ran (`extra.implementation`, set by the backends of
    the engines' own kernels: "sglang 0.5.23 custom allreduce v2 (JIT ...)", FlashInfer's port of
    vLLM's kernel and its version), so a price from them says which version was measured."""
    found: dict[str, str] = {}
    for row in rows:
        text = row.extra.get("implementation") if row.status == OK else None
        if isinstance(text, str) and text and row.backend not in found:
            found[row.backend] = capped(text, IMPLEMENTATION_CHARS)
    return found


def _priced_by(curve: Curve, implementations: dict[str, str]) -> str:
    measured = implementations.get(curve.backend)
    return f"{curve.label} [measured: {measured}]" if measured else curve.label


def _legend(key: str, o: Option, implementations: dict[str, str]) -> str:
    own = ", ".join(_priced_by(c, implementations) for c in o.own)
    stand = ", ".join(_priced_by(c, implementations) for c in o.stand_ins)
    parts = [f"priced by {own}" if own else "",
             (f"stand-in (not the engine's kernel): {stand}" + (", used only where no own kernel was measured"
                                                              if own else "")) if stand else ""]
    return f"{key} = {o.label}: " + "; ".join(p for p in parts if p)


def _costs_table(d: EngineDecision, tag: str, args: argparse.Namespace, implementations: dict[str, str]) -> str:
    """One column per option (a letter, explained under the table): cells fit any terminal."""
    shown = [i for i, o in enumerate(d.options) if o.state.available is not False]
    headers = ["concurrency", "message", "default path", *(_letter(n) for n in range(len(shown)))]
    rows = []
    for s in d.sizes:
        default = s.default.path.rule.title if s.default.path else "cannot tell"
        rows.append([str(s.concurrency), format_bytes(s.message_bytes), default, *(_cost(s.prices[i]) for i in shown)])
    # The title is a line of its own: a table's title folds to the table's width.
    table = render.table(headers, rows, right=(0, 1, *range(3, 3 + len(shown))), wide=args.wide)
    legend = [_legend(_letter(n), d.options[i], implementations) for n, i in enumerate(shown)]
    return "\n".join([table, "  * a stand-in's cost, ~ interpolated between measured sizes",
                      *(render.prose(line, args.wide, indent="  ") for line in legend)])


def _brief_headroom(rooms: list[Headroom], tag: str, wide: bool) -> list[str]:
    """--brief: each kernel no engine can run here, with the most it would save at one size."""
    best: dict[str, Headroom] = {}
    for r in decide.fastest_headroom(rooms):
        if r.saving is not None and r.saving.per_call_us > 0 and r.saving.beyond_spread is not False:
            if r.curve not in best or r.saving.per_step_ms > best[r.curve].saving.per_step_ms:  # type: ignore[union-attr]
                best[r.curve] = r
    if not best:
        return []
    lines = ["\n" + render.prose(f"headroom ({tag}; no engine takes these here, for comparison only):", wide)]
    lines += [render.prose(f"{_kernel(r)}: would save {r.saving.per_call_us:.1f} us/call, "  # type: ignore[union-attr]
                           f"{r.saving.per_step_ms:.2f} ms/step at concurrency {r.concurrency} "  # type: ignore[union-attr]
                           f"({format_bytes(r.message_bytes)}) vs {r.versus.curve if r.versus else '-'}",
                           wide, indent="  ")
              for r in best.values()]
    return lines


def _kernel(r: Headroom) -> str:
    """An engine's own kernel measured forced where the engine would not take it is named so."""
    return f"{r.curve} (the engine's kernel, forced)" if r.engine_kernel else r.curve


def _headroom_lines(rooms: list[Headroom], model: models.Model, tag: str, args: argparse.Namespace) -> list[str]:
    if not rooms:
        return []
    lines = ["\n" + render.prose(f"headroom ({tag}): kernels measured here that no requested engine takes here, by "
                                  "default or by a setting; for comparison only", args.wide)]
    by_why: dict[str, list[str]] = {}
    for r in rooms:
        kernels = by_why.setdefault(r.why, [])
        if _kernel(r) not in kernels:
            kernels.append(_kernel(r))
    lines.extend(render.prose(f"{', '.join(kernels)}: {why}", args.wide, indent="  ") for why, kernels in by_why.items())
    rows = []
    for r in decide.fastest_headroom(rooms):
        if r.saving is not None and r.saving.beyond_spread is False:
            said = "no measurable difference from the best engine path (inside the p10-p90 spread)"
        elif r.saving is not None and r.saving.per_call_us > 0:
            said = (f"a kernel like this would save {r.saving.per_call_us:.1f} us per call / "
                    f"{r.saving.per_step_ms:.2f} ms per step on this box"
                    + ("" if r.saving.beyond_spread else " (spread not measured)"))
        elif r.saving is not None:
            said = "slower than the best engine path"
        else:
            said = "no engine path measured at this size to compare with"
        rows.append([r.curve, str(r.concurrency), format_bytes(r.message_bytes), fmt_us(r.price.latency_us),
                     f"{r.versus.curve} {fmt_us(r.versus.latency_us)}" if r.versus else "-", said])
    lines.append(render.table(["fastest of them", "concurrency", "message", "us/call", "best engine path", "headroom"],
                              rows, right=(1, 2, 3), wide=args.wide))
    return lines


def main(args: argparse.Namespace, argv: Sequence[str] = ()) -> int:
    results_out.check_targets(args)
    model = models.requested(args)
    if model is None:
        return 0
    asked = question.from_args(args, model)
    found = question.answer(asked)
    result = compute(found, model)
    print(text(result, found, asked, args))
    sys.stdout.flush()
    results_out.write(args, result, f"recommend {args.run_dir}")
    return 0


def compute(found: question.Answer, model: Model) -> RecommendResult:
    """The decision as data: per engine its paths, prices and configuration; headroom; the
    cautions of every curve the text shows; the settings the box's probe says do nothing."""
    run = found.run
    implementations = measured_implementations(run.rows)
    records = tuple(engine_result(d, c, implementations) for d, c in zip(found.decisions, found.configurations))
    rooms = found.headroom
    shown = [c for d in found.decisions for o in d.options if o.state.available is not False
             for c in o.own + o.stand_ins]
    warned = cautions(run.rows, shown + [c for c in found.curves if c.label in {r.curve for r in rooms}])
    inert = inert_here(run, found.tp)
    return RecommendResult(provenance.of(run).to_dict(), model, found.tp, records,
                           tuple(headroom_record(r) for r in rooms), tuple(warned),
                           tuple(r._asdict() for r in inert), engines.versions())


def text(result: RecommendResult, found: question.Answer, asked: question.Question, args: argparse.Namespace) -> str:
    """The human answer: the result, with the tables drawn from the decisions it was computed from."""
    model, tag = result.model, found.tag
    args.tp_shown = result.tp or "?"
    implementations = measured_implementations(found.run.rows)
    out = [render.prose(provenance.describe(found.run), args.wide),
           render.prose(f"{model.describe()}; TP {args.tp_shown}", args.wide)]
    if not args.brief or found.chains:
        out.append("\n".join(render.prose(line, args.wide) for line in
                             decide.source_lines(list(found.engines), found.chains, args.engine_log)))
    if args.brief:
        out.append(render.prose(f"us per allreduce call, ms per step of {model.allreduces_per_token} calls; one "
                                "configuration per server, against the engine's default in this run", args.wide))
    else:
        out.append(render.prose(f"costs are us per allreduce call from this run ({tag}); per step = "
                                f"{model.allreduces_per_token} calls (each sequence's time per output token). A "
                                "server runs one configuration: it is priced against the engine's default measured "
                                "in this run at every size of the mix and the prefill chunk; a margin inside both "
                                "sides' p10-p90 spread is 'no measurable difference'", args.wide))
    costs = [_costs_table(d, tag, args, implementations) if d.options and not args.brief else None
             for d in found.decisions]
    trades = [configure_text.tradeoffs(c, args.wide) for c in found.configurations]
    for i, (d, c) in enumerate(zip(found.decisions, found.configurations)):
        out.append(f"\n== {d.name}, TP {args.tp_shown} ==")
        note = result.engines[i].version_note
        if note:
            out.append(render.prose(f"caution: {note}", args.wide))
        if not args.brief:
            out.append(_paths_table(d, args))
            if costs[i]:
                out.append(_once(costs, i, found.decisions, lambda names: f"{names}: us per allreduce call ({tag})",
                                 args.wide))
        out.append("\n".join(configure_text.block(c, tag, args.wide, args.brief)))
        if trades[i]:
            out.append(_once(trades, i, found.decisions, lambda names: configure_text.tradeoff_title(names, tag),
                             args.wide))
    rooms = found.headroom
    out += _brief_headroom(rooms, tag, args.wide) if args.brief else _headroom_lines(rooms, model, tag, args)
    if not args.brief:
        out.append("\n".join(fastest.fastest_lines(found.run, found.curves, model, asked.concurrencies,
                                                   found.decisions, tag, args.wide)))
    out += ["\n" + render.prose(f"caution: {line}", args.wide) for line in result.cautions]
    if result.inert_settings and not args.brief:
        out.append("\n" + render.prose("settings that do nothing on this box (from its probe snapshot; never "
                                         "printed above as a setting):", args.wide))
        out += [render.prose(f"- {rule['setting']}: {rule['why']} ({rule['source']})", args.wide, indent="  ")
                for rule in result.inert_settings]
    out.append("\n" + render.prose(
        "A microbenchmark win is a hypothesis: confirm it with an end-to-end decode run at your concurrency"
        + ("." if args.brief else " (on a 16-GPU PCIe-switch server, Kimi K2.6 at TP8 decoded faster with the "
           "custom allreduce off at short context: 157 vs 139 tok/s at concurrency 1; voipmonitor/rtx6kpro "
           "benchmarks, 2026-04-25)."), args.wide))
    return "\n".join(out)


def _once(tables: list[str | None], i: int, decisions: list[EngineDecision], title: Any, wide: bool) -> str:
    """Engine i's table under a title naming every engine whose table is the same; '' where an
    earlier engine printed it already (vLLM and SGLang often take the same paths here)."""
    table = tables[i]
    if table is None:
        return ""
    if table in tables[:i]:
        return f"({title(decisions[tables.index(table)].name).split(': ')[0]}: printed above)"
    names = " and ".join(d.name for d, t in zip(decisions, tables) if t == table)
    return "\n" + render.prose(title(names), wide) + "\n" + table


@dataclass(frozen=True)
class PathRecord:
    """One engine path on the run's box (decide's PathState, as the JSON gives it)."""

    path: str
    title: str
    default_on: bool
    available: bool | None
    why: str
    turn_on: str
    source: str
    max_bytes: int | None


@dataclass(frozen=True)
class OptionRecord:
    label: str
    path: str
    available: bool | None
    own: tuple[str, ...]
    stand_ins: tuple[str, ...]
    measured_implementations: dict[str, str]


@dataclass(frozen=True)
class SizeRecord:
    """One decode size: the default's price and every option's, the choice and its saving."""

    concurrency: int
    message_bytes: int
    default_path: str | None
    default_why: str
    default_cost: Price | None
    costs: dict[str, Price | None]
    choice: str | None
    choice_cost: Price | None
    saving: Saving | None
    why_no_saving: str | None


@dataclass(frozen=True)
class EngineResult:
    engine: str
    version: str
    version_note: str | None
    paths: tuple[PathRecord, ...]
    options: tuple[OptionRecord, ...]
    sizes: tuple[SizeRecord, ...]
    configuration: configure.Configuration
    losses: tuple[configure.Cell, ...]    # the configuration's cells where it is slower than the default


@dataclass(frozen=True)
class HeadroomRecord:
    kernel: str
    why: str
    concurrency: int
    message_bytes: int
    cost: Price
    versus: Price | None
    saving: Saving | None


@dataclass(frozen=True)
class RecommendResult:
    """What `recommend` answers; its JSON is dataclasses.asdict of this (docs/results.md)."""

    provenance: dict[str, Any]
    model: Model
    tp: int | None
    engines: tuple[EngineResult, ...]
    headroom: tuple[HeadroomRecord, ...]
    cautions: tuple[str, ...]
    inert_settings: tuple[dict[str, Any], ...]    # engines.InertSetting's fields
    engine_versions: dict[str, str]


def engine_result(d: EngineDecision, c: configure.Configuration, implementations: dict[str, str]) -> EngineResult:
    return EngineResult(
        d.engine, d.version, decide.version_note(d),
        tuple(PathRecord(s.path, s.rule.title, s.rule.default_on, s.available, s.why, s.rule.turn_on, s.source,
                         s.max_bytes) for s in d.states),
        tuple(OptionRecord(o.label, o.state.path, o.state.available, tuple(c.label for c in o.own),
                           tuple(c.label for c in o.stand_ins),
                           {c.label: implementations[c.backend] for c in o.own + o.stand_ins
                            if c.backend in implementations}) for o in d.options),
        tuple(SizeRecord(s.concurrency, s.message_bytes, s.default.path.path if s.default.path else None,
                         s.default.why, s.default_price, {o.label: p for o, p in zip(d.options, s.prices)},
                         s.best.label if s.best else None, s.best_price, s.saving, s.why_no_saving or None)
              for s in d.sizes),
        c, c.losses)


def headroom_record(r: Headroom) -> HeadroomRecord:
    return HeadroomRecord(r.curve, r.why, r.concurrency, r.message_bytes, r.price, r.versus, r.saving)
