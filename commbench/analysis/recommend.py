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
from typing import Any, Sequence

from commbench import engines
from commbench import models
from commbench.analysis import (configure_text, decide, fastest, fused_headroom, next_steps, provenance, question, render,
                                results_out)
from commbench.analysis.curves import cautions
from commbench.analysis.decide import Headroom, Price
from commbench.analysis.fastest import FastestAt
from commbench.analysis.question import EngineRecord, OptionRecord, PathRecord
from commbench.models import Model
from commbench.analysis.render import fmt_us
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


def _cost(price: Price | None) -> str:
    if price is None:
        return "not measured"
    marks = ("*" if price.stand_in else "") + ("~" if price.interpolated else "")
    return f"{fmt_us(price.latency_us)}{marks}"


def _here(state: PathRecord) -> tuple[str, str]:
    """(the path's state on this box, why)."""
    if state.available is None:
        return "cannot tell here", state.why.removeprefix("cannot tell here: ").removeprefix("cannot tell: ")
    return ("available here" if state.available else "off here"), state.why


def _paths_lines(e: EngineRecord, tp_shown: str, wide: bool, said: dict[str, str], hint: str) -> list[str]:
    """The engine's paths in dispatch order, one item each: on by default or how to turn it on,
    whether this run measured it, its state here and why. A reason already given (by another path
    or engine) is referred to, not repeated."""
    measured = {o.path for o in e.options}
    lines = [render.prose(f"{e.name} paths at TP {tp_shown}, in dispatch order; each rule's source:", wide),
             f"    {hint}"]
    for n, s in enumerate(e.paths, start=1):
        how = "on by default" if s.default_on else f"opt-in: {s.turn_on}"
        state, why = _here(s)
        key = f"{state}: {why}"
        if key in said:
            why = f"as for {said[key]}"
        else:
            said[key] = f"{e.name}'s {s.title} above"
        ran = "measured" if s.path in measured else "not measured"
        lines.append(render.prose(f"{s.title} [{how}; {ran}]: {state}: {why}", wide, indent="     ",
                                  first=f"  {n}. "))
    return lines


def _letter(i: int) -> str:
    return chr(ord("A") + i) if i < 26 else f"Z{i - 25}"


def _legend(key: str, o: OptionRecord) -> str:
    def priced_by(label: str) -> str:
        measured = o.measured_implementations.get(label)
        return f"{label} [measured: {measured}]" if measured else label

    own = ", ".join(map(priced_by, o.own))
    stand = ", ".join(map(priced_by, o.stand_ins))
    parts = [f"priced by {own}" if own else "",
             (f"stand-in (not the engine's kernel): {stand}" + (", used only where no own kernel was measured"
                                                              if own else "")) if stand else "",
             f"its launch line adds {' '.join(f'`{a}`' for a in o.launch_adds)}" if o.launch_adds and not o.not_offered
             else "",
             f"not offered: {o.not_offered}" if o.not_offered else ""]
    return f"{key} = {o.label}: " + "; ".join(p for p in parts if p)


MARKS = (("*", "a stand-in's cost"), ("~", "interpolated between measured sizes"))


def _costs_table(e: EngineRecord, wide: bool) -> str:
    """One column per option (a letter, explained under the table): cells fit any terminal."""
    shown = [o for o in e.options if o.available is not False]
    titles = {p.path: p.title for p in e.paths}
    headers = ["concurrency", "message", "default path", *(_letter(n) for n in range(len(shown)))]
    rows = []
    for s in e.sizes:
        default = titles[s.default_path] if s.default_path else "cannot tell"
        rows.append([str(s.concurrency), format_bytes(s.message_bytes), default,
                     *(_cost(s.costs[o.label]) for o in shown)])
    # The title is a line of its own: a table's title folds to the table's width.
    table = render.table(headers, rows, right=(0, 1, *range(3, 3 + len(shown))), wide=wide)
    cells = "".join(cell for row in rows for cell in row[3:])
    marks = ", ".join(f"{mark} {what}" for mark, what in MARKS if mark in cells)
    legend = [_legend(_letter(n), o) for n, o in enumerate(shown)]
    return "\n".join([table, *([f"  {marks}"] if marks else []),
                      *(render.prose(line, wide, indent="    ", first="  ") for line in legend)])


