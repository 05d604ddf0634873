"""What a fact read from an engine's source may be: the kinds its built-in value has, place by
place (a size a whole number >= 0, a list of world sizes a list or tuple of them, a table's keys
and values those of the built-in table, a pair a pair), bounded in values and text. facts.read_fact
checks every value it reads here before anything uses it: a NaN, an inf, a string or a list for
a size, None for a list of world sizes and True for a size each went on into the gates (a
traceback, or "takes up to TrueB")."""

from __future__ import annotations

import math
import reprlib
from dataclasses import dataclass
from typing import Any

from commbench.results.text import capped

MAX_VALUES = 1024      # values in one fact, containers and items together: the largest built in has 25
MAX_TEXT = 256         # a name, an env default, a kernel name: the longest built in has 42 characters
MAX_WHOLE = 1 << 63    # sizes, world sizes, capabilities, tokens: none is near

# A built-in None (a variable without a default) says nothing of the type: any short scalar.
ANY = "any"
_SAID = {"bool": "True or False", "int": "a whole number >= 0", "number": "a number >= 0", "text": "text",
         ANY: "a number, text, True/False or None"}


@dataclass(frozen=True)
class Kind:
    """The values a place of a fact takes: scalars of these kinds, or a container whose items
    (a list or tuple: `items`; a set: `members`; a table: `keys` and `values`) are of theirs."""

    scalars: frozenset[str] = frozenset()
    items: Kind | None = None
    length: int | None = None       # a tuple of one length at every place of the built-in value: a pair
    members: Kind | None = None
    keys: Kind | None = None
    values: Kind | None = None

    def said(self) -> str:
        words = [_SAID[s] for s in sorted(self.scalars) if not (s == "int" and "number" in self.scalars)]
        words += ["a list"] if self.items else []
        words += ["a set"] if self.members else []
        words += ["a table"] if self.keys else []
        return " or ".join(words)


def kind_of(examples: list[Any]) -> Kind:
    """The kind of a place from the built-in values at it (one, or each item of a container)."""
    if not examples:
        return Kind(frozenset({ANY}))
    scalars: set[str] = set()
    sequences, sets, tables = [], [], []
    for value in examples:
        if value is None:
            scalars.add(ANY)
        elif isinstance(value, bool):
            scalars.add("bool")
        elif isinstance(value, (int, float)):
            scalars.add("int" if isinstance(value, int) else "number")
        elif isinstance(value, str):
            scalars.add("text")
        elif isinstance(value, (list, tuple)):
            sequences.append(value)
        elif isinstance(value, (set, frozenset)):
            sets.append(value)
        elif isinstance(value, dict):
            tables.append(value)
        else:
            raise TypeError(f"a built-in fact holds a {type(value).__name__}")
    lengths = {len(s) for s in sequences}
    pairs = len(sequences) > 1 and len(lengths) == 1 and all(isinstance(s, tuple) for s in sequences)
    return Kind(frozenset(scalars),
                kind_of([i for s in sequences for i in s]) if sequences else None, lengths.pop() if pairs else None,
                kind_of([m for s in sets for m in s]) if sets else None,
                kind_of([k for t in tables for k in t]) if tables else None,
                kind_of([v for t in tables for v in t.values()]) if tables else None)


def problem(value: Any, kind: Kind, where: str) -> str | None:
    """Why `value` is not of `kind` ("max_size is nan, not a whole number >= 0"), the place named
    from `where` down; None when it is. Stops at MAX_VALUES: a value the reader made of names bound
    to names (a list of a list of a list) can be far larger than its source."""
    seen = [0]
    return _problem(value, kind, where, seen)


def _problem(value: Any, kind: Kind, where: str, seen: list[int]) -> str | None:
    seen[0] += 1
    if seen[0] > MAX_VALUES:
        return f"{where}: more than {MAX_VALUES} values, more than any engine fact holds"
    if kind.items and isinstance(value, (list, tuple)):
        if kind.length is not None and len(value) != kind.length:
            return f"{where} is {shown(value)}, not {kind.length} values"
        return next(filter(None, (_problem(item, kind.items, f"{where}[{i}]", seen)
                                  for i, item in enumerate(value))), None)
    if kind.members and isinstance(value, (set, frozenset)):
        return next(filter(None, (_problem(item, kind.members, f"{where} member", seen) for item in value)), None)
    if kind.keys and kind.values and isinstance(value, dict):
        for key, item in value.items():
            wrong = (_problem(key, kind.keys, f"{where} key {shown(key)}", seen)
                     or _problem(item, kind.values, f"{where}[{shown(key)}]", seen))
            if wrong:
                return wrong
        return None
    return None if _scalar_fits(value, kind.scalars) else f"{where} is {shown(value)}, not {kind.said()}"


def _scalar_fits(value: Any, scalars: frozenset[str]) -> bool:
    if value is None:
        return ANY in scalars
    if value.__class__ is bool:
        return bool(scalars & {"bool", ANY})
    if value.__class__ is int:
        return bool(scalars & {"int", "number", ANY}) and 0 <= value < MAX_WHOLE
    if value.__class__ is float:
        return bool(scalars & {"number", ANY}) and math.isfinite(value) and 0 <= value < MAX_WHOLE
    if value.__class__ is str:
        return bool(scalars & {"text", ANY}) and len(value) <= MAX_TEXT
    return False


_REPR = reprlib.Repr()
_REPR.maxstring = _REPR.maxother = 40
_REPR.maxlevel, _REPR.maxlist, _REPR.maxtuple, _REPR.maxset, _REPR.maxdict = 2, 4, 4, 4, 4


def shown(value: Any) -> str:
    """A value from an engine's file in one short, clean line (a few items of a container, the
    start of a long text; never the digits of a huge number, whose repr would raise)."""
    if isinstance(value, int) and value.bit_length() > 64:
        return f"a {value.bit_length()}-bit number"
    return capped(_REPR.repr(value), 60)
