"""`commbench report RUN_DIR`: plots, a crossover table and one self-contained report.html."""

from __future__ import annotations

import argparse
import base64
import datetime
import html
import itertools
import json
import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Iterator, Sequence

from commbench.analysis import attribute_plots, plots, provenance, render, results_out
from commbench.analysis.fusion import COMPARISON_HEADERS, COMPARISON_NUMERIC, COMPARISON_TITLE, comparison_cells
from commbench.analysis.nccl_loaded import add_nccl, nccl_lines
from commbench.analysis.curves import (Crossover, Curve, baseline_curve, baseline_name, build_curves, cautions,
                              crossovers, groups, is_failed_check, price, ranking, run_world_size, select)
from commbench.errors import UsageError
from commbench.files import output_folder, staged_folder
from commbench.ops import ALLREDUCE
from commbench.results import CRASHED, HANG, OK, WRONG, Measurement, Run, RunDir, RunInfo, describe_setting, write_whole
from commbench.results.validate import file_stem
from commbench.fleet.inputs import is_whole_fleet, load_one
from commbench.analysis.render import fmt_num, fmt_us
from commbench.units import format_bytes

FUSION_NOTE = ("latency per call of the fused kernel and of unfused:best (the fastest measured allreduce, then "
               "torch's residual add and RMSNorm) on the same shape; saving > 0: fusion is faster")


@dataclass
class RangeRow:
    """One line of the crossover table: who wins a size range, by how much."""

    crossover: Crossover
    latency_us: tuple[float, float]           # the fastest's latency over the range, lowest and highest
    runner_up: str | None
    margin_x: tuple[float, float] | None      # runner-up latency / winner latency, min and max over the range
    vs_baseline_x: tuple[float, float] | None  # baseline latency / winner latency


def _span(values: list[float]) -> tuple[float, float] | None:
    return (min(values), max(values)) if values else None


def range_rows(curves: list[Curve], baseline: str | None) -> list[RangeRow]:
    out = []
    for cross in crossovers(curves):
        sizes = sorted({s for c in curves for s in c.sizes() if cross.first_bytes <= s <= cross.last_bytes})
        margins, versus, runner = [], [], None
        firsts: list[float] = []
        for size in sizes:
            ranked = ranking(curves, size)
            win = ranked[0]
            firsts.append(win.point.latency_us)
            if len(ranked) > 1:
                runner = runner or ranked[1].curve.label
                margins.append(ranked[1].point.latency_us / win.point.latency_us)
            base = baseline_curve(curves, baseline, win.curve)
            base_point = price(base, size).point if base is not None else None
            if base_point is not None:
                versus.append(base_point.latency_us / win.point.latency_us)
        out.append(RangeRow(cross, (min(firsts), max(firsts)), runner, _span(margins), _span(versus)))
    return out


def _x(span: tuple[float, float] | None) -> str:
    if span is None:
        return "-"
    lo, hi = span
    return f"{lo:.2f}x" if abs(hi - lo) < 0.005 else f"{lo:.2f}-{hi:.2f}x"


def _range_text(c: Crossover) -> str:
    if c.first_bytes == c.last_bytes:
        return format_bytes(c.first_bytes)
    return f"{format_bytes(c.first_bytes)}-{format_bytes(c.last_bytes)}"


# ---------------------------------------------------------------- HTML

_CSS = """
body { font-family: system-ui, -apple-system, Segoe UI, sans-serif; margin: 2em auto; max-width: 1250px;
       color: #222; line-height: 1.4; padding: 0 1em; }
h1 { font-size: 1.5em; margin-bottom: 0.2em; } h2 { margin-top: 1.6em; border-bottom: 1px solid #ddd; }
table { border-collapse: collapse; margin: 0.6em 0; font-size: 0.86em; }
th, td { border: 1px solid #ddd; padding: 3px 8px; text-align: left; vertical-align: top; }
th { background: #f4f4f4; position: sticky; top: 0; }
td.n { text-align: right; font-variant-numeric: tabular-nums; white-space: nowrap; }
.wide { overflow-x: auto; } .wide td:last-child { min-width: 16em; }
.sub { color: #666; font-size: 0.85em; font-weight: normal; }
tr.bad td { background: #fde2e1; color: #a40000; font-weight: 600; }
tr.muted td { color: #888; }
.meta { color: #555; } .note { color: #555; font-size: 0.9em; } .caution { color: #a40000; font-weight: 600; }
img { max-width: 100%; border: 1px solid #eee; margin: 0.5em 0; }
code, pre { background: #f6f6f6; padding: 1px 4px; } pre { padding: 0.6em; overflow-x: auto; font-size: 0.8em; }
"""


