"""A results dir read for offline analysis: run.json, the rows, and a warning for each line that
is not a row and for a stop a dead sweep left in flight. Above both the results contract
(commbench.results) and the in-flight records (commbench.inflight), which reads rows itself."""

from __future__ import annotations

import sys
from pathlib import Path

from commbench.errors import UsageError
from commbench.inflight import pending
from commbench.results import ROWS_FILE, Run, read_rows_checked, read_run_info


def load_run(run_dir: str | Path) -> Run:
    """Load a results dir for offline analysis; bad input raises UsageError (exit 2). Lines
    that are not rows, and a stop a dead sweep left in flight, get one warning line each."""
    path = Path(run_dir)
    if not path.is_dir():
        raise UsageError(f"{run_dir}: no such results directory")
    info = read_run_info(path)
    read = read_rows_checked(path)
    for line in filter(None, [read.problems_line(path / ROWS_FILE), pending(path)]):
        print(f"commbench: warning: {line}", file=sys.stderr)
    return Run(path=path, info=info, rows=read.rows)
