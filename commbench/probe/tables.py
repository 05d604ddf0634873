"""The probe's rich output, built so that every snapshot string prints as it is.

A snapshot holds text from drivers, sysfs, NCCL and error messages: a PCI bus id such as
00000000:AB:00.0 is an emoji code to rich, and "[/]" or "[bold]" in an error is markup. So the
console interprets neither, and styles are attached to Text pieces instead. Columns fold long
words rather than cut them, so at 80 columns (piped output) every cell keeps all its text.
"""

from __future__ import annotations

from typing import TextIO

from rich.console import Console
from rich.table import Table
from rich.text import Text


def literal_console(file: TextIO | None = None, width: int | None = None) -> Console:
    return Console(file=file, width=width, markup=False, emoji=False)


def new_table(title: str, columns: tuple[str, ...] = (), whole: tuple[str, ...] = (), **options) -> Table:
    """A left-titled table; the `whole` columns hold short identifiers (a PCI bus id) that keep
    one line, the others wrap or fold when the table is narrower than its text."""
    table = Table(title=title, title_justify="left", **options)
    for column in columns:
        table.add_column(column, overflow="fold", no_wrap=column in whole)
    return table


def styled(text: str, style: str, detail: str = "") -> Text:
    """text in style, then detail unstyled ("FAIL" in red, then its reason)."""
    return Text.assemble((text, style), detail)
