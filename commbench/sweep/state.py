"""A sweep's rows: what the run holds so far (RunState, the same on every rank) and where a
new row goes (RowSink: measurements.jsonl on rank 0, the live table)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from commbench.results import CRASHED, HANG, Cell, Measurement, RowsWriter, stops_backend
from commbench.sweep.live import LiveTable
from commbench.units import format_bytes


def stopped_reason(row: Measurement) -> str:
    """Why the rest of a backend is skipped after a row that ended it (see stops_backend)."""
    verb = {HANG: "hung", CRASHED: "crashed"}.get(row.status, "failed on one rank")
    return f"{verb} earlier in this run ({format_bytes(row.message_bytes)} {row.mode}): {row.reason}"


@dataclass
class RunState:
    env_setting: dict[str, str]         # this process's --env setting: its cells are the plan's under it
    rows: list[Measurement]             # every row of this run so far, the same on every rank
    done_cells: set[Cell]               # the cells that have a row in this run
    stopped_backends: dict[str, str]    # backend -> why it does not run again

    @classmethod
    def resumed(cls, previous: list[Measurement], env_setting: dict[str, str]) -> RunState:
        """The state after the rows a resumed run already has (none for a new run); a backend a
        row of the same setting stopped stays stopped."""
        stopped = {row.backend: stopped_reason(row) for row in previous
                   if stops_backend(row) and row.env_setting == env_setting}
        return cls(env_setting, list(previous), {row.cell for row in previous}, stopped)

    def add(self, row: Measurement) -> None:
        self.rows.append(row)
        self.done_cells.add(row.cell)


@dataclass
class RowSink:
    writer: RowsWriter | None           # measurements.jsonl: rank 0 only
    table: LiveTable
    flush: Callable[[], None]           # after a row that stops a backend: the CSV now, the process may end next
    resume_hint: str | None             # the command that continues (None under the driver)

    def write(self, row: Measurement) -> None:
        if self.writer is not None:
            self.writer.append(row)