def _esc(value: Any) -> str:
    return html.escape("" if value is None else str(value))


def _thead(headers: list[str] | None) -> str:
    head = "".join(f"<th>{_esc(h)}</th>" for h in headers) if headers else ""
    return f"<table><thead><tr>{head}</tr></thead><tbody>" if head else "<table><tbody>"


def _tr(row: list[str], cls: str | None, numeric: tuple[int, ...]) -> str:
    cells = "".join(f'<td class="n">{c}</td>' if j in numeric else f"<td>{c}</td>" for j, c in enumerate(row))
    return f'<tr class="{cls}">{cells}</tr>' if cls else f"<tr>{cells}</tr>"


def _table(headers: list[str] | None, rows: list[list[str]], classes: list[str] | None = None,
           numeric: tuple[int, ...] = ()) -> str:
    """Cells are already escaped by the caller; headers None = a key/value table without a header."""
    body = "".join(_tr(row, classes[i] if classes else None, numeric) for i, row in enumerate(rows))
    return f"{_thead(headers)}{body}</tbody></table>"


def _img(png: Path, alt: str) -> str:
    data = base64.b64encode(png.read_bytes()).decode("ascii")
    svg = png.with_suffix(".svg").name
    return (f'<img alt="{_esc(alt)}" src="data:image/png;base64,{data}">'
            f'<div class="note">vector version: <code>plots/{_esc(svg)}</code></div>')


def _row_class(row: Measurement) -> str:
    if is_failed_check(row):
        return "bad"
    return "" if row.status == OK else "muted"


def _variant_cell(row: Measurement) -> str:
    """Backend name, with its process-level settings and a fused op under it in small print: one
    narrow column instead of three, so the reasons fit on a page."""
    under = [" ".join(f"{k}={v}" for k, v in sorted(row.env_setting.items()))] if row.env_setting else []
    under += [row.op] if row.op != ALLREDUCE else []
    return _esc(row.backend) + "".join(f'<br><span class="sub">{_esc(text)}</span>' for text in under)


def _measurement_order(row: Measurement) -> tuple[Any, ...]:
    return (row.dtype, row.mode, row.backend, sorted(row.env_setting.items()), row.op, row.message_bytes)


def measurement_table(rows: Sequence[Measurement]) -> Iterator[str]:
    """The table of every row, as HTML pieces made one row at a time: a run of 10^5 rows and more
    (a long resumed sweep, an import) is never held as row objects or as one string of HTML."""
    order = sorted(range(len(rows)), key=lambda i: _measurement_order(rows[i]))
    yield _thead(["backend", "mode", "dtype", "size", "status", "latency us", "jitter p10-p90 us", "jitter p99 us",
                  "busbw GB/s", "#wrong", "reason / note"])
    for i in order:
        r = rows[i]
        band = (f"{fmt_us(r.jitter_p10_us)}-{fmt_us(r.jitter_p90_us)}"
                if r.jitter_p10_us is not None and r.jitter_p90_us is not None else "-")
        wrong = "-" if r.wrong_elements is None else f"{r.wrong_elements}" + (f" ({r.wrong_kind})" if r.wrong_kind else "")
        notes = [r.reason] if r.reason else []
        if r.setting_applied == "ignored":
            notes.append(f"used {describe_setting(r.observed)}, not the requested {describe_setting(r.requested)}")
        if r.unsafe:
            notes.append(f"unsafe: {r.unsafe}")
        cells = [_variant_cell(r)] + [_esc(c) for c in (
            r.mode, r.dtype, format_bytes(r.message_bytes), r.status, fmt_us(r.latency_us), band,
            fmt_us(r.jitter_p99_us), fmt_num(r.busbw_gbps), wrong, "; ".join(notes))]
        yield _tr(cells, _row_class(r), numeric=(3, 5, 6, 7, 8))
    yield "</tbody></table>"


