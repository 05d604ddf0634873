"""The one terminal renderer of the analysis commands: rich tables that fold to the terminal
width (every cell stays whole, long ones wrap onto more lines), `--wide` for one line per row,
and the number formats every command shares."""

from __future__ import annotations

import argparse
import io
import shutil
from typing import Sequence, Union

from rich import box
from rich.console import Console
from rich.table import Table
from rich.text import Text

# Used when stdout is not a terminal and COLUMNS is unset (a pipe, a file, a CI log).
DEFAULT_WIDTH = 100
# --wide: wide enough that no realistic table folds.
WIDE_WIDTH = 10_000
COLUMN_GAP = 2        # spaces between columns: a right pad and the box's blank separator
MIN_TEXT_WIDTH = 8    # the narrowest a text column folds to, inside its words

Cell = Union[str, Text]   # a Text keeps its own style where a styled console shows it


def fmt_us(value: float | None) -> str:
    if value is None:
        return "-"
    if value >= 1000:
        return f"{value:,.0f}"
    if value >= 100:
        return f"{value:.0f}"
    if value >= 10:
        return f"{value:.1f}"
    return f"{value:.2f}"


def fmt_pct(value: float | None, signed: bool = True) -> str:
    if value is None:
        return "-"
    return f"{value:+.1f}%" if signed else f"{value:.1f}%"


def fmt_num(value: float | None, digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The `--wide` flag, the same on every command that prints a table."""
    parser.add_argument("--wide", action="store_true",
                        help="one line per table row, however wide (default: fold to the terminal width)")


def terminal_width() -> int:
    """COLUMNS, else the terminal's width, else DEFAULT_WIDTH."""
    return shutil.get_terminal_size((DEFAULT_WIDTH, 24)).columns


def table(headers: Sequence[str], rows: Sequence[Sequence[Cell]], right: Sequence[int] = (),
          title: str | None = None, wide: bool = False, width: int | None = None) -> str:
    """Rows under headers as plain text (no colour codes), lines without trailing spaces.

    Indexes in `right` are numbers: right-aligned and never split. Other cells wrap inside their
    column when the table is wider than `width` (default: the terminal's): between words where
    the columns fit that way, else inside words. Where even that cannot fit, or with `wide`, the
    table is printed unfolded: a column is never dropped or cut. A str cell is shown as written:
    a '[' in it is not rich markup."""
    width = WIDE_WIDTH if wide else (width or terminal_width())
    numeric = [_widest(headers[i], rows, i, whole=True) for i in range(len(headers)) if i in right]
    words = [_widest(headers[i], rows, i, whole=False) for i in range(len(headers)) if i not in right]
    gaps = COLUMN_GAP * (len(headers) - 1)
    if sum(numeric) + sum(words) + gaps <= width:
        text_min = None                        # fold between words
    elif sum(numeric) + MIN_TEXT_WIDTH * len(words) + gaps <= width:
        text_min = MIN_TEXT_WIDTH              # fold inside words
    else:
        return _capture(build(headers, rows, right, title), WIDE_WIDTH)
    return _capture(build(headers, rows, right, title, text_min), width)


def build(headers: Sequence[str], rows: Sequence[Sequence[Cell]], right: Sequence[int] = (),
          title: str | None = None, text_min: int | None = None) -> Table:
    """The rich Table; a text column is at least its longest word wide, or `text_min` when given."""
    out = Table(box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False, padding=(0, COLUMN_GAP - 1, 0, 0),
                title=title, title_justify="left", title_style="", header_style="bold", highlight=False)
    for i, header in enumerate(headers):
        numeric = i in right
        least = _widest(header, rows, i, whole=numeric)
        out.add_column(header, justify="right" if numeric else "left", no_wrap=numeric,
                       min_width=least if numeric or text_min is None else min(least, text_min), overflow="fold")
    for row in rows:
        out.add_row(*(cell if isinstance(cell, Text) else Text(str(cell)) for cell in row))
    return out


def _widest(header: str, rows: Sequence[Sequence[Cell]], index: int, whole: bool) -> int:
    """The widest cell of a column (whole) or its longest word, the header's words included."""
    cells = [_plain(row[index]) for row in rows if index < len(row)]
    pieces = cells if whole else [word for cell in cells for word in cell.split()]
    return max([len(p) for p in pieces] + [len(w) for w in header.split()], default=0)


def _plain(cell: Cell) -> str:
    return cell.plain if isinstance(cell, Text) else str(cell)


def _capture(renderable: Table, width: int) -> str:
    console = Console(file=io.StringIO(), width=width,
                      force_terminal=False, color_system=None,
                      highlight=False, soft_wrap=False, emoji=False, markup=False)
    console.print(renderable)
    text = console.file.getvalue()   # type: ignore[attr-defined]
    return "\n".join(line.rstrip() for line in text.rstrip("\n").split("\n"))
