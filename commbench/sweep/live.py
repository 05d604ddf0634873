"""Rank 0's live output: an nccl-tests-like line per row, under a progress bar on long runs."""

from __future__ import annotations

import sys

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from commbench.results import OK, Measurement, describe_setting

HEADER = (f"{'size(B)':>12} {'count':>11} {'type':>5} {'mode':>5}  {'backend':<28} "
          f"{'time(us)':>9} {'p99(us)':>9} {'algbw':>7} {'busbw':>7} {'#wrong':>6}  status")


def _num(value: float | None, width: int, digits: int = 2) -> str:
    if value is None:
        return f"{'-':>{width}}"
    text = f"{value:.{digits}f}"
    if len(text) > width:
        text = f"{value:.0f}"
    return f"{text:>{width}}"


def format_row(row: Measurement) -> str:
    wrong = "-" if row.wrong_elements is None else str(row.wrong_elements)
    status = row.status if row.status == OK else f"{row.status}: {row.wrong_kind or row.reason or ''}".rstrip(": ")
    if row.setting_applied == "ignored":
        status += f" (used {describe_setting(row.observed)})"
    if row.unsafe:
        status += f" [unsafe: {row.unsafe}]"
    return (f"{row.message_bytes:>12} {row.count:>11} {row.dtype:>5} {row.mode:>5}  {row.backend:<28.28} "
            f"{_num(row.latency_us, 9)} {_num(row.jitter_p99_us, 9)} {_num(row.algbw_gbps, 7)} "
            f"{_num(row.busbw_gbps, 7)} {wrong:>6}  {status}")


class LiveTable:
    """Prints rows as they are measured; only rank 0 prints."""

    def __init__(self, enabled: bool, total_rows: int):
        self.enabled = enabled
        # Rows hold text from backends and errors: printed literally (no markup, no :emoji: codes).
        self.console = Console(file=sys.stdout, highlight=False, soft_wrap=True, emoji=False)
        self.progress: Progress | None = None
        self._task = None
        if enabled and total_rows > 0 and self.console.is_terminal:
            self.progress = Progress(TextColumn("sweep"), BarColumn(), MofNCompleteColumn(),
                                     TimeElapsedColumn(), console=self.console, transient=True)
            self._task = self.progress.add_task("sweep", total=total_rows)

    def __enter__(self) -> "LiveTable":
        if self.progress is not None:
            self.progress.start()
        return self

    def __exit__(self, *exc) -> None:
        if self.progress is not None:
            self.progress.stop()

    def line(self, text: str) -> None:
        if self.enabled:
            self.console.print(text, markup=False)

    def row(self, row: Measurement, advance: int = 1) -> None:
        if not self.enabled:
            return
        self.console.print(format_row(row), markup=False)
        if self.progress is not None:
            self.progress.advance(self._task, advance)

    def advance(self, steps: int) -> None:
        if self.enabled and self.progress is not None:
            self.progress.advance(self._task, steps)