@dataclass
class RowFacts:
    """What the report says of the rows as a whole, gathered in one pass over them (each pass
    over a run of 10^5 rows costs about a second)."""

    counts: dict[str, int]               # status -> rows
    failed: list[Measurement]            # rows that failed their check
    statuses: dict[str, set[str]]        # backend -> the statuses of its rows
    nccl: dict[str, dict[str, list[str]]]   # as nccl_versions

    @classmethod
    def of(cls, rows: Iterable[Measurement]) -> "RowFacts":
        facts = cls({}, [], {}, {})
        for row in rows:
            facts.counts[row.status] = facts.counts.get(row.status, 0) + 1
            if is_failed_check(row):
                facts.failed.append(row)
            facts.statuses.setdefault(row.backend, set()).add(row.status)
            add_nccl(facts.nccl, row)
        return facts

    @property
    def status_text(self) -> str:
        return ", ".join(f"{n} {s}" for s, n in sorted(self.counts.items())) or "no rows"


def nccl_version_table(entries: dict[str, dict[str, list[str]]]) -> str:
    if not entries:
        return '<p class="note">No row recorded the NCCL its process ran.</p>'
    return _table(["variant", "NCCL loaded (ncclGetVersion)", "library file"],
                  [[_esc(label), _esc(", ".join(e["versions"]) or "?"), _esc(", ".join(e["libraries"]) or "?")]
                   for label, e in sorted(entries.items())])


def verdict_table(run: Run, statuses: dict[str, set[str]]) -> str:
    verdicts: dict[str, Any] = run.info.verdicts or {}
    names = sorted(set(verdicts) | set(statuses))
    if not names:
        return '<p class="note">run.json holds no probe verdicts and the run has no rows.</p>'
    rows, classes = [], []
    for name in names:
        reason = verdicts.get(name)
        verdict = ("eligible" if reason is None else reason) if name in verdicts else "not in run.json"
        seen = ", ".join(sorted(statuses.get(name, set()))) or "no rows"
        rows.append([_esc(name), _esc(verdict), _esc(seen)])
        classes.append("bad" if statuses.get(name, set()) & {WRONG, HANG, CRASHED} else
                       ("muted" if reason is not None else ""))
    return _table(["backend", "probe verdict", "row statuses"], rows, classes)


