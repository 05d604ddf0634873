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
# Shown as nothing, or reorder or split a line: bidi isolate and override, zero-width space and
# joiner, BOM, tag characters (hidden ASCII), line and paragraph separators.
HIDDEN = "\u2066\u202e\u200b\u200d\ufeff\U000e0072\U000e006d\u2028\u2029"


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


# ---------------------------------------------------------------- probe snapshots

def _snapshot(root: Path) -> dict[str, Any]:
    return json.loads((TESTS / "fixtures" / "snapshots" / "pcie-8x-dual-socket.json").read_text())


def _bad_snapshots() -> list[tuple[str, Callable[[dict[str, Any]], None], str]]:
    """(name, the edit, the field the refusal names)"""
    def gpus_numbers(s: dict[str, Any]) -> None:
        s["gpus"] = [0, 1]

    def p2p_numbers(s: dict[str, Any]) -> None:
        s["p2p"] = [1, 2, 3]

    def software_text(s: dict[str, Any]) -> None:
        s["software"] = "torch 2.13"

    def attributes_text(s: dict[str, Any]) -> None:
        s["gpus"][0]["attributes"] = "multicast"

    def ghost_gpu(s: dict[str, Any]) -> None:
        s["participants"][0]["gpu"] = 99

    return [("GPUs as numbers", gpus_numbers, "gpus[0]"), ("P2P entries as numbers", p2p_numbers, "p2p[0]"),
            ("software as text", software_text, "software"), ("an attribute table as text", attributes_text,
                                                            "gpus[0].attributes"),
            ("a participant on a GPU it does not list", ghost_gpu, "participants[0].gpu")]


def _snapshot_cases() -> list[Case]:
    out = []
    for name, edit, field in _bad_snapshots():
        def in_run(command: str, e: Callable[[dict[str, Any]], None] = edit) -> Callable[[Path], list[str]]:
            def build(root: Path) -> list[str]:
                snapshot = _snapshot(root)
                e(snapshot)
                return analysis(command, with_info(root, snapshot=snapshot), root)
            return build

        def as_file(command: str, e: Callable[[dict[str, Any]], None] = edit) -> Callable[[Path], list[str]]:
            def build(root: Path) -> list[str]:
                snapshot = _snapshot(root)
                e(snapshot)
                (root / "snap.json").write_text(json.dumps(snapshot))
                if command == "probe":
                    return ["probe", "--from", str(root / "snap.json")]
                return ["qualify", str(copy_run(root)), "--spec", str(SPEC), "--snapshot", str(root / "snap.json")]
            return build
        klass = "silent" if "participant" in name else "traceback"   # taken as given, or a traceback
        for command in ("recommend", "floor"):
            out.append(Case(klass, f"{command}: run.json's snapshot with {name}", in_run(command),
                            one_line(2, "run.json", "snapshot", field)))
        for command in ("probe", "qualify"):
            out.append(Case(klass, f"{command}: a snapshot file with {name}", as_file(command),
                            one_line(2, "snap.json", field)))

    def settings_text(root: Path) -> list[str]:
        run = copy_run(root)
        info = json.loads((run / "run.json").read_text())
        facts = info.setdefault("backend_facts", {"nccl": {"family": "nccl"}})
        for entry in facts.values():
            entry["engine_settings"] = {"variant": "nccl", "vllm_env": ["VLLM_X=1"]}
        (run / "run.json").write_text(json.dumps(info))
        return ["recommend", str(run), "--model", "glm-5"]
    out.append(Case("traceback", "recommend: a backend's engine settings of the wrong type", settings_text,
                    one_line(2, "run.json", "backend_facts")))
    return out


# ---------------------------------------------------------------- imports and renderers

def _log_with(root: Path, change: Callable[[list[str]], list[str]]) -> list[str]:
    """import-nccl-tests of the committed 8-GPU log with its first result row's fields changed."""
    lines = NCCL_LOG.read_text().splitlines(keepends=True)
    for i, line in enumerate(lines):
        fields = line.split()
        if fields and fields[0].isdigit() and len(fields) > 8:
            lines[i] = "  ".join(change(fields)) + "\n"
            break
    (root / "log.txt").write_text("".join(lines))
    return ["import-nccl-tests", str(root / "log.txt"), "--average", "3", "--out", str(root / "imp")]


