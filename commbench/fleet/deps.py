"""pyarrow and duckdb, the optional `fleet` extra: imported only by the fleet commands, and
their absence is one line (exit 2), not an ImportError."""

from __future__ import annotations

import importlib
from types import ModuleType

from commbench.errors import UsageError

EXTRA = "fleet"


def need(name: str) -> ModuleType:
    """The module `name` (pyarrow, pyarrow.parquet, duckdb), or bad input naming the extra."""
    try:
        return importlib.import_module(name)
    except ImportError:
        raise UsageError(f"the fleet commands need pyarrow and duckdb ({name.split('.')[0]} is not installed): "
                         f"pip install 'commbench[{EXTRA}]'") from None
