"""`commbench compare RUN_A RUN_B`: what changed between two runs, per backend and size.

Both runs' provenance lines come first. Runs that are not one machine's (measured vs emulated
or a fixture, another host, other GPU models or count, another fabric or world size) are refused
with one line naming what differs, unless `--different-machines` is given.

For every curve (backend variant, mode, dtype, op: curves.key_of) and size both runs measured:
the change in the headline latency and in the jitter pass's p99, and whether the latency change
is larger than the p10-p90 spread of both runs (smaller changes are noise the runs themselves
show). Plus a plot of both curves and their ratio.

The terminal shows at most CHANGES_SHOWN changes: all of them when they fit, else those that
matter most (beyond the spread first, then the largest latency change), and says how many more
there are and which file holds every one (--json, or a JSON file in the --out folder). A run of
10^5 sizes is compared in the time it takes to read it, not to draw 10^5 table rows.

``--backend-a X --backend-b Y`` compares backend X of RUN_A with backend Y of RUN_B instead,
mode by mode; RUN_B may be RUN_A. That puts two NCCL versions of one run side by side
(``compare RUN RUN --backend-a nccl --backend-b nccl:lib=cu13-2.29.7``), and the NCCL each side's
processes ran is printed from the rows (extra.nccl_version_loaded).
"""

from __future__ import annotations

import argparse
import heapq
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Sequence

from commbench.analysis import plots, provenance, render, results_out
from commbench.analysis.curves import Curve, CurveKey, build_curves, counterpart, exceeds_spread, variant_label
from commbench.files import output_folder, staged_folder
from commbench.errors import UsageError
from commbench.results import Measurement, Run
from commbench.fleet.inputs import load_one
from commbench.analysis.nccl_loaded import nccl_version_lines
from commbench.analysis.render import fmt_pct, fmt_us
from commbench.units import format_bytes

CHANGES_SHOWN = 100   # table rows on the terminal; every change is in the JSON


@dataclass(frozen=True, slots=True)    # one per size both runs measured: 10^5 and more on a long sweep
class Change:
    curve: str
    dtype: str                     # bf16 and fp32 curves of one backend share its label
    message_bytes: int
    latency_a_us: float
    latency_b_us: float
    latency_change_pct: float
    p99_a_us: float | None
    p99_b_us: float | None
    p99_change_pct: float | None
    beyond_spread: bool | None     # None: a run recorded no p10/p90
    verdict: str                   # one of VERDICTS, from the two above: a field, so the JSON carries it


SLOWER, FASTER = "B slower", "B faster"
VERDICTS = ("spread unknown", "same (within spread)", SLOWER, FASTER)


def verdict(beyond_spread: bool | None, latency_a_us: float, latency_b_us: float) -> str:
    if beyond_spread is None:
        return VERDICTS[0]
    if not beyond_spread:
        return VERDICTS[1]
    return SLOWER if latency_b_us > latency_a_us else FASTER


def changes(a: list[Curve], b: list[Curve]) -> list[Change]:
    out = []
    for before in a:
        after = counterpart(before, b, a)
        if after is None:
            continue
        index_b = {size: i for i, size in enumerate(after.sizes())}   # a curve holds one point per size
        for pa in before.points:
            index = index_b.get(pa.message_bytes)
            if index is None:
                continue
            pb = after.points[index]
            p99 = (100.0 * (pb.p99_us - pa.p99_us) / pa.p99_us
                   if pa.p99_us is not None and pb.p99_us is not None and pa.p99_us > 0 else None)
            beyond = exceeds_spread(pb.latency_us - pa.latency_us, pa, pb)
            out.append(Change(before.label, before.key.dtype, pa.message_bytes, pa.latency_us, pb.latency_us,
                              100.0 * (pb.latency_us - pa.latency_us) / pa.latency_us, pa.p99_us, pb.p99_us, p99,
                              beyond, verdict(beyond, pa.latency_us, pb.latency_us)))
    return out


