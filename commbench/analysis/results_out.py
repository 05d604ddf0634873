"""An analysis command's result, rendered as data: JSON (`--json FILE`, `dataclasses.asdict` of
the frozen result) and a self-contained HTML page of the same data (`--html FILE`). The text a
command prints is its own renderer; these two are shared, so the JSON and the page never drift
apart: both come from `data(result)`.

Every string in the page is escaped: backend names, reasons and settings come from run files,
which are untrusted (a backend named `<script>` prints as text).
"""

from __future__ import annotations

import argparse
import dataclasses
import html
from pathlib import Path
from typing import Any

from commbench.errors import UsageError
from commbench import files
from commbench.files import check_file_target

STYLE = ("body{font-family:sans-serif;margin:1.5em;max-width:110em}table{border-collapse:collapse;margin:.3em 0}"
         "th,td{border:1px solid #ccc;padding:.15em .5em;text-align:left;vertical-align:top}"
         "th{background:#f3f3f3}.null{color:#999}")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--html", metavar="FILE",
                        help="also write the result as a self-contained HTML page (the same data as --json)")


def check_targets(args: argparse.Namespace) -> None:
    """Fail before any work when --json or --html cannot be written."""
    html_target = getattr(args, "html", None)    # report writes its own page: no --html
    check_file_target(args.json, "--json")
    check_file_target(html_target, "--html")
    if html_target == "-":
        raise UsageError("--html -: give a file name (standard output carries the text, or the JSON with --json -)")


def data(result: Any) -> Any:
    """The JSON shape of a result: dataclasses.asdict of a frozen dataclass, else as given."""
    return dataclasses.asdict(result) if dataclasses.is_dataclass(result) else result


def _fields(value: Any) -> Any:
    """json's hook: a dataclass as its fields, one level at a time while it is written. The same
    JSON as asdict, without asdict's deep copy (attribute's steps of a 300 MB trace, twice over)."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: getattr(value, f.name) for f in dataclasses.fields(value)}
    return str(value)


def write(args: argparse.Namespace, result: Any, title: str, stream: str | None = None) -> None:
    """The result to --json and --html, where given (checked before with check_targets);
    `stream` names a field whose items are written one at a time (see write_json)."""
    write_json(args.json, result, stream)
    write_html(args, result, title)


def write_json(target: str | None, result: Any, stream: str | None = None) -> None:
    """The result's JSON to `target`; with `stream`, that field's items are encoded and written one
    at a time (the same text): compare's 10^5 changes are never held as dicts or as one string."""
    if stream is None:
        files.write_json(target, result, default=_fields)
    else:
        files.write_json_list(target, _fields(result), stream, iter(getattr(result, stream)), default=_fields)


def write_html(args: argparse.Namespace, result: Any, title: str) -> None:
    """The result to --html, where given: a page holds every item, so only when asked."""
    if getattr(args, "html", None) is not None:
        try:
            Path(args.html).write_text(page(data(result), title), encoding="utf-8")
        except OSError as exc:
            raise UsageError(f"--html {args.html}: cannot write ({exc.strerror})") from None


def page(shape: Any, title: str) -> str:
    return (f"<!DOCTYPE html>\n<html><head><meta charset='utf-8'><title>{html.escape(title)}</title>"
            f"<style>{STYLE}</style></head>\n<body><h1>{html.escape(title)}</h1>\n{block(shape)}\n</body></html>\n")


def block(value: Any) -> str:
    """One value as HTML: a mapping as a two-column table, a list of mappings with the same keys
    as one table, any other list as a list, a scalar as escaped text."""
    if isinstance(value, dict):
        if not value:
            return "<span class='null'>none</span>"
        rows = "".join(f"<tr><th>{html.escape(str(k))}</th><td>{block(v)}</td></tr>" for k, v in value.items())
        return f"<table>{rows}</table>"
    if isinstance(value, (list, tuple)):
        if not value:
            return "<span class='null'>none</span>"
        keys = list(value[0]) if isinstance(value[0], dict) else None
        if keys and all(isinstance(v, dict) and list(v) == keys for v in value):
            head = "".join(f"<th>{html.escape(str(k))}</th>" for k in keys)
            body = "".join("<tr>" + "".join(f"<td>{block(v[k])}</td>" for k in keys) + "</tr>" for v in value)
            return f"<table><tr>{head}</tr>{body}</table>"
        return "<ul>" + "".join(f"<li>{block(v)}</li>" for v in value) + "</ul>"
    if value is None:
        return "<span class='null'>-</span>"
    return html.escape(str(value))
