"""Rows of one shape encoded from a template, not built and serialised one by one.

An import writes 10^6 rows (a 100 MB nccl-tests log) that share almost every field: only a few
values change from row to row (size, times, the line it came from). Encoding each row in full
(json_line and csv_line: a Measurement, its dict, json.dumps of 45 fields) cost ~70 µs a row.
Templates builds the full row once per *shape* with a sentinel in each slot, encodes it, and keeps
both lines with each sentinel's text turned into a slot; a later row of that shape is
the two lines with its values filled in.

A shape is what the caller says it is plus, for each slot, its type, and its value itself where
it is falsy (None, 0, ''): code that tests a value for truth then sees the same thing in the
sentinel as in the row. A template is used only once it reproduced, exactly, the full encoding
of the row it was built from; one that does not (a slot's value formatted into text, a type the
lines spell another way) is dropped, and rows of that shape are encoded in full.
"""

from __future__ import annotations

import operator
import re
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


class _Line:
    """One line as its literal pieces with slots between them; filled in by a join (7x faster
    than str.format on a 1.6 KB line)."""

    def __init__(self, line: str, slots: dict[str, int]):
        """`slots`: each sentinel's text in the line -> the index of its value's text."""
        pattern = re.compile("(" + "|".join(map(re.escape, sorted(slots, key=len, reverse=True))) + ")")
        pieces = pattern.split(line) if slots else [line]
        self._out: list[str] = list(pieces)   # literals at even places, each row's texts at odd ones
        refs = [slots[text] for text in pieces[1::2]]
        self._pick = (operator.itemgetter(*refs) if len(refs) > 1
                      else (lambda texts: (texts[refs[0]],)) if refs else (lambda texts: ()))

    def fill(self, texts: list[str]) -> str:
        self._out[1::2] = self._pick(texts)
        return "".join(self._out)


class Templates:
    """Lines of rows, from a template per shape (see the module's docstring)."""

    def __init__(self) -> None:
        self._made: dict[Hashable, tuple[_Line, _Line] | None] = {}

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
        return Lines(made[0].fill(texts), made[1].fill(texts))

    @staticmethod
    def _make(values: Sequence[Any], build: Build, full: Lines) -> tuple[_Line, _Line] | None:
        """The shape's two template lines, or None when they would not give `full` back."""
        if any(v and v.__class__ not in _KINDS for v in values):
            return None
        sentinels = [_sentinel(v.__class__, i) if v else v for i, v in enumerate(values)]
        probe = build(sentinels)
        in_json: dict[str, int] = {}
        in_csv: dict[str, int] = {}
        for sentinel in filter(None, sentinels):
            json_text, csv_text = _texts(sentinel)
            # In the CSV a string slot lies in a JSON cell (quotes doubled); a number is as in JSON.
            in_json[json_text] = 2 * len(in_json)
            in_csv[csv_text] = 2 * len(in_csv) + (csv_text != json_text)
        made = _Line(json_line(probe), in_json), _Line(csv_line(probe), in_csv)
        texts = [text for v in values if v for text in _texts(v)]
        return made if (made[0].fill(texts), made[1].fill(texts)) == full else None