def shown(rows: list[Change], cap: int) -> list[list[Change]]:
    """The terminal's tables, one per curve and dtype: every change when they fit `cap`, in the
    runs' order; else the `cap` that matter most (beyond the spread first, then the largest
    latency change to 0.1%, then the runs' order), the table of the largest change first, each
    table in size order."""
    def weight(i: int) -> tuple[bool, float]:
        return rows[i].beyond_spread is True, round(abs(rows[i].latency_change_pct), 1)
    picked = rows if len(rows) <= cap else [rows[i] for i in sorted(heapq.nlargest(cap, range(len(rows)), key=weight))]
    groups: dict[tuple[str, str], list[Change]] = {}
    for c in picked:
        groups.setdefault((c.curve, c.dtype), []).append(c)
    tables = list(groups.values())
    if len(picked) < len(rows):
        tables.sort(key=lambda g: max(abs(c.latency_change_pct) for c in g), reverse=True)
    return tables


def _one_backend(curves: list[Curve], backend: str, run: Run) -> list[Curve]:
    """The curves of one backend, one per mode, dtype and op; `backend` is a variant name or,
    where the variant ran under several settings, its label with the setting (name[VAR=V])."""
    chosen = [c for c in curves if c.key.variant == backend] or [c for c in curves if c.backend == backend]
    if not chosen:
        names = ", ".join(sorted({c.key.variant for c in curves}))
        raise UsageError(f"{run.path}: no trusted rows of backend {backend!r} (it has: {names})")
    slots = [(c.key.mode, c.key.dtype, c.key.op) for c in chosen]
    if len(set(slots)) < len(slots):
        settings = sorted({c.key.variant for c in chosen})
        raise UsageError(f"{run.path}: backend {backend!r} ran under several settings; name one of them: "
                         f"{', '.join(settings)}")
    return chosen


def _rows_of(run: Run, backend: str | None) -> Iterable[Measurement]:
    """The rows _one_backend's curves come from (every row without --backend-a/-b), read from
    the run's compact rows as they are iterated: a list of them would hold a Measurement per row
    (0.9 KB each, where a compact row is 0.15 KB)."""
    if backend is None:
        return run.rows
    by_variant = any(variant_label(r) == backend for r in run.rows)
    return (r for r in run.rows if (variant_label(r) if by_variant else r.backend) == backend)


def paired(curves_a: list[Curve], curves_b: list[Curve], run_a: Run, run_b: Run, backend_a: str,
           backend_b: str) -> tuple[list[Curve], list[Curve]]:
    """Backend A of RUN_A and backend B of RUN_B under one name, so changes() pairs them."""
    label = f"{backend_a} -> {backend_b}"

    def renamed(curve: Curve) -> Curve:
        key = CurveKey(label, curve.key.mode, curve.key.dtype, curve.key.op)
        return Curve(key, curve.backend, dict(curve.env_setting), list(curve.points), curve.failed_sizes)

    return ([renamed(c) for c in _one_backend(curves_a, backend_a, run_a)],
            [renamed(c) for c in _one_backend(curves_b, backend_b, run_b)])


def _name(run: Run) -> str:
    return run.run_id


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run_a", help="the earlier / reference results dir (A), or a fleet's run as FLEET#NODE")
    parser.add_argument("run_b", help="the results dir to compare with it (B), or FLEET#NODE")
    parser.add_argument("--out", type=Path, help="where to write the plot (default: a new folder compare-A-vs-B in "
                                                 "the current directory; never a run dir)")
    parser.add_argument("--json", metavar="FILE", help="also write the changes as JSON ('-' for stdout)")
    parser.add_argument("--backend-a", metavar="NAME",
                        help="compare only this backend of RUN_A (with --backend-b; RUN_B may be RUN_A), e.g. nccl, "
                             "or nccl[VAR=V] where it ran under several --env settings")
    parser.add_argument("--backend-b", metavar="NAME",
                        help="...with this backend of RUN_B, e.g. nccl:lib=cu13-2.29.7 (another NCCL)")
    parser.add_argument("--different-machines", action="store_true",
                        help="compare runs that are not one machine's (other data kind, host, GPUs, fabric or "
                             "world size): without it such a comparison is refused")
    results_out.add_arguments(parser)
    render.add_arguments(parser)