def _when(value: Any) -> Any:
    """run.json times are epoch seconds (or already text): show them as UTC."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return datetime.datetime.fromtimestamp(value, datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")
    return value


def command_text(command: Any) -> str | None:
    """run.json's command as a user would type it: the interpreter's path dropped, commbench's
    entry point (a path to its __main__.py or its script) shown as `commbench`."""
    if not isinstance(command, list) or not command:
        return None if command is None else str(command)
    words = [str(w) for w in command]
    if Path(words[0]).name.startswith("python") and len(words) > 1:
        words = (["python"] if words[1] == "-m" else []) + words[1:]
    first = Path(words[0])
    if first.name == "__main__.py" and first.parent.name == "commbench":
        words[0] = "commbench"
    elif words[0] != "python":
        words[0] = first.name            # /usr/local/bin/torchrun -> torchrun
    return shlex.join(words)


def run_state(info: RunInfo) -> str | None:
    """None for a finished run; otherwise how it ended, for every place that shows the run."""
    if info.finished:
        return None
    if info.interrupted:
        return f"interrupted at {_when(info.interrupted)} (partial run; --resume continues it)"
    return "unfinished: it hung, was killed or is still running (partial run; --resume continues it)"


def run_summary(run: Run) -> str:
    info = run.info
    gpu_names: dict[str, int] = {}
    for gpu in info.gpus or []:
        name = (gpu.get("name") or gpu.get("device") or "?") if isinstance(gpu, dict) else str(gpu)
        gpu_names[str(name)] = gpu_names.get(str(name), 0) + 1
    items = [
        ("run id", run.run_id), ("host", info.host),
        ("devices", ", ".join(f"{n}x {name}" for name, n in gpu_names.items()) or "none recorded"),
        ("world size", run_world_size(run)), ("nodes", info.nodes),
        ("started", _when(info.started)),
        ("finished", run_state(info) or _when(info.finished)),
        ("command", command_text(info.command)),
    ]
    items += [("note", note) for note in ([info.note] if info.note else []) + list(info.notes or [])]
    rows = [[_esc(k), _esc(v)] for k, v in items if v is not None]
    for section, values in (("versions", info.versions), ("env", info.env)):
        if values:
            rows.append([_esc(section), _esc(", ".join(f"{k}={v}" for k, v in sorted(values.items())))])
    out = _table(None, rows)
    for title, value in (("sweep arguments", info.args), ("sweep plan", info.plan), ("probe snapshot", info.snapshot)):
        if value:
            text = json.dumps(value, indent=2, sort_keys=True, default=str)
            out += f"<details><summary>{title} (JSON)</summary><pre>{_esc(text)}</pre></details>"
    if not info.snapshot:
        out += '<p class="note">No probe snapshot in run.json (run <code>commbench probe</code> on the machine).</p>'
    return out


@dataclass
class Section:
    title: str            # "bf16, graph mode", plus world size and emulation where the run has several
    curves: list[Curve]
    ranges: list[RangeRow]
    cautions: list[str]   # winners here that failed their check at some size


def build_sections(failed: list[Measurement], curves: list[Curve], baseline: str | None) -> list[Section]:
    """One section per group of curves whose winners may be compared (`failed`: the rows that
    failed their check, for the cautions)."""
    found = groups(curves)
    out = []
    for group in found:
        members = group.members(curves)
        ranges = range_rows(members, baseline)
        by_label = {c.label: c for c in members}
        title = f"{group.dtype}, {group.mode} mode"
        if len({g.world_size for g in found}) > 1:
            title += f", {group.world_size} ranks"
        if len({g.emulation for g in found}) > 1:
            title += f", {group.emulation or 'real GPUs'}"
        out.append(Section(title, members, ranges,
                           cautions(failed, [by_label[r.crossover.winner] for r in ranges
                                             if r.crossover.winner in by_label])))
    return out


def _latency(r: RangeRow) -> str:
    lo, hi = r.latency_us   # ascending, whichever end of the range is faster
    return fmt_us(lo) if fmt_us(lo) == fmt_us(hi) else f"{fmt_us(lo)}-{fmt_us(hi)}"


def crossover_cells(section: Section | SectionResult, baseline: str | None) -> tuple[list[str], list[list[str]]]:
    """The crossover table's headers and rows; the baseline column only where it says something."""
    headers = ["sizes", "winner", "measured sizes", "fastest latency us", "runner-up (first size)",
               "margin over runner-up"]
    rows = [[_range_text(r.crossover), r.crossover.winner, str(r.crossover.sizes), _latency(r), r.runner_up or "-",
             _x(r.margin_x)] for r in section.ranges]
    if baseline and any(r.vs_baseline_x for r in section.ranges):
        headers.append(f"vs {baseline}")
        for row, r in zip(rows, section.ranges):
            row.append(_x(r.vs_baseline_x))
    return headers, rows


def crossover_html(section: Section, baseline: str | None) -> str:
    headers, rows = crossover_cells(section, baseline)
    return _table(headers, [[_esc(c) for c in row] for row in rows], numeric=(2, 3, 5, 6))


