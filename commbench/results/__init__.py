"""The results directory and its rows: the bottom layer, torch-free.

schema.py (the row, its statuses, migrations), info.py (run.json as a RunInfo), validate.py (the
boundary every read goes through), rundir.py (RunDir, the one owner of a run directory: the one
API to read and write one), identity.py (what a resume must share), run.py (a run loaded for
analysis). The names below are those the commands, tests and plug-ins use.
"""

from __future__ import annotations

from commbench.results.identity import IDENTITY_KEYS, MEASURED_PLAN_KEYS, refuse_other_run, resume_differences
from commbench.results.info import RunInfo
from commbench.results.rundir import (CSV_FILE, LOCK_FILE, ROWS_FILE, RUN_FILE, TORN_FILE, Lines, RowsRead, RowsWriter,
                                      RunDir, csv_line, json_line, repair_torn_tail, unwritable, write_whole)
from commbench.results.run import Run
from commbench.results.schema import (CHECK_OFF, CRASHED, CSV_COLUMNS, ENV_PREFIXES, ERROR, HANG, NO_WORK, OK,
                                      PRELOAD_VAR, READABLE_SCHEMAS, SCHEMA_VERSION, SKIPPED, STATUSES, STRANDED,
                                      WRONG, Cell, Measurement, Shape, describe_emulation, describe_setting,
                                      is_checked, migrate_row, percentile, stops_backend)
from commbench.results.validate import row_problem

__all__ = [
    "Cell", "CHECK_OFF", "CRASHED", "CSV_COLUMNS", "CSV_FILE", "csv_line", "describe_emulation", "describe_setting",
    "ENV_PREFIXES", "ERROR", "HANG", "IDENTITY_KEYS", "is_checked", "json_line", "Lines", "LOCK_FILE",
    "MEASURED_PLAN_KEYS", "Measurement", "migrate_row", "NO_WORK", "OK", "percentile", "PRELOAD_VAR",
    "READABLE_SCHEMAS", "refuse_other_run", "repair_torn_tail", "resume_differences", "row_problem", "ROWS_FILE",
    "RowsRead", "RowsWriter", "Run", "RUN_FILE", "RunDir", "RunInfo", "SCHEMA_VERSION", "Shape", "SKIPPED",
    "STATUSES", "stops_backend", "STRANDED", "TORN_FILE", "unwritable", "write_whole", "WRONG",
]