def _brief_headroom(rooms: tuple[Headroom, ...], fused: tuple[Headroom, ...], tag: str, wide: bool) -> list[str]:
    """--brief: each kernel no engine can run here, with the most it would save at one size; then
    each stand-in for an engine's fused default, against that default."""
    lines = [render.prose(f"{_kernel(r)}: would save {r.saving.per_call_us:.1f} us/call, "  # type: ignore[union-attr]
                          f"{r.saving.per_step_ms:.2f} ms/step at concurrency {r.concurrency} "  # type: ignore[union-attr]
                          f"({format_bytes(r.message_bytes)}) vs {r.versus.curve if r.versus else '-'}",
                          wide, indent="    ", first="  ")
             for r in decide.most_saving(decide.fastest_headroom(list(rooms)))]
    lines += fused_headroom.brief_lines(fused, wide)
    if not lines:
        return []
    return ["\n" + render.prose(f"headroom ({tag}; no engine takes these here, for comparison only):", wide), *lines]


def _kernel(r: Headroom) -> str:
    """An engine's own kernel measured forced where the engine would not take it is named so."""
    return f"{r.kernel} (the engine's kernel, forced)" if r.engine_kernel else r.kernel


def main(args: argparse.Namespace, argv: Sequence[str] = ()) -> int:
    results_out.check_targets(args)
    model = question.requested_model(args)
    if model is None:
        return 0
    asked = question.from_args(args, model)
    result = compute(question.answer(asked), asked)
    print(text(result, args.wide, args.brief))
    sys.stdout.flush()
    results_out.write(args, result, f"recommend {args.run_dir}")
    return 0


def compute(found: question.Answer, asked: question.Question) -> RecommendResult:
    """The decision as data: per engine its paths, prices and configuration; headroom; the
    fastest kernel per size; the cautions of every curve the text shows; the settings the box's
    probe says do nothing; where the engines' facts come from."""
    run = found.run
    rooms = found.headroom
    shown = [c for d in found.decisions for o in d.options if o.state.available is not False
             for c in o.own + o.stand_ins]
    kernels = {r.kernel for r in [*rooms, *found.fused_headroom]}
    warned = cautions(run.rows, shown + [c for c in found.curves if c.label in kernels])
    inert = engines.inert_settings(found.box)
    return RecommendResult(provenance.of(run).to_dict(), asked.run_dir, asked.model, found.tp, found.facts,
                           found.sources.log_file, found.box_hint, found.records, tuple(rooms), found.fastest,
                           tuple(warned), tuple(r._asdict() for r in inert),
                           {**found.sources.facts.versions(), "nccl": engines.NCCL_VERSION}, found.fused_headroom)


