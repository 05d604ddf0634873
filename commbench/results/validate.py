"""The boundary: everything commbench reads from a file it did not just write is checked here,
once, before any other code sees it (run dirs get forwarded; treat them as untrusted).

- JSON and TOML: bounded in size and nesting; a RecursionError is never let out.
- Rows: each field's type and range (finite positive latencies, sizes > 0 and sane, world size
  an int >= 1, a known status, names that are plain tokens); a row that fails is named with its
  line and skipped, never trusted.
- run.json: the fields the tool acts on have their types and ranges.
- Text: every string is stripped of terminal control and escape characters (and bidi overrides),
  so nothing from a run file steers the terminal, a markdown table or an XML file.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
import sys
from typing import Any, Callable

from commbench.errors import UsageError
from commbench.results.shapes import BACKEND_FACTS, problem, snapshot_problem
from commbench.results.text import clean, clean_text, needs_cleaning
from commbench.results.schema import READABLE_SCHEMAS, STATUSES, Measurement, migrate_row
from commbench.units import MAX_MESSAGE_BYTES

MAX_NESTING = 64                 # JSON/TOML depth; real files nest < 10 deep
MAX_RUN_INFO_BYTES = 64 << 20    # run.json, a snapshot; rows are streamed, one line at a time
SPEC_MAX_BYTES = 1 << 20         # a qualify spec is a page of TOML
MAX_LINE_BYTES = 1 << 20         # one row of measurements.jsonl
MAX_WORLD_SIZE = 1 << 20
MAX_COUNT = 1 << 62              # calls, elements, samples

# dtype, mode and op name files and groups: plain tokens ("bf16", "graph", "uint8").
_TOKEN_RE = re.compile(r"[A-Za-z0-9_.+-]{1,64}")
_TOKEN_FIELDS = ("dtype", "mode", "op")
_LATENCY_FIELDS = ("latency_us", "latency_rank_mean_us", "jitter_p10_us", "jitter_p50_us", "jitter_p90_us",
                   "jitter_p99_us", "jitter_min_us", "jitter_max_us")
_NON_NEGATIVE_FIELDS = ("algbw_gbps", "busbw_gbps", "count", "iterations", "ops_per_graph", "jitter_samples",
                        "checked_calls", "wrong_elements", "first_wrong_call", "failed_rank")
_POSITIVE_INT_FIELDS = ("nodes", "tokens", "hidden")


def is_plain_name(text: str) -> bool:
    """A dtype, mode or op as rows hold them: letters, digits and _.+- only, 1 to 64 of them."""
    return _TOKEN_RE.fullmatch(text) is not None


def file_stem(text: str) -> str:
    """A name from data made safe as one path component: 'bf16' stays, '../x' becomes '___x'."""
    return re.sub(r"[^A-Za-z0-9_.+-]", "_", text).lstrip(".")[:64] or "_"


def depth(value: Any, limit: int = MAX_NESTING) -> int:
    """Nesting depth of a parsed value, counting no further than limit + 1."""
    todo, deepest = [(value, 1)], 0
    while todo:
        item, level = todo.pop()
        deepest = max(deepest, level)
        if level > limit:
            break
        children = item.values() if isinstance(item, dict) else item if isinstance(item, list) else ()
        todo.extend((child, level + 1) for child in children if isinstance(child, (dict, list)))
    return deepest


def _bounded(parse: Callable[[str], Any], errors: tuple[type[Exception], ...], kind: str, text: str,
             where: str) -> Any:
    """parse(text), cleaned; a parse error, or nesting past MAX_NESTING, is bad input."""
    too_deep = f"{where}: nested deeper than {MAX_NESTING} levels; no {kind} file commbench reads"
    try:
        value = parse(text)
    except RecursionError:
        raise UsageError(too_deep) from None
    except errors as exc:
        detail = f"{exc.msg} at line {exc.lineno}" if isinstance(exc, json.JSONDecodeError) else str(exc)
        raise UsageError(f"{where}: not valid {kind} ({detail})") from None
    if depth(value) > MAX_NESTING:
        raise UsageError(too_deep)
    return clean(value)


def loads_json(text: str, where: str) -> Any:
    """Parse JSON from a file the user named; bad JSON, or JSON nested too deep, is bad input."""
    return _bounded(json.loads, (json.JSONDecodeError,), "JSON", text, where)


def loads_toml(text: str, where: str) -> dict[str, Any]:
    """Parse a TOML file the user named, with the same bounds as JSON."""
    try:
        import tomllib
    except ImportError:   # Python 3.10
        import tomli as tomllib
    return _bounded(tomllib.loads, (tomllib.TOMLDecodeError,), "TOML", text, where)


# ---------------------------------------------------------------- rows

def _kinds(annotation: str) -> frozenset[str]:
    """'dict[str, Any] | None' -> {'dict', 'None'}."""
    return frozenset(part.strip().split("[")[0] for part in annotation.split("|"))


def _fits(value: Any, kinds: frozenset[str]) -> bool:
    """Does a JSON value fit a Measurement field's kinds (e.g. {'float', 'None'})?"""
    if value is None:
        return "None" in kinds
    if isinstance(value, bool):
        return "bool" in kinds
    if isinstance(value, int):
        return bool(kinds & {"int", "float"})
    if isinstance(value, float):
        return "float" in kinds and math.isfinite(value)
    return (isinstance(value, str) and "str" in kinds) or (isinstance(value, dict) and "dict" in kinds)


