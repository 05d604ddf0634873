"""`commbench table RUN [RUN ...]`: several runs side by side, as tables folded to the terminal,
or as one markdown file (--out FILE.md, or --markdown on standard output).

Made for the same sweep at several world sizes (scripts/mps-reference.sh runs 2, 4 and 8
ranks): one table per (dtype, mode, world size) of plain allreduce, message size down, backend
across, each cell the headline ``latency_us`` and the jitter pass's p50 (the fastest correct one
per size in bold; a row that did not measure shows its status); then fused vs unfused per model
shape with the saving per call (commbench.analysis.fusion); then every backend that measured
nothing, with its first reason, so a refusal is part of the result.
"""

from __future__ import annotations

import argparse
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator, Sequence

from commbench.analysis.fusion import COMPARISON_HEADERS, COMPARISON_TITLE, comparison_cells
from commbench.analysis import provenance, render, results_out
from commbench.analysis.curves import CurveKey, distinguish, emulation_text, key_of
from commbench.analysis.render import fmt_us
from commbench.errors import UsageError
from commbench.files import STDOUT, check_file_target, naming
from commbench.ops import ALLREDUCE
from commbench.results import OK, Measurement, Run
from commbench.results.text import clean_text
from commbench.fleet.inputs import load_runs
from commbench.units import format_bytes


GroupKey = tuple[str, str, int, str]      # dtype, mode, world size, emulation_text or ""


@dataclass(frozen=True)
class Table:
    title: str
    headers: list[str]
    rows: list[list[str]]


_MARKUP_RE = re.compile(r"[\\`#|]|\](?=\()")   # code spans, headings, cell breaks, the "](" of a link or image


def md_escape(text: str) -> str:
    """Text from a run file as literal markdown: one line, no cell break, no HTML, no link,
    image, code span or heading of its own (emphasis marks are left: they hide and link nothing)."""
    return _MARKUP_RE.sub(lambda m: "\\" + m.group(0), clean_text(text)).replace("<", "&lt;").replace(">", "&gt;")


def markdown(table: Table) -> str:
    lines = [f"### {md_escape(table.title)}", "", "| " + " | ".join(map(md_escape, table.headers)) + " |",
             "|" + "|".join(" --- " for _ in table.headers) + "|"]
    lines.extend("| " + " | ".join(map(md_escape, row)) + " |" for row in table.rows)
    return "\n".join(lines) + "\n"


BEST_MARK = "* "   # the terminal's mark for markdown's bold: the fastest correct cell of a size


def _terminal_cell(cell: str) -> str:
    text = clean_text(cell)
    return BEST_MARK + text[2:-2] if text.startswith("**") and text.endswith("**") else text


def render_text(result: TableResult, wide: bool = False) -> str:
    """The same tables for a terminal: each folded to its width (a row too wide becomes a record),
    the fastest correct cell of a size marked '*'; every text from a run file cleaned."""
    out = [render.prose(f"{clean_text(what)}; run{'s' if len(ids) > 1 else ''} {clean_text(', '.join(ids))}",
                        wide) for what, ids in result.machines.items()]
    out.append(render.prose("cells: headline latency_us (one timer around the timed pass, slowest rank) / the jitter "
                            "pass's p50; '*' the fastest correct backend per size; a status (skipped, hang, crashed, "
                            "wrong, ...) where the row did not measure; markdown: --markdown or --out FILE.md", wide))
    for table in [*result.allreduce, *([result.fused] if result.fused is not None else [])]:
        rows = [[_terminal_cell(c) for c in row] for row in table.rows]
        out += ["", render.table([clean_text(h) for h in table.headers], rows, right=range(1, len(table.headers)),
                                 title=clean_text(table.title), wide=wide)]
    if result.fused is not None:
        out.append(render.prose("saving = unfused - fused per call (positive: fusion is faster); unfused = the run's "
                                "fastest correct plain allreduce at that size, then torch's add and RMSNorm in the same "
                                "graph.", wide))
    if result.refused:
        out += ["", "measured nothing, and why:"]
        out += [render.prose(clean_text(line.replace("`", "").replace("\\", "")), wide, indent="    ", first="  - ")
                for line in result.refused]
    return "\n".join(out)


def _cell(row: Measurement | None, best: bool) -> str:
    if row is None:
        return ""
    if row.status != OK or row.latency_us is None:
        return row.status
    text = f"{fmt_us(row.latency_us)} / {fmt_us(row.jitter_p50_us)}"
    return f"**{text}**" if best else text


