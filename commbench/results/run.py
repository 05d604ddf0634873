"""A results directory loaded for offline analysis: every analysis command reads through
load_run, so every file it reads has passed the boundary (validate.py) first."""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

from commbench.errors import UsageError
from commbench.results.rundir import ROWS_FILE, RunDir
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


def load_run(run_dir: str | Path) -> Run:
    """Load a results dir for offline analysis; bad input raises UsageError (exit 2). Lines
    that are not rows, duplicate keys (the row written last is used), and a stop a dead sweep
    left in flight get one warning line each. Nothing is written into the dir."""
    from commbench.inflight import pending   # it reads rows too

    path = Path(run_dir)
    if not path.is_dir():
        raise UsageError(f"{run_dir}: no such results directory")
    run = RunDir(path)
    info = run.info()
    read = run.read_rows()
    rows_path = path / ROWS_FILE
    for line in filter(None, [read.problems_line(rows_path), read.duplicates_line(rows_path), pending(path)]):
        print(f"commbench: warning: {line}", file=sys.stderr)
    return Run(path=path, info=info, rows=read.rows)
