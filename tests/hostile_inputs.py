"""The hostile cases of issue 43: traces, probe snapshots, imports and renderers, built fresh in a
tmp dir as tests/hostile.py builds its run dirs (nothing hostile is committed). Each case is a
hostile.Case of one class: traceback, silent, security or resource."""

from __future__ import annotations

import gzip
import json
import os
import sqlite3
from pathlib import Path
from typing import Any, Callable

from hostile import (NCCL_LOG, SPEC, TESTS, Case, Result, analysis, copy_run, no_traceback, one_line, rows_of,
                     with_info, write_rows)

TRACE = TESTS / "data" / "traces" / "constructed" / "vllm-rank0.trace.json"
BIG = "1e999"              # json reads it as infinity; int() of it overflowed
ESCAPE = "\x1b]0;pwned\x07\x1b[2J\u202e"


# ---------------------------------------------------------------- building blocks

def trace_with(root: Path, edit: Callable[[dict[str, Any]], None], name: str = "t.json") -> Path:
    """The constructed vLLM trace with `edit` applied; the string BIG becomes the number 1e999."""
    data = json.loads(TRACE.read_text())
    edit(data)
    path = root / name
    path.write_text(json.dumps(data).replace(f'"{BIG}"', BIG))
    return path


def first(data: dict[str, Any], cat: str) -> dict[str, Any]:
    return next(e for e in data["traceEvents"] if e.get("cat") == cat)


def attribute(path: Path, *flags: str) -> list[str]:
    return ["attribute", str(path), *flags]


def dropped(*named: str) -> Callable[[Result, Path], None]:
    """The command works on the other events and names the bad one's field; no nan, no
    negative share, no wall time of hundreds of digits."""
    def check(result: Result, root: Path) -> None:
        no_traceback(result)
        assert result.code == 0, (result.code, result.err[-1000:])
        assert "dropped 1 event(s)" in result.err or "dropped 1 row(s)" in result.err, result.err[-1000:]
        for text in named:
            assert text in result.err, result.err[-1000:]
        sane_numbers(result)
    return check


def sane_numbers(result: Result) -> None:
    out = result.out.lower()
    assert "nan" not in out.replace("nanos", ""), result.out[-1500:]
    assert "-" not in "".join(w for w in out.split() if w.endswith("%")), result.out[-1500:]
    assert not any(len(w) > 30 and w.replace(".", "").isdigit() for w in out.split()), result.out[-1500:]


def no_escape(result: Result, root: Path) -> None:
    no_traceback(result)
    for text in (result.out, result.err):
        assert "\x1b" not in text and "\x07" not in text and "\u202e" not in text, repr(text[-500:])


def quick(seconds: float, then: Callable[[Result, Path], None]) -> Callable[[Result, Path], None]:
    def check(result: Result, root: Path) -> None:
        then(result, root)
        assert result.seconds < seconds, f"took {result.seconds:.1f} s"
    return check


# ---------------------------------------------------------------- traces

def _trace_cases() -> list[Case]:
    out = []

    def set_in(cat: str, *keys: str, value: Any) -> Callable[[dict[str, Any]], None]:
        def edit(data: dict[str, Any]) -> None:
            target = first(data, cat)
            for key in keys[:-1]:
                target = target[key]
            target[keys[-1]] = value
        return edit

    numbers = [("correlation", "kernel", ("args", "correlation")), ("stream", "kernel", ("args", "stream")),
               ("pid", "kernel", ("pid",)), ("graph id", "kernel", ("args", "graph id")),
               ("In msg nelems", "cpu_op", ("args", "In msg nelems"))]
    for field, cat, keys in numbers:
        out.append(Case("traceback", f"attribute: {BIG} as an event's {field}",
                        lambda root, c=cat, k=keys: attribute(trace_with(root, set_in(c, *k, value=BIG))),
                        dropped(field)))
    for field, value in (("dur", float("nan")), ("dur", -5.0), ("dur", 1e308), ("ts", float("nan")),
                         ("ts", 1e308), ("ts", "soon")):
        out.append(Case("silent", f"attribute: a kernel's {field} of {value}",
                        lambda root, f=field, v=value: attribute(trace_with(root, set_in("kernel", f, value=v))),
                        dropped(field)))

    def deep_event(data: dict[str, Any]) -> None:
        data["traceEvents"].insert(0, {"ph": "X", "cat": "kernel", "name": "k", "ts": 1, "dur": 1,
                                       "args": {"a": "DEEP"}})

    def deep(root: Path) -> list[str]:
        path = trace_with(root, deep_event)
        path.write_text(path.read_text().replace('"DEEP"', "[" * 3000 + "]" * 3000))
        return attribute(path)

    out.append(Case("traceback", "attribute: an event nested 3000 deep", deep, one_line(2, "t.json", "nested")))

    def shallow_deep(root: Path) -> list[str]:
        path = trace_with(root, deep_event)
        path.write_text(path.read_text().replace('"DEEP"', "[" * 200 + "]" * 200))
        return attribute(path)

    out.append(Case("silent", "attribute: an event nested 200 deep", shallow_deep, dropped("event 0", "nested")))

    def world(value: Any) -> Callable[[dict[str, Any]], None]:
        return lambda data: data["distributedInfo"].update(world_size=value)
    out.append(Case("silent", "attribute: a world size of 10^12",
                    lambda root: attribute(trace_with(root, world(10 ** 12))), one_line(2, "world_size")))
    out.append(Case("traceback", f"attribute: a rank of {BIG}",
                    lambda root: attribute(trace_with(root, lambda d: d["distributedInfo"].update(rank=BIG))),
                    one_line(2, "rank")))
    for flag in ("--hidden", "--batch"):
        other = "--batch" if flag == "--hidden" else "--hidden"
        out.append(Case("silent", f"attribute: {flag} of 10^15",
                        lambda root, f=flag, o=other: attribute(trace_with(root, lambda d: None), f, str(10 ** 15),
                                                                o, "8"),
                        one_line(2, flag)))
    out.append(Case("silent", "attribute: --gap-us of inf",
                    lambda root: attribute(trace_with(root, lambda d: None), "--gap-us", "inf"),
                    one_line(2, "--gap-us")))

    def escapes(where: str) -> Callable[[dict[str, Any]], None]:
        def edit(data: dict[str, Any]) -> None:
            if where == "kernel name":
                for event in data["traceEvents"]:
                    if event.get("cat") == "kernel" and "cross_device" in event["name"]:
                        event["name"] += ESCAPE
            elif where == "device name":
                data["deviceProperties"][0]["name"] += ESCAPE
            else:
                data["commbench_provenance"] += ESCAPE
        return edit
    for where in ("kernel name", "device name", "provenance"):
        out.append(Case("security", f"attribute: terminal escapes in the trace's {where}",
                        lambda root, w=where: attribute(trace_with(root, escapes(w)), "--wide"), no_escape))
    out += _nsys_cases()
    return out


