"""Rows of one shape encoded from a template, not built and serialised one by one.

An import writes 10^6 rows (a 100 MB nccl-tests log) that share almost every field: only a few
values change from row to row (size, times, the line it came from). Encoding each row in full
(json_line and csv_line: a Measurement, its dict, json.dumps of 45 fields) cost ~70 µs a row.
Templates builds the full row once per *shape* with a sentinel in each slot, encodes it, and keeps
both lines with each sentinel's text turned into a format field; a later row of that shape is
the two lines with its values filled in.

A shape is what the caller says it is plus, for each slot, its type, and its value itself where
it is falsy (None, 0, ''): code that tests a value for truth then sees the same thing in the
sentinel as in the row. A template is used only once it reproduced, exactly, the full encoding
of the row it was built from; one that does not (a slot's value formatted into text, a type the
lines spell another way) is dropped, and rows of that shape are encoded in full.
"""

from __future__ import annotations

import json
from json.encoder import encode_basestring_ascii
from typing import Any, Callable, Hashable, Sequence

from commbench.results.rundir import Lines, csv_line, json_line
from commbench.results.schema import Measurement

Build = Callable[[Sequence[Any]], Measurement]   # the full row of these slot values


def _sentinel(kind: type, index: int) -> Any:
    """A value of `kind` whose text no row holds otherwise: large odd integers, tiny floats,
    strings with control characters (JSON spells those as \\u escapes)."""
    if kind is int:
        return 7_316_029_000_000_000_000 + 1_000_003 * index
    if kind is float:
        return float(f"7.316029{index:03d}e-291")
    return f"\x01slot{index}\x01"


def _texts(value: Any) -> tuple[str, str]:
    """A slot value's text in a JSON line, and inside a quoted CSV cell of JSON (quotes doubled)."""
    if value.__class__ is str:
        text = encode_basestring_ascii(value)   # json.dumps's own (ensure_ascii), without its wrapper
        return text, text.replace('"', '""')
    text = repr(value)   # int and float: what json.dumps and csv write
    return text, text


_KINDS = (int, float, str)


class Templates:
    """Lines of rows, from a template per shape (see the module's docstring)."""

    def __init__(self) -> None:
        self._made: dict[Hashable, tuple[str, str] | None] = {}

    def lines(self, shape: Hashable, values: Sequence[Any], build: Build) -> Lines:
        key = (shape, *[v.__class__ if v else (v.__class__, repr(v)) for v in values])
        made = self._made.get(key, False)
        if made is False:
            row = build(values)
            full = Lines(json_line(row), csv_line(row))
            made = self._made[key] = self._make(values, build, full)
            return full
        if made is None:
            row = build(values)
            return Lines(json_line(row), csv_line(row))
        texts: list[str] = []
        for value in values:   # _texts, inlined: this runs once a row
            if value:
                if value.__class__ is str:
                    text = encode_basestring_ascii(value)
                    texts += (text, text.replace('"', '""'))
                else:
                    text = repr(value)
                    texts += (text, text)
        return Lines(made[0].format(*texts), made[1].format(*texts))

    @staticmethod
    def _make(values: Sequence[Any], build: Build, full: Lines) -> tuple[str, str] | None:
        """The shape's two template lines, or None when they would not give `full` back."""
        if any(v and v.__class__ not in _KINDS for v in values):
            return None
        sentinels = [_sentinel(v.__class__, i) if v else v for i, v in enumerate(values)]
        probe = build(sentinels)
        json_text, csv_text = (line.replace("{", "{{").replace("}", "}}")
                               for line in (json_line(probe), csv_line(probe)))
        field = 0
        for sentinel in sentinels:
            if not sentinel:
                continue
            in_json, in_csv = _texts(sentinel)
            json_text = json_text.replace(in_json, f"{{{field}}}")
            # In the CSV a string slot lies in a JSON cell (quotes doubled); a number is as in JSON.
            csv_text = csv_text.replace(in_csv, f"{{{field + 1}}}")
            field += 2
        texts = [text for v in values if v for text in _texts(v)]
        try:
            same = (json_text.format(*texts), csv_text.format(*texts)) == full
        except (IndexError, KeyError, ValueError):
            same = False
        return (json_text, csv_text) if same else None