_FIELD_KINDS = {f.name: _kinds(str(f.type)) for f in dataclasses.fields(Measurement)}
# The exact JSON types each field takes, for the fast check of a row; a value of any other type
# (a bool, a list, a subclass) goes through _fits, which names it.
_JSON_TYPES = {"None": (type(None),), "bool": (bool,), "int": (int,), "float": (int, float), "str": (str,),
               "dict": (dict,)}
_FIELD_TYPES = {name: frozenset(t for kind in kinds for t in _JSON_TYPES.get(kind, ()))
                for name, kinds in _FIELD_KINDS.items()}
_REQUIRED = [f.name for f in dataclasses.fields(Measurement)
             if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]


def _range_problem(data: dict[str, Any]) -> str | None:
    """The first field out of its range, named with its value; None when all are in range."""
    for name in _LATENCY_FIELDS:
        value = data.get(name)
        if value is not None and not value > 0:
            return f"{name} is {value!r}, not a positive time"
    for name in _NON_NEGATIVE_FIELDS:
        value = data.get(name)
        if value is not None and not 0 <= value <= MAX_COUNT:
            return f"{name} is {value!r}, not a count >= 0"
    for name in _POSITIVE_INT_FIELDS:
        value = data.get(name)
        if value is not None and not (isinstance(value, int) and 1 <= value <= MAX_COUNT):
            return f"{name} is {value!r}, not a whole number >= 1"
    size = data["message_bytes"]
    # The driver's row for a child killed outside every backend measured no message (size 0).
    low = 1 if data["status"] in ("ok", "wrong") else 0
    if not (isinstance(size, int) and low <= size <= MAX_MESSAGE_BYTES):
        return f"message_bytes is {size!r}, not a size from {low} to {MAX_MESSAGE_BYTES} bytes"
    world = data["world_size"]
    if not (isinstance(world, int) and 1 <= world <= MAX_WORLD_SIZE):
        return f"world_size is {world!r}, not a whole number of ranks >= 1"
    for name in _TOKEN_FIELDS:
        if name in data and not is_plain_name(data[name]):
            return f"{name} is {data[name]!r}, not a plain name"
    for name in ("env_setting", "requested"):
        if not all(isinstance(v, str) for v in (data.get(name) or {}).values()):
            return f"{name} holds a value that is not text"
    return None


def _types_fit(data: dict[str, Any]) -> bool:
    """Every field's value of a type it takes, floats finite: one set lookup per field (the
    row-by-row _fits made reading 10^5 rows take seconds). False: look closer with _fits."""
    for name, value in data.items():
        allowed = _FIELD_TYPES.get(name)
        if allowed is None:
            continue
        kind = type(value)
        if kind not in allowed or (kind is float and not math.isfinite(value)):
            return False
    return True


def row_problem(data: Any) -> str | None:
    """Why a parsed line is not a row of a readable schema (after migration); None when it is."""
    if not isinstance(data, dict):
        return f"a JSON {type(data).__name__}, not an object"
    if data.get("schema") not in READABLE_SCHEMAS:
        return f"schema {data.get('schema')!r}; this commbench reads {', '.join(map(str, READABLE_SCHEMAS))}"
    data = migrate_row(data)
    missing = [name for name in _REQUIRED if name not in data]
    if missing:
        return f"no {', '.join(missing)}"
    if not _types_fit(data):
        wrong = [name for name, kinds in _FIELD_KINDS.items() if name in data and not _fits(data[name], kinds)]
        if wrong:
            return f"{wrong[0]} is {data[wrong[0]]!r}"
    if data["status"] not in STATUSES:
        return f"unknown status {data['status']!r}"
    return _range_problem(data)


