"""A results directory loaded for offline analysis (commbench.runs.load_run reads one: every
file it reads has passed the boundary, validate.py, first)."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any, Iterator, Sequence

from commbench.results.info import RunInfo
from commbench.results.schema import OK, Measurement, describe_emulation


@dataclass
class Run:
    """A results directory loaded for analysis."""

    path: Path
    info: RunInfo
    rows: Sequence[Measurement]   # CompactRows when loaded: each row made as it is iterated

    @property
    def run_id(self) -> str:
        """The run's id as recorded, else its folder's name."""
        return self.info.run_id or self.path.name

    def ok_rows(self) -> Iterator[Measurement]:
        return (r for r in self.rows if r.status == OK)

    @property
    def emulation(self) -> dict[str, Any] | None:
        """How the ranks shared GPUs, when they did (run.json, else any row that says so)."""
        return self.info.emulation if self.info.emulation is not None else self._rows_emulation

    @cached_property
    def _rows_emulation(self) -> dict[str, Any] | None:
        """The first row's that says so, found once: a pass over 10^5 rows each time adds up."""
        return next((r.emulation for r in self.rows if isinstance(r.emulation, dict)), None)

    def emulation_line(self) -> str | None:
        return describe_emulation(self.emulation) if self.emulation else None
