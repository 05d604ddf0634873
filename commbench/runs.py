"""A results dir read for offline analysis: run.json and the rows through the validated boundary
(commbench.results.validate), with a warning for each line that is not a row, for duplicate keys
(the row written last is used) and for a stop a dead sweep left in flight. Above both the results
contract (commbench.results) and the in-flight records (commbench.inflight), which reads rows itself.
Nothing is written into the dir."""

from __future__ import annotations

import sys
from pathlib import Path

from commbench.errors import UsageError
from commbench.inflight import pending
from commbench.results import ROWS_FILE, Run, RunDir


def load_run(run_dir: str | Path) -> Run:
    """Load a results dir for offline analysis; bad input raises UsageError (exit 2)."""
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