def _import_cases() -> list[Case]:
    refused = [("a size of 10^30 bytes", lambda f: [str(10 ** 30), *f[1:]], "size"),
               ("a type that is no plain name", lambda f: [*f[:2], "flo/at", *f[3:]], "type"),
               ("a count that does not fit its size", lambda f: [f[0], str(int(f[1]) + 1), *f[2:]], "count")]
    out = [Case("silent", f"import-nccl-tests: {name}", lambda root, c=change: _log_with(root, c),
                one_line(2, "log.txt", field)) for name, change, field in refused]

    def dropped_line(result: Result, root: Path) -> None:
        no_traceback(result)
        assert result.code == 0, (result.code, result.err[-1000:])
        said = " ".join(result.err.split())   # the warning folds to the terminal
        assert "dropped 1 line(s)" in said and "line " in said, result.err[-1000:]
    out.append(Case("silent", "import-nccl-tests: a negative size",
                    lambda root: _log_with(root, lambda f: ["-" + f[0], *f[1:]]), dropped_line))

    out.append(Case("traceback", "report: run.json started in the year 3e12",
                    lambda root: analysis("report", with_info(root, started=1e20), root),
                    one_line(2, "run.json", "started")))

    def host_markup(result: Result, root: Path) -> None:
        no_traceback(result)
        quote = result.out.split("\n\n")[0].splitlines()     # the provenance, wrapped to the terminal
        assert all(line.startswith("> ") for line in quote), quote   # the host's newline opened no new block
        text = " ".join(line[2:].strip() for line in quote)
        assert "<b>" not in text and "|x" not in text.replace("\\|", ""), text
        assert "&lt;/b&gt; rm -rf ~" in text, text                   # the newline became a space
    out.append(Case("security", "table: markdown, a pipe and a newline in the run's host",
                    lambda root: ["table", str(with_info(root, host="evil|x <b>bold</b>\nrm -rf ~")), "--markdown"],
                    host_markup))

    def env_newline(root: Path) -> list[str]:
        run = copy_run(root)
        rows = rows_of(run)
        for row in rows:
            row["env_setting"] = {"NCCL_MAX_CTAS": "8\nrm -rf ~"}
        write_rows(run, rows)
        return ["recommend", str(run), "--model", "glm-5"]

    def no_shell_line(result: Result, root: Path) -> None:
        no_traceback(result)
        assert not any(line.lstrip().startswith("rm -rf") for line in result.out.splitlines()), result.out[-1500:]
    out.append(Case("security", "recommend: a newline in a row's env setting", env_newline, no_shell_line))

    def hidden_in_notes(root: Path) -> list[str]:
        run = copy_run(root)
        info = json.loads((run / "run.json").read_text())
        for entry in info["backend_facts"].values():
            if isinstance(entry.get("engine_settings"), dict):
                entry["engine_settings"].setdefault("notes", []).append("marked" + HIDDEN + "note")
        (run / "run.json").write_text(json.dumps(info))
        return ["recommend", str(run), "--model", "glm-5"]

    def notes_shown_clean(result: Result, root: Path) -> None:
        no_traceback(result)
        assert result.code == 0, result.err[-1000:]
        notes = [line for line in result.out.splitlines() if "marked" in line]
        assert notes and all("markednote" in line for line in notes), [ascii(n) for n in notes]
    def version_newline(command: str) -> Callable[[Path], list[str]]:
        def build(root: Path) -> list[str]:
            run = copy_run(root)
            rows = rows_of(run)
            for row in rows:
                row["extra"] = {"nccl_version_loaded": "2.29.7\nPASS: forged", "nccl_lib_loaded": "/lib\r\nok"}
            write_rows(run, rows)
            return analysis(command, run, root)
        return build

    def no_forged_line(result: Result, root: Path) -> None:
        no_traceback(result)
        assert result.code == 0, result.err[-1000:]
        assert "NCCL 2.29.7 PASS: forged" in result.out, result.out[-1500:]       # said, on its own line
        assert not any(line.startswith(("PASS", "ok")) for line in result.out.splitlines()), result.out[-1500:]
    for command in ("compare", "report"):
        out.append(Case("security", f"{command}: a newline in a row's recorded NCCL version", version_newline(command),
                        no_forged_line))

    markup = "[docs](javascript:alert(1)) ![x](http://evil/t.png) `code`\n# Heading"

    def markdown_markup(root: Path) -> list[str]:
        run = with_info(root, host="h " + markup)
        rows = rows_of(run)
        for row in rows:
            if row["status"] != "ok":
                row["reason"] = "why " + markup
        write_rows(run, rows)
        return ["table", str(run), "--markdown"]   # the markdown (a terminal's text shows it as text)

    def literal_markdown(result: Result, root: Path) -> None:
        no_traceback(result)
        assert result.code == 0, result.err[-1000:]
        assert "](" not in result.out.replace("\\](", ""), result.out[-1500:]   # no link or image
        assert "\\`code\\`" in result.out and "`code`" not in result.out.replace("\\`", "")
        assert not any(line.lstrip("> -").startswith("# Heading") for line in result.out.splitlines())
    out.append(Case("security", "table: a markdown link, image, code span and heading in the run's host and a "
                                "row's reason", markdown_markup, literal_markdown))

    out.append(Case("security", "recommend: bidi, zero-width, tag and line-separator characters in a backend's "
                                "engine notes (its paste block's notes)", hidden_in_notes, notes_shown_clean))
    return out


def cases() -> list[Case]:
    return _trace_cases() + _resource_cases() + _snapshot_cases() + _import_cases()