def write_html(run: Run, facts: RowFacts, sections: list[Section], fused: list[list[str]],
               images: dict[str, list[tuple[Path, str]]], baseline: str | None, path: Path,
               trace: tuple[str, list[tuple[Path, str]]] = ("", [])) -> None:
    failed = facts.failed
    parts = [f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>commbench report: "
             f"{_esc(run.run_id)}</title><style>{_CSS}</style></head><body>",
             f"<p class='provenance'><b>{_esc(provenance.describe(run))}</b></p>",
             f"<h1>commbench report: {_esc(run.run_id)}</h1>",
             f"<p class='meta'>{_esc(run.info.host or '')} &middot; world size {_esc(run_world_size(run))} "
             f"&middot; rows: {_esc(facts.status_text)}</p>"]
    if run_state(run.info):
        parts.append(f"<p><b>Run {_esc(run_state(run.info))}.</b></p>")
    if failed:
        names = sorted({r.backend for r in failed})
        parts.append(f"<p><b style='color:#a40000'>{len(failed)} measurement(s) failed their check "
                     f"(wrong data, hang or crash): {_esc(', '.join(names))}.</b> They are red below and never "
                     f"count as winners.</p>")
    parts.append("<p class='note'>Winners are chosen on the headline latency (loop total / calls, slowest rank) "
                 "among rows with status ok and #wrong 0, "
                 "within one dtype and one timing mode (CUDA graph solid, eager dashed in the plots). "
                 f"Speedups are over {_esc(baseline or 'no baseline (neither nccl nor gloo ran)')}.</p>")
    for section in sections:
        parts.append(f"<h2>{_esc(section.title)}: which backend wins where</h2>")
        parts.append(crossover_html(section, baseline) if section.ranges else "<p>No trusted rows.</p>")
        parts.extend(f"<p class='caution'>caution: {_esc(line)}</p>" for line in section.cautions)
    if fused:
        parts.append(f"<h2>{_esc(COMPARISON_TITLE)}</h2>")
        parts.append(f"<p class='note'>{_esc(FUSION_NOTE)}</p>")
        parts.append(_table(COMPARISON_HEADERS, [[_esc(c) for c in cells] for cells in fused],
                            numeric=COMPARISON_NUMERIC))
    for title, imgs in images.items():
        parts.append(f"<h2>Plots: {_esc(title)}</h2>")
        parts.extend(_img(png, alt) for png, alt in imgs)
    parts.extend([trace[0], *(_img(png, alt) for png, alt in trace[1])])
    parts.append("<h2>Backends and probe verdicts</h2>")
    parts.append(verdict_table(run, facts.statuses))
    parts.append("<h2>NCCL each variant ran</h2>")
    parts.append("<p class='note'>As the library mapped into each process reports itself; a variant run with "
                 "<code>--nccl-lib</code> is its own curve above (<code>nccl:...,lib=LABEL</code>).</p>")
    parts.append(nccl_version_table(facts.nccl))
    parts.append("<h2>All measurements</h2>")
    parts.append("<p class='note'>Red: wrong data, hang or crash. Grey: skipped, error or no work.</p>")
    ending = ["</div>", "<h2>Run</h2>", run_summary(run), "</body></html>"]
    # Replaces a symlink at report.html, never follows it; the table of every row is written as
    # it is made.
    write_whole(path, itertools.chain(("\n".join(parts), "\n<div class='wide'>"), measurement_table(run.rows),
                                      ("\n".join(ending),)))


@dataclass(frozen=True)
class SectionResult:
    title: str
    ranges: tuple[RangeRow, ...]
    cautions: tuple[str, ...]


@dataclass(frozen=True)
class ReportResult:
    """What `report` says of a run (its text; --json is dataclasses.asdict of this). The page and
    plots it writes to --out are drawn from the same sections."""

    provenance: dict[str, Any]
    described: str
    run_id: str
    statuses: str                       # rows per status
    state: str | None                   # a run that did not finish: how far it got
    baseline: str | None
    sections: tuple[SectionResult, ...]
    fused: tuple[tuple[str, ...], ...]  # the fused vs unfused table's rows, as printed
    nccl: tuple[str, ...]               # the NCCL each variant ran
    failed_rows: int
    failed: tuple[str, ...]             # 'backend size status' of the rows that failed their check


def text(result: ReportResult, wide: bool) -> str:
    lines = [render.prose(result.described, wide),   # says "emulated: ..." for ranks that shared GPUs
             f"run {result.run_id}: {result.statuses}" + (f"; {result.state}" if result.state else "")]
    for section in result.sections:
        lines.append("\n" + render.prose(f"{section.title}: winner per size range (trusted rows only; margins are "
                                         "latency ratios)", wide))
        headers, rows = crossover_cells(section, result.baseline)
        lines.append(render.table(headers, rows, right=tuple(i for i in (2, 3, 5, 6) if i < len(headers)),
                                  wide=wide))
        lines += [render.prose(f"caution: {line}", wide) for line in section.cautions]
    if result.fused:
        lines.append("\n" + render.prose(f"{COMPARISON_TITLE} ({FUSION_NOTE})", wide))
        lines.append(render.table(COMPARISON_HEADERS, [list(r) for r in result.fused], right=COMPARISON_NUMERIC,
                                  wide=wide))
    if result.nccl:
        lines.append("\nNCCL each variant ran (ncclGetVersion of the library in its process):")
        lines += [render.prose(line, wide, indent="    ", first="  ") for line in result.nccl]
    if result.failed_rows:
        lines.append("\n" + render.prose(
            f"{result.failed_rows} row(s) failed their check (wrong data, hang or crash), excluded from winners: "
            + ", ".join(result.failed), wide))
    return "\n".join(lines)


