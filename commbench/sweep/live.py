"""Rank 0's live output: an nccl-tests-like line per row, under a progress bar on long runs.

A row is one line where the terminal (COLUMNS, else its width, else 100 columns) holds the whole
nccl-tests-like line, and two where it does not: the size, dtype, mode and backend, then the
numbers and the status; a status longer than the width folds onto indented lines, and a comment
line ('# ...') folds under '#'; a '# next:' command stays whole, so it pastes."""

from __future__ import annotations

import sys
import textwrap

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from commbench import terminal
from commbench.results import OK, Measurement, describe_setting, is_checked
from commbench.sweep.plan import JITTER_CALLS

CONTINUATION = " " * 8
LEAD_HEADER = f"{'size(B)':>10} {'count':>10} {'type':>4} {'mode':>5}  "
NUMBERS_HEADER = f"{'time(us)':>9} {'p99(us)':>9} {'algbw':>7} {'busbw':>7} {'#wrong':>6}  status"
HEADER = f"{LEAD_HEADER}{'backend':<26} {NUMBERS_HEADER}"
# The narrowest terminal that holds a row on one line (its status folded after it): else two lines.
ONE_LINE = len(HEADER) + 4
# time and p99 come from two passes over the same calls (sweep/engine.py), so p99 may be below it.
PASSES_NOTE = ("time: one timer around the timed pass, slowest rank; p99: a timer per call in a separate "
               "jitter pass")
EAGER_TAIL_NOTE = (f"p99 of an eager row: a per-call tail of at least {JITTER_CALLS} calls (--jitter-calls); "
                   "fewer: the row says so")
TAIL_NOTE = ("p99 of a graph row: a timer per replay, so the p99 of per-replay means, not a per-call tail; "
             "the row says so")
TAIL_SAMPLES = JITTER_CALLS   # fewer samples than this (--jitter-calls): the row says what its p99 is
NAME_WIDTH = 26      # a longer backend name is cut there with '~' and given whole in the status
CHECK_OFF_NOTE = "-c 0: no output is checked (#wrong -, status \"ok, unchecked\"); analysis trusts none of these rows"


def header_lines(check: bool, width: int | None = None) -> list[str]:
    """The comment lines above the rows, for a terminal `width` wide (default: this one)."""
    width = width or terminal.width()
    notes = [PASSES_NOTE, EAGER_TAIL_NOTE, TAIL_NOTE] + ([] if check else [CHECK_OFF_NOTE])
    head = ["#" + HEADER[1:]] if width >= ONE_LINE else ["#" + LEAD_HEADER[1:] + "backend",
                                                          "#" + CONTINUATION[1:] + NUMBERS_HEADER]
    return head + [line for note in notes for line in comment(f"# {note}", width)]


def comment(text: str, width: int | None = None) -> list[str]:
    """A '# ...' line folded under '#' to the width; a '# next:' command stays whole."""
    if text.startswith("# next: ") or not text.startswith("# "):
        return [text]
    return textwrap.wrap(text[2:], (width or terminal.width()) - 2, initial_indent="# ", subsequent_indent="#   ",
                         break_long_words=False, break_on_hyphens=False) or [text]


def _num(value: float | None, width: int, digits: int = 2) -> str:
    if value is None:
        return f"{'-':>{width}}"
    text = f"{value:.{digits}f}"
    if len(text) > width:
        text = f"{value:.0f}"
    return f"{text:>{width}}"


def format_row(row: Measurement, width: int | None = None) -> str:
    """One row, nccl-tests-like, for a terminal `width` wide (default: this one); lines after the
    first (the numbers on a narrow terminal, a long status) start with CONTINUATION."""
    width = width or terminal.width()
    wrong = "-" if row.wrong_elements is None else str(row.wrong_elements)
    status = row.status if row.status == OK else f"{row.status}: {row.wrong_kind or row.reason or ''}".rstrip(": ")
    if row.status == OK and not is_checked(row):
        status += ", unchecked"   # -c 0: the header says so
    if row.setting_applied == "ignored":
        status += f" (used {describe_setting(row.observed)})"
    if row.unsafe:
        status += f" [unsafe: {row.unsafe}]"
    status += _tail_flag(row)
    lead = f"{row.message_bytes:>10} {row.count:>10} {row.dtype:>4} {row.mode:>5}  "
    numbers = (f"{_num(row.latency_us, 9)} {_num(row.jitter_p99_us, 9)} {_num(row.algbw_gbps, 7)} "
               f"{_num(row.busbw_gbps, 7)} {wrong:>6}  ")
    if width < ONE_LINE:   # the backend whole on the first line, the numbers and status under it
        return "\n".join([f"{lead}{row.backend}", *_fold(status, width, CONTINUATION + numbers)])
    if len(row.backend) > NAME_WIDTH:   # every MSCCL++ variant begins alike: a cut name alone prints them the same
        status = f"{row.backend}: {status}"
    cut = len(row.backend) > NAME_WIDTH
    name = row.backend[:NAME_WIDTH - 1] + "~" if cut else row.backend
    head = f"{lead}{name:<{NAME_WIDTH}} {numbers}"
    if cut:   # the status, led by the whole name, on the lines below
        return "\n".join([head.rstrip(), *_fold(status, width, CONTINUATION)])
    return "\n".join(_fold(status, width, head))


def _fold(status: str, width: int, first: str) -> list[str]:
    return textwrap.wrap(status, width, initial_indent=first, subsequent_indent=CONTINUATION,
                         break_long_words=False, break_on_hyphens=False) or [first.rstrip()]


def _tail_flag(row: Measurement) -> str:
    """What the p99 beside the time is, where it is not a per-call tail of enough calls, or sits
    below the time (the two come from separate passes)."""
    if row.jitter_p99_us is None or row.latency_us is None:
        return ""
    flags = []
    if row.mode == "graph":
        flags.append(f"p99 of {row.jitter_samples} replay means")
    elif row.jitter_samples < TAIL_SAMPLES:
        flags.append(f"p99 of {row.jitter_samples} calls")
    if row.jitter_p99_us < row.latency_us:
        flags.append("p99 below time: separate passes")
    return f" [{'; '.join(flags)}]" if flags else ""


class LiveTable:
    """Prints rows as they are measured; only rank 0 prints."""

    def __init__(self, enabled: bool, total_rows: int):
        self.enabled = enabled
        # Rows hold text from backends and errors: printed literally (no markup, no :emoji: codes).
        self.console = Console(file=sys.stdout, highlight=False, soft_wrap=True, emoji=False)
        self.width = terminal.width()   # read once: every row of a run is laid out alike
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
            self.console.print("\n".join(comment(text, self.width)), markup=False)

    def row(self, row: Measurement, advance: int = 1) -> None:
        if not self.enabled:
            return
        self.console.print(format_row(row, self.width), markup=False)
        if self.progress is not None:
            self.progress.advance(self._task, advance)

    def advance(self, steps: int) -> None:
        if self.enabled and self.progress is not None:
            self.progress.advance(self._task, steps)