def text(result: RecommendResult, wide: bool = False, brief: bool = False) -> str:
    """The human answer, drawn from the result alone (its JSON holds the same); each fact once."""
    model, tag = result.model, decide.kind_tag(result.provenance["kind"])
    tp_shown = str(result.tp or "?")
    out = [render.prose(result.provenance["line"], wide), render.prose(f"{model.describe()}; TP {tp_shown}", wide)]
    if result.box_hint:
        out.append(render.prose(result.box_hint, wide))
    if not brief or result.engine_log:
        out.append("\n".join(render.prose(line, wide) for line in result.facts))
    if brief:
        out.append(render.prose(f"us per allreduce call, ms per step of {model.allreduces_per_token} calls; one "
                                "configuration per server, against the engine's default in this run", wide))
    else:
        out.append(render.prose(f"us per allreduce call from this run ({tag}); a step is {model.allreduces_per_token} "
                                "calls (each sequence's time per output token); one configuration per server, priced "
                                "against the engine's default measured in this run; a margin inside both sides' "
                                "p10-p90 spread is 'no measurable difference'", wide))
    names = [e.name for e in result.engines]
    costs = [_costs_table(e, wide) if e.options and not brief else None for e in result.engines]
    trades = [configure_text.tradeoffs(e.configuration, wide) for e in result.engines]
    said: dict[str, str] = {}
    shown_paths: set[tuple[str, str]] = set()
    for i, e in enumerate(result.engines):
        out.append(f"\n== {e.name}, TP {tp_shown} ==")
        if e.version_note:
            out.append(render.prose(f"caution: {e.version_note}", wide))
        if not brief:
            hint = next_steps.engines_command(result.run_dir, e.engine, result.tp)
            out.append("\n".join(_paths_lines(e, tp_shown, wide, said, hint)))
            shown_paths |= {(e.engine, p.path) for p in e.paths}
            if costs[i]:
                out.append(_once(costs, i, names, lambda names: f"{names}: us per allreduce call ({tag})", wide,
                                 "us per allreduce call"))
        out.append("\n".join(configure_text.block(e.configuration, tag, wide, brief)))
        if trades[i]:
            c = e.configuration
            out.append(_once(trades, i, names, lambda names: configure_text.tradeoff_title(names, tag, c), wide,
                             "trade-offs"))
    if brief:
        out += _brief_headroom(result.headroom, result.fused_headroom, tag, wide)
    else:
        out.append("\n".join(fastest.fastest_table(result.fastest, tag, wide, result.headroom)))
        fused = fused_headroom.table(result.fused_headroom, model, tag, wide)
        if fused and not out[-1]:   # no table of the fastest kernels above: one blank line, not two
            fused[0] = fused[0].lstrip("\n")
        out += fused
    out += ["\n" + render.prose(f"caution: {line}", wide) for line in result.cautions]
    asked = {e.engine for e in result.engines}
    inert = [rule for rule in result.inert_settings
             if not rule["paths"] or not {tuple(p) for p in rule["paths"]} <= shown_paths
             and any(p[0] in asked for p in rule["paths"])]
    if inert and not brief:   # a setting whose path is listed above as off says nothing new
        out.append("\n" + render.prose("settings that do nothing on this box (from its probe snapshot; never "
                                         "printed above as a setting):", wide))
        out += [render.prose(f"- {rule['setting']}: {rule['why']} ({rule['source']})", wide, indent="    ",
                             first="  ") for rule in inert]
    out.append("\n" + render.prose(
        "A microbenchmark win is a hypothesis: confirm it with an end-to-end decode run at your concurrency"
        + ("." if brief else " (on a 16-GPU PCIe-switch server, Kimi K2.6 at TP8 decoded faster with the "
           "custom allreduce off at short context: 157 vs 139 tok/s at concurrency 1; voipmonitor/rtx6kpro "
           "benchmarks, 2026-04-25)."), wide))
    return "\n".join(out)


def _once(tables: list[str | None], i: int, names: list[str], title: Any, wide: bool, what: str) -> str:
    """Engine i's table under a title naming every engine whose table is the same; a line saying
    so where an earlier engine printed it already (vLLM and SGLang often take the same paths here)."""
    table = tables[i]
    if table is None:
        return ""
    if table in tables[:i]:
        return f"({what}: the same as {names[tables.index(table)]}'s above)"
    same = " and ".join(name for name, t in zip(names, tables) if t == table)
    return "\n" + render.prose(title(same), wide) + "\n" + table


@dataclass(frozen=True)
class RecommendResult:
    """What `recommend` answers; its JSON is dataclasses.asdict of this (docs/results.md), and its
    text is drawn from it alone."""

    provenance: dict[str, Any]
    run_dir: str                       # as the user named it: the commands printed name it so
    model: Model
    tp: int | None
    facts: tuple[str, ...]             # where each engine's facts (and chain) come from
    engine_log: str | None             # --engine-log: the chain vLLM logged
    box_hint: str | None               # an import without a probe snapshot: the one command that prices the rest
    engines: tuple[EngineRecord, ...]  # the same record floor gives (question.EngineRecord)
    headroom: tuple[Headroom, ...]
    fastest: tuple[FastestAt, ...]     # per size, the fastest kernel measured: what headroom is measured against
    cautions: tuple[str, ...]
    inert_settings: tuple[dict[str, Any], ...]    # engines.InertSetting's fields
    engine_versions: dict[str, str]
    # per size where an engine's default is a fused kernel: the fastest stand-in for it, against that default
    fused_headroom: tuple[Headroom, ...] = ()