def parse_row(line: bytes) -> tuple[Measurement | None, str | None]:
    """One line of measurements.jsonl: (the row, None) or (None, why it is not one)."""
    if len(line) > MAX_LINE_BYTES:
        return None, f"{len(line)} bytes long, more than any row"
    try:
        data = json.loads(line)
    except (ValueError, RecursionError):    # not JSON, not UTF-8, or nested past the parser
        return None, "not JSON"
    # Only a line with that many brackets can nest that deep: the walk is for those alone.
    if line.count(b"{") + line.count(b"[") > MAX_NESTING and depth(data) > MAX_NESTING:
        return None, f"nested deeper than {MAX_NESTING} levels"
    if isinstance(data, dict) and data.get("schema") in READABLE_SCHEMAS:
        data = migrate_row(data)   # once: row_problem and from_dict then find it current
    problem = row_problem(data)
    if problem:
        return None, clean_text(problem)
    # A control character in a string is either raw (C1, bidi) or an escape in the line: \u001b,
    # or one of JSON's short ones (\n, \r, \b, \f, \t).
    dirty = b"\\" in line or needs_cleaning(line.decode("utf-8", errors="replace"))
    if dirty:   # a row's text is names, settings and versions, one line each: only its reason may hold lines
        data = {clean_text(str(k)): clean(v, one_line=k not in _MULTI_LINE_FIELDS) for k, v in data.items()}
    row = Measurement.from_dict(data)
    for name in _SHARED_TEXT:   # a few names repeat on every row: one copy each, not one a row
        value = getattr(row, name)
        if value.__class__ is str and len(value) <= 64:
            setattr(row, name, sys.intern(value))
    return row, None


_MULTI_LINE_FIELDS = ("reason",)
_SHARED_TEXT = ("backend", "mode", "dtype", "status", "op", "setting_applied", "wrong_kind")


# ---------------------------------------------------------------- run.json

# Fields of run.json the tool acts on, with what each must be when present.
_INFO_CHECKS: dict[str, tuple[type | tuple[type, ...], str]] = {
    "world_size": (int, "a whole number of ranks >= 1"), "nodes": (int, "a whole number >= 1"),
    "local_world_size": (int, "a whole number >= 1"),
    "plan": (dict, "a table"), "gpus": (list, "a list"), "backends": (list, "a list"),
    "env": (dict, "a table"), "env_settings": (list, "a list"), "imports": (list, "a list"),
    "resumed": (list, "a list"), "backend_facts": (dict, "a table"), "verdicts": (dict, "a table"),
    "emulation": (dict, "a table"), "versions": (dict, "a table"), "snapshot": (dict, "a table"),
    "host": (str, "text"), "run_id": (str, "text"), "source": (str, "text"),
    # The rest of RunInfo's fields (info.py): a reader uses each as its type says.
    "device_type": (str, "text"), "shares_gpus": (bool, "true or false"), "command": (list, "a list"),
    "args": ((dict, list), "a table or a list"), "notes": (list, "a list"), "note": (str, "text"),
    "driver": (dict, "a table"), "provenance": (str, "text"),
    # seconds since 1970, or a date as text (an import records nccl-tests' own start_time)
    "started": ((int, float, str), "a time"), "finished": ((int, float, str), "a time"),
    "interrupted": ((int, float, str), "a time"),
}
# A time in run.json in seconds: since 1970, up to the year 2242 (a date renderer's range).
MAX_EPOCH_S = float(1 << 33)


def info_problem(info: dict[str, Any]) -> str | None:
    """The first field of run.json of the wrong type or range; None when all are right. The
    probe snapshot and the backends' recorded engine settings are checked to their leaves
    (commbench.results.shapes): a malformed one makes the run.json bad input, as any field."""
    for name, (kind, what) in _INFO_CHECKS.items():
        value = info.get(name)
        if value is None:
            continue
        if isinstance(value, bool) != (kind is bool) or not isinstance(value, kind):
            return f"{name} is {_short(value)}, not {what}"
        if kind is int and not 1 <= value <= MAX_WORLD_SIZE:
            return f"{name} is {value}, not {what}"
        if what == "a time" and not isinstance(value, str) and not 0 <= value <= MAX_EPOCH_S:   # NaN fails too
            return f"{name} is {_short(value)}, not a time in seconds since 1970"
    if info.get("snapshot") is not None and (wrong := snapshot_problem(info["snapshot"])):
        return f"snapshot: {wrong}"
    return problem(info.get("backend_facts"), BACKEND_FACTS, "backend_facts") if info.get("backend_facts") else None


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
