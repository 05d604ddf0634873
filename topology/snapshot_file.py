"""A topology snapshot as a file: its kind and schema, and the checked reader. Torch-free and
below the probe, so the analysis (qualify) reads snapshots without the probe's imports."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from commbench.errors import UsageError
from commbench.files import read_text

SCHEMA_VERSION = 1
SNAPSHOT_KIND = "commbench-topology-snapshot"


def load_snapshot(path: str) -> dict[str, Any]:
    """Read a snapshot file; UsageError (one line) when missing or not a snapshot."""
    try:
        data = json.loads(read_text(Path(path), "a commbench topology snapshot"))
    except json.JSONDecodeError as exc:
        raise UsageError(f"{path} is not valid JSON (line {exc.lineno}: {exc.msg})") from None
    except RecursionError:
        raise UsageError(f"{path} is nested too deep for a commbench topology snapshot") from None
    if not isinstance(data, dict) or data.get("kind") != SNAPSHOT_KIND:
        raise UsageError(f"{path} is not a commbench topology snapshot")
    if data.get("schema") != SCHEMA_VERSION:
        raise UsageError(f"{path} has snapshot schema {data.get('schema')}, this commbench reads {SCHEMA_VERSION}")
    return data

