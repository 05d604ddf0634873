"""`commbench table RUN [RUN ...]`: several runs side by side as one markdown file.

Made for the same sweep at several world sizes (scripts/mps-reference.sh runs 2, 4 and 8
ranks): one table per (dtype, mode, world size) of plain allreduce, message size down, backend
across, each cell the headline ``latency_us`` and the jitter pass's p50 (the fastest correct one
per size in bold; a row that did not measure shows its status); then fused vs unfused per model
shape with the saving per call (commbench.analysis.fusion); then every backend that measured
nothing, with its first reason, so a refusal is part of the result.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

from commbench.analysis.fusion import COMPARISON_HEADERS, COMPARISON_TITLE, comparison_cells
from commbench.analysis.text import fmt_us
from commbench.errors import UsageError
from commbench.files import STDOUT, check_file_target
from commbench.results import OK, Measurement, Run, load_run
from commbench.units import format_bytes

HELP = "several runs (e.g. world sizes 2, 4, 8) side by side as markdown: latency per size and backend, fused saving"

GroupKey = tuple[str, str, int]      # dtype, mode, world size


@dataclass
class Table:
    title: str
    headers: list[str]
    rows: list[list[str]]


def md_escape(text: str) -> str:
    """Text from a run file as literal markdown: no cell break, no HTML."""
    return text.replace("|", "\\|").replace("<", "&lt;").replace(">", "&gt;")


def markdown(table: Table) -> str:
    lines = [f"### {md_escape(table.title)}", "", "| " + " | ".join(map(md_escape, table.headers)) + " |",
             "|" + "|".join(" --- " for _ in table.headers) + "|"]
    lines.extend("| " + " | ".join(map(md_escape, row)) + " |" for row in table.rows)
    return "\n".join(lines) + "\n"


def _cell(row: Measurement | None, best: bool) -> str:
    if row is None:
        return ""
    if row.status != OK or row.latency_us is None:
        return row.status
    text = f"{fmt_us(row.latency_us)} / {fmt_us(row.jitter_p50_us)}"
    return f"**{text}**" if best else text


def column_labels(runs: list[Run], columns: list[tuple[int, str]]) -> list[str]:
    """A header per (run index, backend) column: the backend, and where the same backend comes
    from several runs of one table, which run (its sweep's --out folder, else its run id), so a
    run with other options (e.g. PDL off) never fills another run's cells."""
    def run_name(index: int, siblings: list[int]) -> str:
        parents = [runs[i].path.parent.name for i in siblings]
        unique = parents.count(runs[index].path.parent.name) == 1
        return runs[index].path.parent.name if unique else runs[index].path.name

    labels = []
    for index, backend in columns:
        siblings = [i for i, b in columns if b == backend]
        labels.append(backend if len(siblings) == 1 else f"{backend} ({run_name(index, siblings)})")
    return labels


def allreduce_tables(runs: list[Run]) -> list[Table]:
    """One table per (dtype, mode, world size): sizes down, a column per backend and run."""
    groups: dict[GroupKey, list[tuple[int, Measurement]]] = {}
    for index, run in enumerate(runs):
        for row in run.rows:
            if row.op == "allreduce":
                groups.setdefault((row.dtype, row.mode, row.world_size), []).append((index, row))
    tables = []
    for (dtype, mode, world), members in sorted(groups.items(), key=lambda kv: (kv[0][0], kv[0][1], kv[0][2])):
        columns = list(dict.fromkeys((i, r.backend) for i, r in members))
        by_cell = {(r.message_bytes, i, r.backend): r for i, r in members}
        body = []
        for size in sorted({r.message_bytes for _, r in members}):
            measured = [(i, r) for i, r in members
                        if r.message_bytes == size and r.status == OK and r.latency_us is not None]
            fastest = None
            if measured:
                index, row = min(measured, key=lambda m: m[1].latency_us)   # type: ignore[arg-type, return-value]
                fastest = (index, row.backend)
            body.append([format_bytes(size)] + [_cell(by_cell.get((size, *column)), column == fastest)
                                                for column in columns])
        tables.append(Table(f"allreduce, {dtype}, {mode}, {world} ranks: latency_us / jitter p50 us",
                            ["size"] + column_labels(runs, columns), body))
    return tables


def fusion_table(rows: list[Measurement]) -> Table | None:
    """Fused vs unfused per model shape, every world size in one table."""
    cells = comparison_cells(rows)
    if not cells:
        return None
    return Table(f"{COMPARISON_TITLE}, latency_us per call", COMPARISON_HEADERS, cells)


def refusals(rows: list[Measurement]) -> list[str]:
    """'backend at N ranks: reason' for every backend and world size with no measured row."""
    out = []
    for backend, world in dict.fromkeys((r.backend, r.world_size) for r in rows):
        own = [r for r in rows if r.backend == backend and r.world_size == world]
        if not any(r.status == OK for r in own):
            first = next((r for r in own if r.reason), own[0])
            out.append(f"`{backend}` at {world} ranks: {first.status}: {first.reason or 'no reason recorded'}")
    return out


def render_runs(runs: list[Run]) -> str:
    rows = [row for run in runs for row in run.rows]
    parts = ["# commbench side by side", "",
             "Runs: " + ", ".join(f"`{run.path}`" for run in runs) + ".", ""]
    emulated = [run.emulation_line() for run in runs if run.emulation_line()]
    if emulated:
        parts += [f"> {line}" for line in dict.fromkeys(emulated)] + [""]
    parts += ["Cells: headline `latency_us` (one timer around the timed pass, slowest rank) / the jitter pass's "
              "p50; the fastest correct backend per size in bold; a status (skipped, hang, crashed, wrong, ...) "
              "where the row did not measure.", ""]
    parts += [markdown(t) for t in allreduce_tables(runs)]
    fused = fusion_table(rows)
    if fused is not None:
        parts += ["saving = unfused - fused per call (positive: fusion is faster); unfused = the run's fastest "
                  "correct plain allreduce at that size, then torch's add and RMSNorm in the same graph.", "",
                  markdown(fused)]
    refused = refusals(rows)
    if refused:
        parts += ["### Measured nothing, and why", ""] + [f"- {md_escape(line)}" for line in refused] + [""]
    return "\n".join(parts)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run_dirs", nargs="+", metavar="RUN", help="results dirs written by commbench sweep")
    parser.add_argument("--out", help="markdown file to write (default: stdout)")


def main(args: argparse.Namespace) -> int:
    check_file_target(args.out, "--out")
    if len(set(args.run_dirs)) != len(args.run_dirs):
        raise UsageError("a run dir is listed twice")
    runs = [load_run(path) for path in args.run_dirs]
    empty = [str(run.path) for run in runs if not run.rows]
    if empty:
        raise UsageError(f"{empty[0]}: no measurements yet (measurements.jsonl is empty or missing)")
    text = render_runs(runs)
    if args.out is None or args.out == STDOUT:
        print(text, end="")
    else:
        Path(args.out).write_text(text, encoding="utf-8")
        print(f"wrote {args.out}")
    return 0