# ---------------------------------------------------------------- command

def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run_dir", help="results dir written by commbench sweep; a fleet: its fleet.html page "
                        "(FLEET#NODE: that run's report)")
    parser.add_argument("--out", type=Path, help="where to write report.html and plots/ (default: a new folder "
                                                 "RUN-report in the current directory; never the run dir)")
    parser.add_argument("--baseline", help="backend speedups are measured against (default: nccl, else gloo)")
    parser.add_argument("--json", metavar="FILE", help="also write what the text says as JSON ('-' for stdout: "
                                                       "JSON alone)")
    render.add_arguments(parser)
    attribute_plots.add_arguments(parser)


def main(args: argparse.Namespace, argv: Sequence[str] = ()) -> int:
    if is_whole_fleet(args.run_dir):
        if args.json is not None:
            raise UsageError("--json: a fleet's report is its page (commbench fleet qualify FLEET --json F has "
                             "every node's checks)")
        from commbench.fleet import page

        return page.main(args)
    results_out.check_targets(args)
    run = load_one(args.run_dir)
    if not run.rows:
        raise UsageError(f"{run.path}: no measurements yet (measurements.jsonl is empty or missing)")
    out = output_folder(args.out, f"{run.path.resolve().name}-report", [run.path])
    facts = RowFacts.of(run.rows)
    curves = build_curves(run.rows)
    baseline = baseline_name(curves, args.baseline)   # a baseline the run lacks: nothing written yet
    world = run_world_size(run)
    sections = build_sections(facts.failed, curves, baseline)

    images: dict[str, list[tuple[Path, str]]] = {}
    written: list[Path] = []
    # Built beside the target and moved into it at the end: a report that fails (a --trace of
    # another world size) leaves nothing behind.
    with staged_folder(out) as work:
        plot_dir = RunDir(work).subdir("plots")
        for dtype in sorted({c.key.dtype for c in curves} | {r.dtype for r in facts.failed}):
            typed = select(curves, dtype=dtype)
            failed = [r for r in facts.failed if r.dtype == dtype]
            where = f"{dtype}, {world} ranks, {provenance.of(run).kind}, {run.info.host or run.path.name}"
            figs = [("latency", plots.latency_figure(typed, failed, f"allreduce latency vs size ({where})"))]
            if any(p.busbw_gbps for c in typed for p in c.points):
                figs.append(("busbw", plots.busbw_figure(typed, f"allreduce bus bandwidth ({where})")))
            if baseline and len({c.key.variant for c in typed}) > 1:
                figs.append(("speedup", plots.speedup_figure(typed, baseline, f"speedup over {baseline} ({where})")))
            for name, fig in figs:
                paths = plots.save(fig, plot_dir / f"{name}_{file_stem(dtype)}")   # the dtype is data
                written.extend(paths)
                images.setdefault(dtype, []).append((paths[0], f"{name} {dtype}"))
        fused = comparison_cells(run.rows)
        trace = attribute_plots.report_section(args, run, plot_dir)
        written.extend(path for png, _ in trace[1] for path in (png, png.with_suffix(".svg")))
        write_html(run, facts, sections, fused, images, baseline, work / "report.html", trace)

    result = ReportResult(provenance.of(run).to_dict(), provenance.describe(run), run.run_id, facts.status_text,
                          run_state(run.info), baseline,
                          tuple(SectionResult(s.title, tuple(s.ranges), tuple(s.cautions)) for s in sections),
                          tuple(tuple(cells) for cells in fused), tuple(nccl_lines(facts.nccl)), len(facts.failed),
                          tuple(sorted({f'{r.backend} {format_bytes(r.message_bytes)} {r.status}'
                                        for r in facts.failed})))
    print(text(result, args.wide))
    results_out.write(args, result, f"report {run.run_id}")
    print(f"\nwrote {out / 'report.html'}")
    for path in written:
        print(f"wrote {out / path.relative_to(work)}")
    return 0
