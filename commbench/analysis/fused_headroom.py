"""Headroom where an engine's default is a fused kernel: at each decode size where a requested
engine takes a fused path by default (an op other than a plain allreduce, e.g. FlashInfer's
allreduce + residual + RMSNorm fusion in vLLM and SGLang), the fastest row of that op at the
model's shape whose backend declares it a stand-in for that path (a kernel no engine runs), set
against the engine's fused default as its own kernel measured it in the same run. A fused time
includes the norm, so it is never set against a bare allreduce; the stand-in's settings select the
engine's kernel, not it, so it is never a setting either. Shared by recommend and floor; a run
without such a stand-in gives nothing here, and its outputs say nothing new.
"""

from __future__ import annotations

from commbench import engines
from commbench.analysis import render
from commbench.analysis.curves import Curve, ranking
from commbench.analysis.decide import (EngineDecision, Headroom, Price, measurable, most_saving, recorded_settings,
                                       saving)
from commbench.analysis.fastest import mode_suffix, whose
from commbench.analysis.render import fmt_num, fmt_us
from commbench.engines import paths as engine_paths
from commbench.engines.paths import PathState
from commbench.models import Model
from commbench.ops import ALLREDUCE
from commbench.results import Run
from commbench.units import format_bytes


def fused_defaults(d: EngineDecision, message_bytes: int) -> list[PathState]:
    """The paths of ops other than a plain allreduce that the engine takes by default at this size
    (its default for each such op of its rules, where that default is a path of the op)."""
    ops = dict.fromkeys(s.rule.op for s in d.states if s.rule.op != ALLREDUCE)
    found = (engine_paths.default_path(d.states, message_bytes, op) for op in ops)
    return [f.path for f in found if f.path is not None and f.path.rule.op in ops]


def _stands_in(run: Run, curve: Curve, engine: str, path: str) -> bool:
    settings = recorded_settings(run, curve)
    claim = engines.declared_paths(settings).get(engine) if settings is not None else None
    return bool(claim and claim["path"] == path and claim.get("stand_in"))


def _own_price(d: EngineDecision, state: PathState, message_bytes: int) -> Price | None:
    """The engine's fused default at this size, priced by its own kernel (never a stand-in)."""
    option = next((o for o in d.options if o.state is state and o.plain), None)
    price = option.price(message_bytes) if option is not None else None
    return price if price is not None and not price.stand_in else None


def headroom(model: Model, run: Run, curves: list[Curve], decisions: list[EngineDecision],
             concurrencies: list[int]) -> list[Headroom]:
    """Per concurrency where a requested engine's default is a fused path: the fastest stand-in
    for it measured at that shape, against the fastest of those defaults measured by their own
    kernels (None where none was)."""
    out = []
    owners: dict[str, str] = {}     # whose() reads every row: once per curve
    for concurrency in concurrencies:
        size = model.message_bytes(concurrency)
        takers = [(d, s) for d in decisions for s in fused_defaults(d, size)]
        stand_ins = [c for c in curves if any(c.key.op == s.rule.op and _stands_in(run, c, d.key, s.path)
                                              for d, s in takers)]
        ranked = ranking(stand_ins, size)
        if not ranked:
            continue
        top = ranked[0]
        cost = Price.of(top)
        defaults = [p for p in (_own_price(d, s, size) for d, s in takers if top.curve.key.op == s.rule.op)
                    if p is not None]
        versus = min(defaults, key=lambda p: p.latency_us) if defaults else None
        gain = saving(model, concurrency, cost, versus)[0] if versus else None
        titles: dict[str, list[str]] = {}
        for d, s in takers:
            if s.rule.op == top.curve.key.op:
                titles.setdefault(s.rule.title, []).append(d.name)
        said = "; ".join(f"{' and '.join(names)} {'runs' if len(names) == 1 else 'run'} {title} by default here"
                         for title, names in titles.items())
        if top.curve.label not in owners:
            owners[top.curve.label] = whose(run, top.curve)
        out.append(Headroom(top.curve.label, f"{owners[top.curve.label]}; no engine runs it", concurrency, size,
                            cost, versus, gain, False, said))
    return out


def _sizes(concurrencies: list[int]) -> str:
    return "c=" + ", ".join(map(str, concurrencies))


def table(rooms: tuple[Headroom, ...] | list[Headroom], model: Model, tag: str, wide: bool = False) -> list[str]:
    """recommend's table: per size, the fused stand-in against the engines' fused default, the
    saving per step a kernel like it would bring; whose each kernel is and which engines run the
    fused path by default where, once each."""
    if not rooms:
        return []
    labels = [r.kernel for r in rooms] + [r.versus.curve for r in rooms if r.versus is not None]
    suffix = mode_suffix(labels)    # ' (graph allreduce_residual_rmsnorm)': said once, in the title
    cells = []
    for r in rooms:
        v, gain = r.versus, r.saving
        cells.append([f"c={r.concurrency} {format_bytes(r.message_bytes)}", r.kernel.removesuffix(suffix),
                      fmt_us(r.cost.latency_us) + ("~" if r.cost.interpolated else ""),
                      v.curve.removesuffix(suffix) if v else "not measured",
                      fmt_us(v.latency_us) + ("~" if v.interpolated else "") if v else "-",
                      f"{v.latency_us / r.cost.latency_us:.2f}x" if v else "-",
                      fmt_num(gain.per_step_ms) if measurable(gain) else "-"])
    defaults: dict[str, list[int]] = {}
    for r in rooms:
        defaults.setdefault(r.said, []).append(r.concurrency)
    timed = f"; {suffix[2:-1].split()[0]} mode" if suffix else ""
    return ["\n" + render.prose(
        f"fused allreduce + residual + RMSNorm at the model's shape (concurrency tokens x hidden {model.hidden}), "
        f"where an engine's default is a fused kernel ({tag}{timed}): the fastest stand-in measured (no engine runs "
        "it: headroom, for comparison only) against that default measured in this run; us per call, the norm "
        "included (never set against a bare allreduce), '~' interpolated, saved: the ms per step a kernel like it "
        "would save", wide),
        render.table(["size", "stand-in", "us", "engines' fused default", "us", "x", "saved"], cells,
                     right=(2, 4, 5, 6), wide=wide),
        *(render.prose(f"{kernel}: {why}", wide, indent="    ", first="  ")
          for kernel, why in dict((r.kernel, r.why) for r in rooms).items()),
        *(render.prose(f"{_sizes(sizes)}: {said}", wide, indent="    ", first="  ")
          for said, sizes in defaults.items())]


def brief_lines(rooms: tuple[Headroom, ...] | list[Headroom], wide: bool = False) -> list[str]:
    """recommend --brief: each fused stand-in with the most it would save at one size."""
    return [render.prose(f"{r.kernel}: would save {r.saving.per_call_us:.1f} us/call, "  # type: ignore[union-attr]
                         f"{r.saving.per_step_ms:.2f} ms/step at concurrency {r.concurrency} "  # type: ignore[union-attr]
                         f"({format_bytes(r.message_bytes)}) vs {r.versus.curve if r.versus else '-'}, the engines' "
                         "fused default (both times include the norm)", wide, indent="    ", first="  ")
            for r in most_saving(list(rooms))]
