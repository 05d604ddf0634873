"""The results directory and its rows: the bottom layer, torch-free.

schema.py (the row, its statuses, migrations), validate.py (the boundary every read goes through),
rundir.py (RunDir, the one owner of a run directory), identity.py (what a resume must share),
run.py (a run loaded for analysis). The names below are those the commands, tests and plug-ins use.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterable

from commbench.results.identity import IDENTITY_KEYS, refuse_other_run, resume_differences
from commbench.results.rundir import (CSV_FILE, LOCK_FILE, ROWS_FILE, RUN_FILE, TORN_FILE, Lines, RowsRead, RowsWriter,
                                      RunDir, csv_line, json_line, repair_torn_tail, unwritable, write_whole)
from commbench.results.run import Run
from commbench.results.identity import MEASURED_PLAN_KEYS
from commbench.results.schema import (CHECK_OFF, CRASHED, CSV_COLUMNS, ENV_PREFIXES, ERROR, HANG, NO_WORK, OK,
                                      PRELOAD_VAR, READABLE_SCHEMAS, SCHEMA_VERSION, SKIPPED, STATUSES, STRANDED,
                                      WRONG, Cell, Measurement, Shape, describe_emulation, describe_setting,
                                      is_checked, migrate_row, percentile, stops_backend)
from commbench.results.validate import row_problem

ResultsWriter = RowsWriter   # the name plug-ins and tests know


def new_run_dir(root: Path) -> Path:
    return RunDir.create(root).path


def read_run_info(run_dir: Path) -> dict[str, Any]:
    return RunDir(run_dir).info()


def write_run_info(run_dir: Path, info: dict[str, Any]) -> None:
    RunDir(run_dir).write_info(info)


def read_rows_checked(run_dir: Path) -> RowsRead:
    return RunDir(run_dir).read_rows()


def read_rows(run_dir: Path) -> list[Measurement]:
    return RunDir(run_dir).rows()


def write_csv(run_dir: Path, rows: Iterable[Measurement] | None = None) -> Path:
    return RunDir(run_dir).write_csv(rows)


__all__ = [
    "CHECK_OFF", "Cell", "CRASHED", "CSV_COLUMNS", "CSV_FILE", "ENV_PREFIXES", "ERROR", "HANG", "IDENTITY_KEYS", "LOCK_FILE", "NO_WORK",
    "OK", "PRELOAD_VAR", "READABLE_SCHEMAS", "ROWS_FILE", "RUN_FILE", "SCHEMA_VERSION", "SKIPPED", "STATUSES", "STRANDED",
    "Shape", "TORN_FILE", "WRONG", "Lines", "Measurement", "ResultsWriter", "RowsRead", "RowsWriter", "Run", "RunDir",
    "csv_line", "describe_emulation", "describe_setting", "is_checked", "json_line", "MEASURED_PLAN_KEYS", "migrate_row", "new_run_dir", "percentile",
    "read_rows", "read_rows_checked", "read_run_info", "refuse_other_run", "repair_torn_tail",
    "resume_differences", "row_problem", "stops_backend", "unwritable", "write_csv",
    "write_run_info", "write_whole",
]
