"""A JSON object read from a file a piece at a time: its fields, and the items of one array
field one by one, so that a file of 10^5 records (nccl-tests -J of a long -N run) is never held
whole, as text or as objects. The stdlib has no incremental parser: each value is decoded by
json's own raw_decode from a buffer of the file that grows only while a value is cut by its end.

    for event in object_events(path, "results", "nccl-tests -J output"):
        ("field", name, value) | ("array", name, None) then ("item", index, value) for each item

A syntax error, or the file ending inside the object, raises JsonError with json's message and
its line and column in the file; the events before it have been given.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterator

from commbench.errors import UsageError
from commbench.files import text_blocks

_BLOCK_BYTES = 1 << 20
_WHITE = " \t\r\n"


class JsonError(Exception):
    """json's message, where in the file (line and column from 1), and whether the file ended there."""

    def __init__(self, msg: str, lineno: int, colno: int, at_end: bool):
        super().__init__(f"{msg}: line {lineno} column {colno}")
        self.msg, self.lineno, self.colno, self.at_end = msg, lineno, colno, at_end


class _Buffer:
    """The file's text from `start` on; what was dropped before it is counted in lines."""

    def __init__(self, path: Path, what: str):
        self.path, self.what = path, what
        self.blocks = text_blocks(path, what, _BLOCK_BYTES)
        self.text, self.start, self.eof = "", 0, False
        self.lines_before, self.line_start = 0, 0   # newlines dropped; absolute offset where the last line starts

    def more(self) -> bool:
        """Read the next block; False at the end of the file."""
        block = None if self.eof else next(self.blocks, None)
        self.eof = block is None
        if block is not None:
            self.text += block
        return block is not None

    def char(self, at: int) -> str:
        """The character at absolute offset `at`; '' past the end of the file."""
        while at - self.start >= len(self.text):
            if not self.more():
                return ""
        return self.text[at - self.start]

    def skip_white(self, at: int) -> int:
        while (c := self.char(at)) and c in _WHITE:
            at += 1
        return at

    def value(self, at: int) -> tuple[Any, int]:
        """The JSON value that starts at `at`, and the offset after it."""
        while True:
            try:
                value, end = _DECODER.raw_decode(self.text, at - self.start)
            except json.JSONDecodeError as exc:
                if self.more():
                    continue
                raise self.error(exc.msg, self.start + exc.pos) from None
            except RecursionError:
                raise UsageError(f"{self.path}: nested too deep for {self.what}") from None
            # A value that ends with the text may go on in the next block (a number cut in two).
            if end == len(self.text) and self.more():
                continue
            return value, self.start + end

    def drop_before(self, at: int) -> None:
        """Forget the text before `at` (a record read): the buffer holds about one block."""
        cut = at - self.start
        if cut < _BLOCK_BYTES:
            return
        dropped = self.text[:cut]
        newlines = dropped.count("\n")
        if newlines:
            self.lines_before += newlines
            self.line_start = self.start + dropped.rindex("\n") + 1
        self.text, self.start = self.text[cut:], at

    def error(self, msg: str, at: int) -> JsonError:
        """JsonError at absolute offset `at`, with json's line and column."""
        before = self.text[:max(0, at - self.start)]
        newlines = before.count("\n")
        line_start = self.start + before.rindex("\n") + 1 if newlines else self.line_start
        return JsonError(msg, self.lines_before + newlines + 1, at - line_start + 1,
                         self.eof and self.skip_white(at) - self.start >= len(self.text))

    def close(self) -> None:
        self.blocks.close()


_DECODER = json.JSONDecoder()


def object_events(path: Path, array_field: str, what: str) -> Iterator[tuple[str, Any, Any]]:
    """("field", name, value) for each field of the file's top-level object, in order, except
    that an array under `array_field` comes as ("array", name, None), then ("item", index, value)
    for each of its items."""
    buffer = _Buffer(path, what)
    try:
        at = buffer.skip_white(0)
        if buffer.char(at) != "{":
            raise buffer.error("Expecting value", at)
        at = buffer.skip_white(at + 1)
        if buffer.char(at) == "}":
            _end(buffer, at + 1)
            return
        while True:
            if buffer.char(at) != '"':
                raise buffer.error("Expecting property name enclosed in double quotes", at)
            name, at = buffer.value(at)
            at = buffer.skip_white(at)
            if buffer.char(at) != ":":
                raise buffer.error("Expecting ':' delimiter", at)
            at = buffer.skip_white(at + 1)
            if name == array_field and buffer.char(at) == "[":
                yield "array", name, None
                at = yield from _items(buffer, at)
                at = _after(buffer, at, "}")
            else:
                value, at = buffer.value(at)
                at = yield from _given(("field", name, value), buffer, at, "}")
            if buffer.char(at) == "}":
                _end(buffer, at + 1)
                return
            at = buffer.skip_white(at + 1)
    finally:
        buffer.close()


def _end(buffer: _Buffer, at: int) -> None:
    """Nothing but white space may follow the object (json.loads says "Extra data")."""
    at = buffer.skip_white(at)
    if buffer.char(at):
        raise buffer.error("Extra data", at)


def _items(buffer: _Buffer, at: int) -> Iterator[tuple[str, Any, Any]]:
    """The items of the array that starts at `at`; returns the offset after it."""
    at = buffer.skip_white(at + 1)
    if buffer.char(at) == "]":
        return at + 1
    index = 0
    while True:
        value, at = buffer.value(at)
        at = yield from _given(("item", index, value), buffer, at, "]")
        index += 1
        buffer.drop_before(at)
        if buffer.char(at) == "]":
            return at + 1
        at = buffer.skip_white(at + 1)


def _after(buffer: _Buffer, at: int, close: str) -> int:
    """Where the ',' or `close` after a value is (json.loads's error when it is neither)."""
    at = buffer.skip_white(at)
    if buffer.char(at) not in (",", close):
        raise buffer.error("Expecting ',' delimiter", at)
    return at


def _given(event: tuple[str, Any, Any], buffer: _Buffer, at: int, close: str) -> Iterator[tuple[str, Any, Any]]:
    """Give the event of a value that ended at `at`, and return where its ',' or `close` is. A
    number or literal is given only once that is known: the end of a cut file may cut it short
    (228 of 22809); an object, array or string ends itself, and is given first."""
    if isinstance(event[2], (dict, list, str)):
        yield event
        return _after(buffer, at, close)
    at = _after(buffer, at, close)
    yield event
    return at
