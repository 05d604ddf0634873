"""The fastest kernel measured at a size, whoever's it is: what headroom is measured against.

recommend's and floor's headroom and attribute's floor name it beside their own comparisons, so
that "a kernel like this would save X" never points at a slower kernel than one the same run
measured: ours (p2p), the engines' own kernels and their forced algorithms, the libraries. Whose
it is comes from what the run recorded: the implementation its rows name (the engines' kernels
record theirs), else its backend family, and which engine path, if any, runs it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from commbench import engines
from commbench.analysis.curves import Curve, ranking
from commbench.analysis.decide import EngineDecision, Headroom, Price, measurable, recorded_settings
from commbench.models import Model
from commbench.analysis import render
from commbench.analysis.render import fmt_num, fmt_us
from commbench.ops import ALLREDUCE
from commbench.results import OK, Run
from commbench.results.text import capped
from commbench.units import format_bytes

IMPLEMENTATION_CHARS = 80


@dataclass(frozen=True)
class Fastest:
    message_bytes: int
    curve: str              # the curve's label
    latency_us: float
    interpolated: bool
    whose: str


def _printable(text: object) -> str:
    """Text from the run's files on one line, bounded (cut at a word, marked)."""
    return capped(text, IMPLEMENTATION_CHARS)


def whose(run: Run, curve: Curve) -> str:
    """Whose kernel `curve` measured and which engine path runs it, from the run's own records."""
    implementation = next((r.extra.get("implementation") for r in run.rows
                           if r.backend == curve.backend and r.status == OK
                           and isinstance(r.extra.get("implementation"), str) and r.extra.get("implementation")), None)
    entry = (run.info.backend_facts or {}).get(curve.backend)
    family = entry.get("family") if isinstance(entry, dict) and isinstance(entry.get("family"), str) else None
    owner = _printable(implementation) if implementation else f"the {_printable(family or curve.backend.split(':')[0])} backend"
    settings = recorded_settings(run, curve)
    claims = engines.declared_paths(settings) if settings is not None else {}
    paths = [f"{'stands in for' if claim.get('stand_in') else 'runs as'} {engines.ENGINE_NAMES[engine]}'s "
             f"{_printable(claim['path'])} path" for engine, claim in sorted(claims.items())]
    return f"{owner}; " + (", ".join(paths) if paths else "no engine setting selects it")


@dataclass(frozen=True)
class FastestAt:
    """At one decode size: the fastest kernel measured, and each requested engine's best path
    there that its own kernel priced (a stand-in is no comparison)."""

    concurrency: int
    fastest: Fastest
    engine_paths: tuple[Price, ...]


def fastest_by_size(run: Run, curves: list[Curve], model: Model, concurrencies: list[int],
                    decisions: list[EngineDecision]) -> tuple[FastestAt, ...]:
    """Per concurrency the decisions were made at, where any curve covers its size."""
    out = []
    owners: dict[str, str] = {}     # whose() reads every row: once per curve, not per size
    for i, concurrency in enumerate(concurrencies):
        ranked = ranking([c for c in curves if c.key.op == ALLREDUCE], model.message_bytes(concurrency))
        if not ranked:
            continue
        top = ranked[0]
        if top.curve.label not in owners:
            owners[top.curve.label] = whose(run, top.curve)
        prices = (d.sizes[i].best_price for d in decisions)
        out.append(FastestAt(concurrency, Fastest(model.message_bytes(concurrency), top.curve.label,
                                                  top.point.latency_us, top.interpolated, owners[top.curve.label]),
                             tuple(p for p in prices if p is not None and not p.stand_in)))
    return tuple(out)


def mode_suffix(labels: list[str]) -> str:
    """' (graph)' where every curve label ends so: a table says it once, in its title."""
    ends = {label[label.rfind(" ("):] for label in labels if label.endswith(")") and " (" in label}
    return ends.pop() if len(ends) == 1 and all(label.endswith(tuple(ends or {""})) for label in labels) else ""


def fastest_table(rows: tuple[FastestAt, ...], tag: str, wide: bool = False,
                  rooms: Sequence[Headroom] = ()) -> list[str]:
    """Per concurrency: the fastest kernel measured at its decode size against the best path a
    requested engine takes there; with `rooms` (the headroom), '*' marks a kernel no requested
    engine takes here and a column what it would save per step. Then, once per kernel shown,
    whose it is (and why no engine takes it)."""
    if not rows:
        return []
    said = {r.kernel: r.said or r.why for r in rooms}
    saves = {(r.kernel, r.concurrency): r.saving for r in rooms}
    bests = [min(row.engine_paths, key=lambda p: p.latency_us, default=None) for row in rows]
    suffix = mode_suffix([row.fastest.curve for row in rows] + [b.curve for b in bests if b is not None])
    table, kernels = [], {}
    for row, best in zip(rows, bests):
        top = row.fastest
        gain = saves.get((top.curve, row.concurrency))
        kernels.setdefault(top.curve, top.whose)
        cells = [f"c={row.concurrency} {format_bytes(top.message_bytes)}",
                 ("* " if top.curve in said else "") + top.curve.removesuffix(suffix),
                 fmt_us(top.latency_us) + ("~" if top.interpolated else ""),
                 best.curve.removesuffix(suffix) if best else "-",
                 fmt_us(best.latency_us) + ("~" if best.interpolated else "") if best else "-",
                 f"{best.latency_us / top.latency_us:.2f}x" if best else "-"]
        if rooms:
            cells.append(fmt_num(gain.per_step_ms) if measurable(gain) else "-")
        table.append(cells)
    headers = ["size", "fastest measured", "us", "best engine path", "us", "x", *(["saved"] if rooms else [])]
    marks = ("; '*' no requested engine takes it here (headroom, for comparison only), saved: the ms per step a "
             "kernel like it would save" if any(k in said for k in kernels) else "")
    return ["\n" + render.prose(f"fastest kernel measured at each size, any backend, against the best path an engine "
                                f"takes there ({tag}{';' + suffix[1:-1].replace('(', ' ') + ' mode' if suffix else ''}); "
                                f"us per call, '~' interpolated{marks}", wide),
            render.table(headers, table, right=(2, 4, 5, 6), wide=wide),
            *(render.prose(f"{kernel}: {whose}" + (f"; {said[kernel]}" if kernel in said else ""), wide, indent="    ",
                           first="  ") for kernel, whose in kernels.items())]
