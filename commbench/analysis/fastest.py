"""The fastest kernel measured at a size, whoever's it is: what headroom is measured against.

recommend's and floor's headroom and attribute's floor name it beside their own comparisons, so
that "a kernel like this would save X" never points at a slower kernel than one the same run
measured: ours (p2p), the engines' own kernels and their forced algorithms, the libraries. Whose
it is comes from what the run recorded: the implementation its rows name (the engines' kernels
record theirs), else its backend family, and which engine path, if any, runs it.
"""

from __future__ import annotations

from dataclasses import dataclass

from commbench import engines
from commbench.analysis.curves import Curve, ranking
from commbench.analysis.decide import EngineDecision, Price, recorded_settings
from commbench.models import Model
from commbench.analysis import render
from commbench.analysis.render import fmt_us
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


def fastest_lines(rows: tuple[FastestAt, ...], tag: str, wide: bool = False) -> list[str]:
    """Per concurrency: the fastest kernel measured at its decode size and whose it is, with each
    requested engine's best path there as a multiple of it."""
    lines = []
    for row in rows:
        top = row.fastest
        against = "; ".join(f"{p.curve} {fmt_us(p.latency_us)} = {p.latency_us / top.latency_us:.2f}x"
                            for p in row.engine_paths)
        lines.append(render.prose(
            f"at concurrency {row.concurrency} ({format_bytes(top.message_bytes)}): {top.curve} "
            f"{fmt_us(top.latency_us)} us{' (interpolated)' if top.interpolated else ''}: {top.whose}"
            + (f"; best engine path {against}" if against else ""), wide, indent="  "))
    if not lines:
        return []
    return ["\n" + render.prose(f"fastest kernel measured at each size, any backend ({tag}): what headroom is "
                                "measured against", wide), *lines]