@dataclass(frozen=True)
class CompareResult:
    """What `compare` answers; its JSON is dataclasses.asdict of this (docs/results.md), written a
    change at a time (a 200 MB run pair has 10^5 changes)."""

    provenance_a: dict[str, Any]
    provenance_b: dict[str, Any]
    different_machines: tuple[str, ...]    # what makes the runs not one machine's (with --different-machines)
    a: str                                 # the run id, and the backend with --backend-a
    b: str
    path_a: str
    path_b: str
    nccl_a: tuple[str, ...]                # the NCCL each side's processes ran (nccl_loaded)
    nccl_b: tuple[str, ...]
    only_a: tuple[str, ...]                # curves one run measured and the other did not
    only_b: tuple[str, ...]
    slower: int                            # changes B slower beyond the spread
    faster: int
    within_or_unknown: int
    all_changes_file: str | None           # where every change is when the terminal shows CHANGES_SHOWN
    changes: tuple[Change, ...]


@dataclass(frozen=True)
class Compared:
    """The result and what its plot draws: every point of both sides' curves."""

    result: CompareResult
    curves_a: list[Curve]
    curves_b: list[Curve]
    out: Path
    stem: Path


def compute(args: argparse.Namespace) -> Compared:
    run_a, run_b = load_one(args.run_a), load_one(args.run_b)
    origin_a, origin_b = provenance.of(run_a), provenance.of(run_b)
    differ = provenance.differences(origin_a, origin_b)
    if differ and not args.different_machines:
        raise UsageError(f"A and B are not one machine's runs ({'; '.join(differ)}): their latencies differ for "
                         f"that reason too; pass --different-machines to compare them anyway")
    out = output_folder(args.out, f"compare-{run_a.path.resolve().name}-vs-{run_b.path.resolve().name}",
                        [run_a.path, run_b.path])
    curves_a, curves_b = build_curves(run_a.rows), build_curves(run_b.rows)
    if not curves_a or not curves_b:
        empty = run_a if not curves_a else run_b
        raise UsageError(f"{empty.path}: no trusted (status ok, #wrong 0) rows to compare")
    backend_a, backend_b = getattr(args, "backend_a", None), getattr(args, "backend_b", None)
    if (backend_a is None) != (backend_b is None):
        raise UsageError("--backend-a and --backend-b go together: name the backend of each side")
    if backend_a is not None:
        curves_a, curves_b = paired(curves_a, curves_b, run_a, run_b, backend_a, backend_b)
    rows = changes(curves_a, curves_b)
    if not rows:
        raise UsageError("the two runs share no backend, mode, dtype and size to compare")
    name_a, name_b = _name(run_a), _name(run_b)
    if backend_a is not None:
        name_a, name_b = f"{name_a} {backend_a}", f"{name_b} {backend_b}"
    stem = out / f"compare_{run_a.path.resolve().name}_vs_{run_b.path.resolve().name}"
    if backend_a is not None:
        # no dots: the plot's suffix is added to the stem (2.29.7 would lose its ".7")
        stem = stem.with_name(stem.name + "_" + re.sub(r"[^\w=-]+", "_", f"{backend_a}_vs_{backend_b}"))
    every = None
    if len(rows) > CHANGES_SHOWN:
        every = args.json if args.json not in (None, "-") else str(stem.with_name(stem.name + "_changes.json"))
    names_a, names_b = {plots.curve_name(c) for c in curves_a}, {plots.curve_name(c) for c in curves_b}
    slower = sum(c.verdict == SLOWER for c in rows)
    faster = sum(c.verdict == FASTER for c in rows)
    result = CompareResult(
        origin_a.to_dict(), origin_b.to_dict(), tuple(differ), name_a, name_b, str(run_a.path), str(run_b.path),
        tuple(nccl_version_lines(_rows_of(run_a, backend_a))), tuple(nccl_version_lines(_rows_of(run_b, backend_b))),
        tuple(sorted(names_a - names_b)), tuple(sorted(names_b - names_a)), slower, faster,
        len(rows) - slower - faster, every, tuple(rows))
    return Compared(result, curves_a, curves_b, out, stem)


