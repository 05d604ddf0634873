"""One --json writer for the analysis commands: '-' is stdout, anything else a file, and a
target that cannot be written is bad input, said before the command does its work."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from commbench.errors import UsageError


def check_json_target(target: str | None) -> None:
    """Fail early when --json names something that cannot become a file."""
    if target is None or target == "-":
        return
    path = Path(target)
    if path.is_dir():
        raise UsageError(f"--json {target}: is a directory (give a file name)")
    if not path.parent.is_dir():
        raise UsageError(f"--json {target}: no such directory {path.parent}")


def write_json(target: str | None, payload: Any) -> None:
    if target is None:
        return
    text = json.dumps(payload, indent=2, default=str) + "\n"
    if target == "-":
        sys.stdout.write(text)
        return
    try:
        Path(target).write_text(text, encoding="utf-8")
    except OSError as exc:
        raise UsageError(f"--json {target}: cannot write ({exc.strerror})") from None