Column = tuple[int, CurveKey]       # run index, the experiment (key_of the row)


def column_labels(runs: list[Run], columns: list[Column]) -> list[str]:
    """A header per column: the variant (backend and its settings), what else sets it apart from
    another column of the same variant (loaded NCCL, ...), and where the same label comes from
    several runs, which run (its sweep's --out folder, else its run id), so a run with other
    options (e.g. PDL off) never fills another run's cells."""
    named = distinguish(key for _, key in columns)

    def run_name(index: int, siblings: list[int]) -> str:
        parents = [runs[i].path.parent.name for i in siblings]
        unique = parents.count(runs[index].path.parent.name) == 1
        return runs[index].path.parent.name if unique else runs[index].path.name

    names = [named[key].name for _, key in columns]
    labels = []
    for (index, _), name in zip(columns, names):
        siblings = [i for (i, _), other in zip(columns, names) if other == name]
        labels.append(name if len(siblings) == 1 else f"{name} ({run_name(index, siblings)})")
    return labels


def allreduce_tables(runs: list[Run]) -> list[Table]:
    """One table per (dtype, mode, world size, emulation): sizes down, a column per experiment
    (key_of: backend, env setting, loaded NCCL) and run. One pass over the rows, keeping per
    cell only its text (the last row of a cell is shown) and per size the fastest measured column."""
    groups: dict[GroupKey, _Group] = {}
    columns_seen: dict[Column, Column] = {}   # one copy of each column key, not one per row
    for index, run in enumerate(runs):
        for row in run.rows:
            if row.op != ALLREDUCE:
                continue
            group = groups.setdefault((row.dtype, row.mode, row.world_size, emulation_text(row.emulation) or ""),
                                      _Group())
            column = columns_seen.setdefault((index, key_of(row)), (index, key_of(row)))
            group.add(row, column)
    tables = []
    for (dtype, mode, world, emulated), group in sorted(groups.items(), key=lambda kv: kv[0]):
        columns = list(group.cells)
        body = []
        for size in sorted(group.fastest):
            fastest = group.fastest[size][1]
            body.append([format_bytes(size)] + [_shown(group.cells[column].get(size), column == fastest)
                                                for column in columns])
        where = f", {emulated}" if emulated else ""
        tables.append(Table(f"allreduce, {dtype}, {mode}, {world} ranks{where}: latency_us / jitter p50 us",
                            ["size"] + column_labels(runs, columns), body))
    return tables


class _Group:
    """One table as its rows come: per column (in the order first seen) each size's cell, and per
    size the fastest measured row's latency and column (the first of equals). A cell is its text
    when the row measured, else (its status,); the last row of a cell is the one shown."""

    def __init__(self) -> None:
        self.cells: dict[Column, dict[int, str | tuple[str]]] = {}
        self.fastest: dict[int, tuple[float, Column | None]] = {}

    def add(self, row: Measurement, column: Column) -> None:
        measured = row.status == OK and row.latency_us is not None
        self.cells.setdefault(column, {})[row.message_bytes] = _cell(row, False) if measured else (row.status,)
        best = self.fastest.get(row.message_bytes)
        if measured and (best is None or best[1] is None or row.latency_us < best[0]):  # type: ignore[operator]
            self.fastest[row.message_bytes] = (row.latency_us, column)  # type: ignore[assignment]
        elif best is None:
            self.fastest[row.message_bytes] = (math.inf, None)


def _shown(cell: str | tuple[str] | None, best: bool) -> str:
    if cell is None:
        return ""
    if isinstance(cell, tuple):
        return cell[0]
    return f"**{cell}**" if best else cell


def fusion_table(rows: Iterable[Measurement]) -> Table | None:
    """Fused vs unfused per model shape, every world size in one table."""
    cells = comparison_cells(rows)
    if not cells:
        return None
    return Table(f"{COMPARISON_TITLE}, latency_us per call", COMPARISON_HEADERS, cells)


def refusals(rows: Iterable[Measurement]) -> list[str]:
    """'backend at N ranks: reason' for every backend and world size with no measured row."""
    # (backend, world size): whether a row measured, and the row that says why not (the first
    # with a reason, else the first)
    seen: dict[tuple[str, int], tuple[bool, Measurement]] = {}
    for r in rows:
        slot = (r.backend, r.world_size)
        measured, first = seen.get(slot, (False, None))
        if first is None or (r.reason and not first.reason):
            first = r
        seen[slot] = (measured or r.status == OK, first)
    return [f"`{md_escape(backend)}` at {world} ranks: {md_escape(first.status)}: "
            f"{md_escape(first.reason or 'no reason recorded')}"
            for (backend, world), (measured, first) in seen.items() if not measured]


