"""Read-only access to sysfs/procfs: a value, None when absent, or 'unknown (needs root)'."""

from __future__ import annotations

from pathlib import Path

NEEDS_ROOT = "unknown (needs root)"


class Unreadable(Exception):
    """The file exists but this user may not read it."""


def read_text(path: str | Path) -> str | None:
    """File contents stripped; None when the file does not exist; Unreadable when denied."""
    try:
        return Path(path).read_text().strip()
    except FileNotFoundError:
        return None
    except PermissionError as exc:
        raise Unreadable(str(path)) from exc
    except OSError:
        return None


def read_or_note(path: str | Path, missing: str | None = None) -> str | None:
    """Like read_text, with 'unknown (needs root)' instead of an exception."""
    try:
        value = read_text(path)
    except Unreadable:
        return NEEDS_ROOT
    return missing if value is None else value


def read_bytes(path: str | Path) -> bytes | None:
    try:
        return Path(path).read_bytes()
    except FileNotFoundError:
        return None
    except PermissionError as exc:
        raise Unreadable(str(path)) from exc
