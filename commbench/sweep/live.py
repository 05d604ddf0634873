"""Rank 0's live output: an nccl-tests-like line per row, under a progress bar on long runs."""

from __future__ import annotations

import sys
import textwrap

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from commbench.results import OK, Measurement, describe_setting, is_checked
from commbench.sweep.plan import JITTER_CALLS

# Rows fit a 120-column terminal: a status that does not fit goes on to indented lines.
WIDTH = 120
CONTINUATION = " " * 8
HEADER = (f"{'size(B)':>10} {'count':>10} {'type':>4} {'mode':>5}  {'backend':<26} "
          f"{'time(us)':>9} {'p99(us)':>9} {'algbw':>7} {'busbw':>7} {'#wrong':>6}  status")
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


def header_lines(check: bool) -> list[str]:
    """The comment lines above the rows."""
    notes = [PASSES_NOTE, EAGER_TAIL_NOTE, TAIL_NOTE] + ([] if check else [CHECK_OFF_NOTE])
    return ["#" + HEADER[1:]] + [f"# {note}" for note in notes]


def _num(value: float | None, width: int, digits: int = 2) -> str:
    if value is None:
        return f"{'-':>{width}}"
    text = f"{value:.{digits}f}"
    if len(text) > width:
        text = f"{value:.0f}"
    return f"{text:>{width}}"


def format_row(row: Measurement) -> str:
    """One row, nccl-tests-like; lines after the first (a long status) start with CONTINUATION."""
    wrong = "-" if row.wrong_elements is None else str(row.wrong_elements)
    status = row.status if row.status == OK else f"{row.status}: {row.wrong_kind or row.reason or ''}".rstrip(": ")
    if row.status == OK and not is_checked(row):
        status += ", unchecked"   # -c 0: the header says so
    if row.setting_applied == "ignored":
        status += f" (used {describe_setting(row.observed)})"
    if row.unsafe:
        status += f" [unsafe: {row.unsafe}]"
    status += _tail_flag(row)
    if len(row.backend) > NAME_WIDTH:   # every MSCCL++ variant begins alike: a cut name alone prints them the same
        status = f"{row.backend}: {status}"
    lead = f"{row.message_bytes:>10} {row.count:>10} {row.dtype:>4} {row.mode:>5}  "
    cut = len(row.backend) > NAME_WIDTH
    name = row.backend[:NAME_WIDTH - 1] + "~" if cut else row.backend
    head = (f"{lead}{name:<{NAME_WIDTH}} "
            f"{_num(row.latency_us, 9)} {_num(row.jitter_p99_us, 9)} {_num(row.algbw_gbps, 7)} "
            f"{_num(row.busbw_gbps, 7)} {wrong:>6}  ")
    if cut:   # the status, led by the whole name, on the lines below
        return "\n".join([head.rstrip(), *textwrap.wrap(status, WIDTH, initial_indent=CONTINUATION,
                                                        subsequent_indent=CONTINUATION, break_on_hyphens=False)])
    return "\n".join(textwrap.wrap(status, WIDTH, initial_indent=head, subsequent_indent=CONTINUATION,
                                   break_on_hyphens=False)) or head.rstrip()


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
