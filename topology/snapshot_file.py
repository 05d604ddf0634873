"""A topology snapshot as a file: its kind and schema, and the checked reader. Torch-free and
below the probe, so the analysis (qualify) reads snapshots without the probe's imports."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from commbench.errors import UsageError
from commbench.files import read_text
from commbench.results.shapes import snapshot_problem
from commbench.results.validate import loads_json

SCHEMA_VERSION = 1
SNAPSHOT_KIND = "commbench-topology-snapshot"


def load_snapshot(path: str) -> dict[str, Any]:
    """Read a snapshot file through the boundary (bounded, cleaned, every field the analysis
    uses of its type); UsageError (one line) when missing, malformed or not a snapshot."""
    data = loads_json(read_text(Path(path), "a commbench topology snapshot"), path)
    if not isinstance(data, dict) or data.get("kind") != SNAPSHOT_KIND:
        raise UsageError(f"{path} is not a commbench topology snapshot")
    if data.get("schema") != SCHEMA_VERSION:
        raise UsageError(f"{path} has snapshot schema {data.get('schema')}, this commbench reads {SCHEMA_VERSION}")
    wrong = snapshot_problem(data, whole=True)
    if wrong:
        raise UsageError(f"{path}: {wrong}: not a snapshot commbench can read")
    return data
