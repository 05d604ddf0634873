"""A results directory loaded for offline analysis (commbench.runs.load_run reads one: every
file it reads has passed the boundary, validate.py, first)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

from commbench.results.schema import OK, Measurement, describe_emulation


@dataclass
class Run:
    """A results directory loaded for analysis."""

    path: Path
    info: dict[str, Any]
    rows: list[Measurement]

    def ok_rows(self) -> Iterator[Measurement]:
        return (r for r in self.rows if r.status == OK)

    @property
    def emulation(self) -> dict[str, Any] | None:
        """How the ranks shared GPUs, when they did (run.json, else any row that says so)."""
        recorded = self.info.get("emulation")
        if isinstance(recorded, dict):
            return recorded
        return next((r.emulation for r in self.rows if isinstance(r.emulation, dict)), None)

    def emulation_line(self) -> str | None:
        return describe_emulation(self.emulation) if self.emulation else None
