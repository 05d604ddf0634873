"""The one text cleaner: every string commbench did not write itself (a run's rows and run.json,
a probe snapshot, a trace's kernel and device names, an nccl-tests log) passes it before any
renderer (terminal, markdown, HTML, JSON written as text, paste blocks) sees it.

Removed: the C0 and C1 controls (ESC, BEL, CSI, ...), DEL, and every Unicode format or
separator character that is not shown as itself: the bidi controls that reorder a line (the
embeddings, overrides, isolates and marks), zero-width spaces and joiners, the byte-order mark,
the tag characters that carry hidden ASCII, and the line and paragraph separators that some
readers break a line at. So a name cannot retitle or clear the terminal, hide or reorder text,
split a paste-ready line, or break an XML file.

Text from those files is also shown bounded: capped() is the one way to cut it.
"""

from __future__ import annotations

import re
from typing import Any

# Unicode's format (Cf) and line/paragraph separator (Zl, Zp) characters, as of Unicode 15 (a test
# compares it with the running Python's unicodedata): the bidi controls are among them.
_INVISIBLE = ("\u00ad\u0600-\u0605\u061c\u06dd\u070f\u0890\u0891\u08e2\u180e\u200b-\u200f\u2028-\u202e"
              "\u2060-\u2064\u2066-\u206f\ufeff\ufff9-\ufffb\U000110bd\U000110cd\U00013430-\U0001343f"
              "\U0001bca0-\U0001bca3\U0001d173-\U0001d17a\U000e0001\U000e0020-\U000e007f")
_CONTROL_RE = re.compile(f"[\x00-\x08\x0b-\x1f\x7f-\x9f{_INVISIBLE}]")        # tabs and newlines stay
_LINE_CONTROL_RE = re.compile(f"[\x00-\x08\x0e-\x1f\x7f-\x9f{_INVISIBLE}]")
_LINE_BREAK_RE = re.compile("[\t-\r]")           # one line: tabs and line breaks become spaces
CUT_MARK = " ..."


def clean_text(text: str, one_line: bool = True) -> str:
    """`text` without control/escape characters; tabs and newlines stay, or with one_line they
    (and the other line breaks: CR, VT, FF) become spaces, so words either side stay apart."""
    if one_line:
        return _LINE_BREAK_RE.sub(" ", _LINE_CONTROL_RE.sub("", text))
    return _CONTROL_RE.sub("", text)


def capped(text: object, max_chars: int) -> str:
    """`text` cleaned onto one line, at most `max_chars` long: a longer one is cut at its last word
    that fits and marked with CUT_MARK (a word longer than the cap is cut inside)."""
    line = clean_text(str(text))
    if len(line) <= max_chars:
        return line
    cut = max(1, max_chars - len(CUT_MARK))
    keep = line[:cut]
    if line[cut] != " " and " " in keep.strip():     # the cut is inside a word: drop that word
        keep = keep.rsplit(" ", 1)[0]
    return keep.rstrip() + CUT_MARK


def needs_cleaning(text: str) -> bool:
    """Does `text` hold a character clean_text(one_line=False) removes?"""
    return _CONTROL_RE.search(text) is not None


def clean(value: Any, one_line: bool = False) -> Any:
    """A parsed JSON value with every string (keys too: one line) cleaned; text values keep
    their newlines unless one_line."""
    if isinstance(value, str):
        return clean_text(value, one_line)
    if isinstance(value, dict):
        return {clean_text(str(k)): clean(v, one_line) for k, v in value.items()}
    if isinstance(value, list):
        return [clean(v, one_line) for v in value]
    return value