def text(result: CompareResult, wide: bool) -> str:
    """The terminal's answer: both runs, the changes that fit CHANGES_SHOWN, the counts."""
    out = [render.prose(f"A: {result.provenance_a['line']}", wide),
           render.prose(f"B: {result.provenance_b['line']}", wide)]
    if result.different_machines:
        out.append(f"note: A and B are not one machine's runs ({'; '.join(result.different_machines)}): a change "
                   "below is partly the machines' difference, not a before/after of one setting")
    out.append(render.prose(f"A = {result.a} ({result.path_a}), B = {result.b} ({result.path_b})", wide))
    out += [f"{side} ran {line}" for side, lines in (("A", result.nccl_a), ("B", result.nccl_b)) for line in lines]
    out += [f"only in {side}: {', '.join(names)}" for side, names in (("A", result.only_a), ("B", result.only_b))
            if names]
    out.append(render.prose("'beyond spread' = the latency change is larger than the jitter p10-p90 spread of both "
                            "runs", wide) + "\n")
    tables = shown(list(result.changes), CHANGES_SHOWN)
    # One table per backend and dtype under its name: the backend spec is never folded in a column.
    for changed in tables:
        out.append(f"{changed[0].curve}, {changed[0].dtype}")
        out.append(render.table(["size", "latency A us", "latency B us", "change", "p99 A us", "p99 B us",
                                 "p99 change", "verdict"],
                                [[format_bytes(c.message_bytes), fmt_us(c.latency_a_us), fmt_us(c.latency_b_us),
                                  fmt_pct(c.latency_change_pct), fmt_us(c.p99_a_us), fmt_us(c.p99_b_us),
                                  fmt_pct(c.p99_change_pct), c.verdict] for c in changed],
                                right=(0, 1, 2, 3, 4, 5, 6), wide=wide) + "\n")
    total = len(result.changes)
    out.append(f"\n{result.slower} slower and {result.faster} faster beyond spread, {result.within_or_unknown} "
               f"within spread or unknown, of {total} points")
    kept = sum(len(t) for t in tables)
    if result.all_changes_file is not None:
        out.append(render.prose(f"shown: the {kept} changes that matter most (beyond spread first, then the "
                                f"largest); {total - kept} more, all {total} in {result.all_changes_file}", wide))
    return "\n".join(out)


def main(args: argparse.Namespace, argv: Sequence[str] = ()) -> int:
    results_out.check_targets(args)
    compared = compute(args)
    result, out = compared.result, compared.out

    # Built beside --out and moved into it at the end: a compare that fails leaves nothing behind.
    with staged_folder(out) as work:
        def staged(path: Path) -> Path:
            return work / path.relative_to(out) if path.is_relative_to(out) else path

        if result.all_changes_file is not None and result.all_changes_file != args.json:
            results_out.write_json(str(staged(Path(result.all_changes_file))), result, stream="changes")
        fig = plots.compare_figure(compared.curves_a, compared.curves_b, result.a, result.b,
                                   f"allreduce latency: A = {result.a} vs B = {result.b}")
        saved = plots.save(fig, staged(compared.stem))
    print(text(result, args.wide))
    for path in saved:
        print(f"wrote {out / path.relative_to(work)}")
    results_out.write(args, result, f"compare {result.a} vs {result.b}", stream="changes")   # a change at a time
    return 0
