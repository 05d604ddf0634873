"""The one terminal renderer of the analysis commands: rich tables that fold to the terminal
width between words (an identifier, a backend spec, a setting or a path, is never split: a table
that cannot fold that way is printed as one record per row), prose wrapped to the width,
`--wide` for one line per row, and the number formats every command shares."""

from __future__ import annotations

import argparse
import io
import re
import textwrap
from typing import Sequence, Union

from rich import box
from rich.console import Console
from rich.table import Table
from rich.text import Text

from commbench.terminal import width as terminal_width

# --wide: wide enough that no realistic table folds.
WIDE_WIDTH = 10_000
COLUMN_GAP = 2        # spaces between columns: a right pad and the box's blank separator

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


def width_now(wide: bool = False, width: int | None = None) -> int:
    return WIDE_WIDTH if wide else (width or terminal_width())


_BACKTICKED = re.compile(r"`[^`\n]+`")
_KEPT_SPACE = "\x00"    # a space inside a backticked command while the text is wrapped


def prose(text: str, wide: bool = False, width: int | None = None, indent: str = "", first: str | None = None) -> str:
    """A sentence or paragraph wrapped to the width between words: a word (an identifier, a flag,
    a path) is never split, and one longer than the width stands on a line of its own. A command
    between backticks counts as one word, so it stays on one line and pastes. `first`: the first
    line's indent where it differs from the others' (a list item: "  1. ", then "     ")."""
    kept = _BACKTICKED.sub(lambda m: m.group(0).replace(" ", _KEPT_SPACE), text)
    return "\n".join(textwrap.wrap(kept, width_now(wide, width), initial_indent=indent if first is None else first,
                                    subsequent_indent=indent, break_long_words=False,
                                    break_on_hyphens=False)).replace(_KEPT_SPACE, " ") or text


def fill(text: str, wide: bool = False, indent: str = "  ") -> str:
    """A paragraph from the margin, its following lines under `indent`, wrapped as prose()."""
    return prose(text, wide, indent=indent, first="")


def table(headers: Sequence[str], rows: Sequence[Sequence[Cell]], right: Sequence[int] = (),
          title: str | None = None, wide: bool = False, width: int | None = None) -> str:
    """Rows under headers as plain text (no colour codes), lines without trailing spaces.

    Indexes in `right` are numbers: right-aligned and never split. Other cells wrap inside their
    column, between words, when the table is wider than `width` (default: the terminal's). Where
    the columns cannot fit that way, each row is printed as a record: its first cell on a line of
    its own, then the other columns as "header value" wrapped between words; a word is never
    split and a column never dropped or cut. `wide`: one line per row. A str cell is shown as
    written: a '[' in it is not rich markup."""
    if title is not None:   # a line of its own: a rich title would fold to the table's width
        return prose(title, wide, width) + "\n" + table(headers, rows, right, None, wide, width)
    width = width_now(wide, width)
    widths = column_widths(headers, rows, right, width - COLUMN_GAP * (len(headers) - 1))
    if widths is None:
        return records(headers, rows, width, right)
    return _capture(build(headers, rows, right, widths), width)


def records(headers: Sequence[str], rows: Sequence[Sequence[Cell]], width: int, right: Sequence[int] = ()) -> str:
    """A table too wide to fold between words, one row at a time: the first cell on its own
    line, the others as 'header: value' pairs wrapped between words; a number (a column in
    `right`) stays on one line with its header."""
    out = []
    for row in rows:
        cells = [_plain(c) for c in row]
        out.append(cells[0])
        pairs = "; ".join(f"{h}: {c}".replace(" ", _KEPT_SPACE) if i in right else f"{h}: {c}"
                          for i, (h, c) in enumerate(zip(headers, cells)) if i and c.strip())
        out.extend(line.replace(_KEPT_SPACE, " ") for line in textwrap.wrap(
            pairs, width, initial_indent="  ", subsequent_indent="    ", break_long_words=False,
            break_on_hyphens=False))
    return "\n".join(line.rstrip() for line in out)


def column_widths(headers: Sequence[str], rows: Sequence[Sequence[Cell]], right: Sequence[int],
                  available: int) -> list[int] | None:
    """Each column's width so that the table fits `available` characters (gaps excluded): every
    column as wide as its widest cell where that fits; else text columns narrowed, the widest
    first, down to their longest word (folding between words); None where that does not fit.
    Number columns, headers included, stay whole. The widths are given to rich exactly: left to
    itself, rich crops a cell it wrapped wider."""
    natural = [_widest(headers[i], rows, i, whole=True) for i in range(len(headers))]
    least = [_widest(headers[i], rows, i, whole=False, numbers=i in right) for i in range(len(headers))]
    if sum(least) > available:
        return None
    widths = list(natural)
    while sum(widths) > available:
        widest = max((i for i in range(len(widths)) if widths[i] > least[i]), key=lambda i: widths[i])
        widths[widest] -= 1
    return widths


def build(headers: Sequence[str], rows: Sequence[Sequence[Cell]], right: Sequence[int] = (),
          widths: Sequence[int] | None = None) -> Table:
    """The rich Table; with `widths`, each column exactly that wide (text folds inside it)."""
    out = Table(box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False, padding=(0, 0, 0, COLUMN_GAP - 1),
                header_style="bold", highlight=False)
    for i, header in enumerate(headers):
        numeric = i in right
        out.add_column(header, justify="right" if numeric else "left",
                       width=widths[i] if widths else None, overflow="fold")
    for row in rows:
        out.add_row(*(cell if isinstance(cell, Text) else Text(str(cell)) for cell in row))
    return out


def _widest(header: str, rows: Sequence[Sequence[Cell]], index: int, whole: bool, numbers: bool = False) -> int:
    """The widest cell of a column (whole) or its longest word, the header's words included; a
    number is never split (`numbers`: every cell whole), its header folds between words."""
    cells = [_plain(row[index]) for row in rows if index < len(row)]
    pieces = cells if whole or numbers else [word for cell in cells for word in cell.split()]
    heads = [header] if whole else header.split()
    return max([len(p) for p in pieces] + [len(h) for h in heads], default=0)


def _plain(cell: Cell) -> str:
    return cell.plain if isinstance(cell, Text) else str(cell)


def _capture(renderable: Table, width: int) -> str:
    console = Console(file=io.StringIO(), width=width,
                      force_terminal=False, color_system=None,
                      highlight=False, soft_wrap=False, emoji=False, markup=False)
    console.print(renderable)
    text = console.file.getvalue()   # type: ignore[attr-defined]
    return "\n".join(line.rstrip() for line in text.rstrip("\n").split("\n"))