def _nsys(root: Path, kernel_rows: list[tuple[Any, ...]]) -> Path:
    path = root / "p.sqlite"
    db = sqlite3.connect(path)
    db.executescript("""
        CREATE TABLE StringIds (id INTEGER PRIMARY KEY, value);
        CREATE TABLE CUPTI_ACTIVITY_KIND_KERNEL (start, end, deviceId, streamId, correlationId, demangledName,
                                                 globalPid, graphId);
        INSERT INTO StringIds VALUES (1, 'ncclDevKernel_AllReduce_Sum_bf16_RING_LL(ncclDevKernelArgsStorage<4096ul>)'),
                                     (2, 'gemm_kernel'), (3, x'1b5b324a');
    """)
    rows = []
    for step in range(4):
        t = step * 1_000_000
        rows += [(t, t + 20_000, 0, 7, step, 2, 1 << 24, None), (t + 21_000, t + 61_000, 0, 7, step, 1, 1 << 24, None)]
    db.executemany("INSERT INTO CUPTI_ACTIVITY_KIND_KERNEL VALUES (?,?,?,?,?,?,?,?)", kernel_rows + rows)
    db.commit()
    db.close()
    return path


def _nsys_cases() -> list[Case]:
    bad_rows = [("a start that is text", ("soon", 5, 0, 7, 9, 2, 1 << 24, None), "start"),
                ("a NULL end", (5, None, 0, 7, 9, 2, 1 << 24, None), "end"),
                ("a BLOB name", (5, 6, 0, 7, 9, 3, 1 << 24, None), "demangledName"),
                ("an end before its start", (50, 6, 0, 7, 9, 2, 1 << 24, None), "before start"),
                ("a device that is text", (5, 6, "gpu", 7, 9, 2, 1 << 24, None), "deviceId")]
    return [Case("silent" if field in ("before start", "deviceId") else "traceback",
                 f"attribute: an nsys kernel row with {name}",
                 lambda root, r=row: attribute(_nsys(root, [r])), dropped(field)) for name, row, field in bad_rows]


# ---------------------------------------------------------------- resources

def _resource_cases() -> list[Case]:
    out = []

    def blank_bomb(root: Path) -> list[str]:
        """256 MB of white space in 250 KB of gzip (the issue's 2 GB is the same, 8 times over)."""
        path = root / "bomb.json.gz"
        with gzip.open(path, "wb", compresslevel=1) as handle:
            handle.write(b'{"traceEvents": [')
            block = b" " * (1 << 20)
            for _ in range(256):
                handle.write(block)
            handle.write(b"]}")
        return attribute(path)
    out.append(Case("resource", "attribute: gzip of 256 MB of white space", blank_bomb,
                    quick(10, one_line(2, "bomb.json.gz", "white space"))))

    def fifo(what: str) -> Callable[[Path], list[str]]:
        def build(root: Path) -> list[str]:
            os.mkfifo(root / "fifo")
            name = str(root / "fifo")
            if what == "trace":
                return attribute(root / "fifo")
            if what == "spec":
                return ["qualify", str(copy_run(root)), "--spec", name]
            if what == "snapshot":
                return ["qualify", str(copy_run(root)), "--spec", str(SPEC), "--snapshot", name]
            if what == "nccl log":
                return attribute(trace_with(root, lambda d: None), "--nccl-log", name)
            return ["import-nccl-tests", name, "--out", str(root / "imp")]
        return build
    for what in ("trace", "spec", "snapshot", "nccl log", "nccl-tests import"):
        out.append(Case("resource", f"a FIFO as a {what}", fifo(what), one_line(2, "fifo", "FIFO"), procs=True,
                        blocks=True))
    return out


def cases() -> list[Case]:
    return _trace_cases() + _resource_cases()
