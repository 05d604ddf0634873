"""The terminal's width, for everything that prints to one (the analysis commands' renderer and
the sweep's live rows): COLUMNS, else the terminal's, else DEFAULT_WIDTH where output is not a
terminal (a pipe, a file, a CI log)."""

from __future__ import annotations

import shutil

DEFAULT_WIDTH = 100


def width() -> int:
    return shutil.get_terminal_size((DEFAULT_WIDTH, 24)).columns
