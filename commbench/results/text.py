"""The one text cleaner: every string commbench did not write itself (a run's rows and run.json,
a probe snapshot, a trace's kernel and device names, an nccl-tests log) passes it before any
renderer (terminal, markdown, HTML, JSON written as text, paste blocks) sees it.

Removed: the C0 and C1 controls (ESC, BEL, CSI, ...), DEL, and the Unicode bidi controls that
reorder a line as shown (the embeddings, overrides, isolates and marks), so a name cannot
retitle or clear the terminal, hide text, or break an XML file.
"""

from __future__ import annotations

import re
from typing import Any

_BIDI = "\u061c\u200e\u200f\u202a-\u202e\u2066-\u2069"
_CONTROL_RE = re.compile(f"[\x00-\x08\x0b-\x1f\x7f-\x9f{_BIDI}]")        # tabs and newlines stay
_LINE_CONTROL_RE = re.compile(f"[\x00-\x1f\x7f-\x9f{_BIDI}]")            # one line: they go too


def clean_text(text: str, one_line: bool = True) -> str:
    """`text` without control/escape characters (tabs and, unless one_line, newlines stay)."""
    return (_LINE_CONTROL_RE if one_line else _CONTROL_RE).sub("", text)


def needs_cleaning(text: str) -> bool:
    """Does `text` hold a character clean_text(one_line=False) removes?"""
    return _CONTROL_RE.search(text) is not None


def clean(value: Any) -> Any:
    """A parsed JSON value with every string (keys too) cleaned; text values keep their newlines."""
    if isinstance(value, str):
        return clean_text(value, one_line=False)
    if isinstance(value, dict):
        return {clean_text(str(k)): clean(v) for k, v in value.items()}
    if isinstance(value, list):
        return [clean(v) for v in value]
    return value