@dataclass(frozen=True)
class TableResult:
    """What `table` answers; its --json is dataclasses.asdict of this (docs/results.md)."""

    machines: dict[str, tuple[str, ...]]    # what each machine and kind is -> its runs' ids
    runs: tuple[str, ...]                   # the run dirs, in the order given
    allreduce: tuple[Table, ...]
    fused: Table | None
    refused: tuple[str, ...]                # 'backend at N ranks: status: reason', measured nothing


def table_result(runs: list[Run]) -> TableResult:
    rows = _Rows(runs)
    kinds: dict[str, list[str]] = {}
    for run in runs:
        origin = provenance.of(run)
        kinds.setdefault(origin.what(), []).append(origin.run_id)
    return TableResult({what: tuple(ids) for what, ids in kinds.items()}, tuple(str(run.path) for run in runs),
                       tuple(allreduce_tables(runs)), fusion_table(rows), tuple(refusals(rows)))


def render_markdown(result: TableResult, width: int | None = None) -> str:
    """The markdown; with `width` (a terminal), its paragraphs wrapped to it between words
    (markdown joins the lines again; a table row stays one line, as markdown needs)."""
    def para(text: str, prefix: str = "", end: str = "") -> str:
        if width is None:
            return prefix + text + end
        return render.prose(text, width=width, indent=prefix) + end

    # First, what the runs are: one line per machine and kind, naming its runs.
    parts = [para(f"{md_escape(what)}; run{'s' if len(ids) > 1 else ''} {md_escape(', '.join(ids))}", "> ", "  ")
             for what, ids in result.machines.items()]
    parts += ["", "# commbench side by side", "", para("Runs: " + ", ".join(f"`{path}`" for path in result.runs) + "."),
              ""]
    parts += [para("Cells: headline `latency_us` (one timer around the timed pass, slowest rank) / the jitter pass's "
                   "p50; the fastest correct backend per size in bold; a status (skipped, hang, crashed, wrong, ...) "
                   "where the row did not measure."), ""]
    parts += [markdown(t) for t in result.allreduce]
    if result.fused is not None:
        parts += [para("saving = unfused - fused per call (positive: fusion is faster); unfused = the run's fastest "
                       "correct plain allreduce at that size, then torch's add and RMSNorm in the same graph."), "",
                  markdown(result.fused)]
    if result.refused:
        parts += ["### Measured nothing, and why", ""] + [f"- {line}" for line in result.refused] + [""]
    return "\n".join(parts)


class _Rows:
    """Every run's rows, as often as they are iterated (never held as one list)."""

    def __init__(self, runs: list[Run]):
        self.runs = runs

    def __iter__(self) -> Iterator[Measurement]:
        for run in self.runs:
            yield from run.rows


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run_dirs", nargs="+", metavar="RUN",
                        help="results dirs written by commbench sweep, or a fleet (all its runs; FLEET#NODE: one)")
    parser.add_argument("--out", help="markdown file to write (default: the tables on standard output, folded to the "
                                      "terminal)")
    parser.add_argument("--markdown", action="store_true",
                        help="print the markdown on standard output (one line per table row) instead")
    parser.add_argument("--json", metavar="FILE", help="also write the tables as JSON ('-' for stdout: JSON alone)")
    results_out.add_arguments(parser)
    render.add_arguments(parser)


def main(args: argparse.Namespace, argv: Sequence[str] = ()) -> int:
    check_file_target(args.out, "--out")
    results_out.check_targets(args)
    if len(set(args.run_dirs)) != len(args.run_dirs):
        raise UsageError("a run dir is listed twice")
    runs = [run for path in args.run_dirs for run in load_runs(path)]
    empty = [str(run.path) for run in runs if not run.rows]
    if empty:
        raise UsageError(f"{empty[0]}: no measurements yet (measurements.jsonl is empty or missing)")
    result = table_result(runs)
    if args.out is not None and args.out != STDOUT:
        with naming(args.out):
            Path(args.out).write_text(render_markdown(result), encoding="utf-8")
        print(f"wrote {args.out}")
    elif args.markdown or args.out == STDOUT:
        print(render_markdown(result, None if args.wide else render.terminal_width()), end="")
    else:
        print(render_text(result, args.wide))
    results_out.write(args, result, "table " + " ".join(args.run_dirs))
    return 0
