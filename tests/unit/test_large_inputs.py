"""Large inputs (issue 31, item 6): a long nccl-tests log is read as a stream, never held as
rows; the lines are those str.splitlines() gives; analysis rows are compact."""

from __future__ import annotations

import json
import os
import tracemalloc
from pathlib import Path

import pytest

from commbench.analysis.nccl_tests_format import read_output
from commbench.cli import main as cli
from commbench.errors import UsageError
from commbench.files import read_lines
from commbench.results import CSV_FILE, ROWS_FILE, RunDir
import factories

LOG = Path(__file__).parents[1] / "data" / "nccl-tests" / "h200-8gpu-mpi-graph.txt"


def _long_log(target: Path, repeats: int) -> int:
    """The 8-GPU log with its table repeated, as a long -N run prints it; its result lines."""
    lines = LOG.read_text().splitlines(keepends=True)
    table = [i for i, line in enumerate(lines) if line.split() and line.split()[0].isdigit()]
    body = lines[table[0]:table[-1] + 1]
    target.write_text("".join(lines[:table[0]] + body * repeats + lines[table[-1] + 1:]))
    return len(body) * repeats


def test_a_long_log_is_read_without_holding_its_rows(tmp_path: Path) -> None:
    log = tmp_path / "long.txt"
    results = _long_log(log, 400)   # 9,200 result lines, 1 MB
    tracemalloc.start()
    try:
        out = read_output(log)
        sizes = [row.size_bytes for row in out.results][:3]
        cycles = max(row.cycle for row in out.results)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert len(out.results) == results and cycles == 399 and sizes == [4096, 8192, 16384]
    # Held whole, the rows took ~10 MB (about 1 KB a result line); streamed, a few lines' worth.
    assert peak < 2_000_000, peak


def test_a_log_that_changes_between_passes_is_refused(tmp_path: Path) -> None:
    log = tmp_path / "live.txt"
    _long_log(log, 2)
    out = read_output(log)
    assert [r.size_bytes for r in out.results] == [r.size_bytes for r in out.results]   # passes agree
    with open(log, "a") as handle:
        handle.write("# NCCL WARN a later line\n")
    with pytest.raises(UsageError, match="changed while it was being read"):
        list(out.results)


def test_indexing_the_streamed_results_is_as_a_list(tmp_path: Path) -> None:
    log = tmp_path / "two.txt"
    _long_log(log, 2)
    out = read_output(log)
    whole = list(out.results)
    assert [r.where for r in out.results[-3:]] == [r.where for r in whole[-3:]]
    assert out.results[0].where == whole[0].where and out.results[-1].cycle == 1
    with pytest.raises(IndexError):
        out.results[len(whole)]


@pytest.mark.parametrize("data", [b"a\r\nb\n\nc", b"x\ry\n", b"", b"\n\n", "\u00e9\u2028z\n".encode(),
                                  b"k" * (3 << 20) + b"\nend\n"])
def test_lines_are_those_of_splitlines(tmp_path: Path, data: bytes) -> None:
    path = tmp_path / "f.txt"
    path.write_bytes(data)
    assert list(read_lines(path, "text")) == data.decode().splitlines()


def test_a_bad_byte_is_named_by_its_offset_in_the_file(tmp_path: Path) -> None:
    path = tmp_path / "f.txt"
    path.write_bytes(b"first line\nsecond \xff\n")
    with pytest.raises(UsageError, match=r"not UTF-8 text \(byte 18\)"):
        list(read_lines(path, "text"))
    path.write_bytes(b"x" * 100 + b"\n")
    with pytest.raises(UsageError, match="larger than 0 MiB"):
        list(read_lines(path, "text", max_bytes=50))


def test_an_import_writes_its_csv_in_the_same_pass(tmp_path: Path) -> None:
    """The CSV holds the rows already there and the new ones, in the order of measurements.jsonl."""
    log = tmp_path / "long.txt"
    results = _long_log(log, 3)
    out = tmp_path / "run"
    assert cli(["import-nccl-tests", str(LOG), "--average", "3", "--out", str(out)]) == 0
    assert cli(["import-nccl-tests", str(log), "--average", "3", "--out", str(out)]) == 0
    rows = [json.loads(line) for line in (out / ROWS_FILE).read_text().splitlines()]
    csv_lines = (out / CSV_FILE).read_text().splitlines()
    assert len(rows) == len(csv_lines) - 1 == 2 * (results // 3 + results)
    assert [line.split(",")[3] for line in csv_lines[1:]] == [str(r["message_bytes"]) for r in rows]
    fresh = tmp_path / "again"
    RunDir(out).write_csv()   # the CSV written whole from measurements.jsonl is the same file
    os.replace(out / CSV_FILE, fresh)
    assert fresh.read_text().splitlines() == csv_lines


# ---------------------------------------------------------------- rows encoded from templates

def _variants(tmp_path: Path) -> list[Path]:
    """The 8-GPU log with rows a template must not get wrong: #wrong > 0, a nan bandwidth; and
    the log repeated as -N cycles."""
    lines = LOG.read_text().splitlines()
    rows = [i for i, line in enumerate(lines) if line.startswith("       65536") or line.startswith("      131072")]
    lines[rows[0]] = lines[rows[0]][:-6] + "%6g" % 12            # in-place #wrong 12
    tokens = lines[rows[1]].split()
    lines[rows[1]] = lines[rows[1]].replace(f" {tokens[7]} ", "   nan ", 1)   # out-of-place busbw nan
    path = tmp_path / "variants.txt"
    path.write_text("\n".join(lines) + "\n")
    long = tmp_path / "cycles.txt"
    _long_log(long, 3)
    return [path, long]


@pytest.mark.parametrize("average", [3, 1])
def test_rows_from_templates_are_those_the_full_encoder_writes(tmp_path: Path, monkeypatch, average: int) -> None:
    """Every committed log (text and -J JSON, every -a meaning) and hand-made variants: the lines
    written from templates equal, byte for byte, json_line and csv_line of the rows built in full."""
    from commbench.analysis import nccl_tests_import as imp
    from commbench.results import csv_line, json_line

    monkeypatch.setattr(imp.time, "time", lambda: 1796199982.1328485)   # the one field made at write time
    data = LOG.parent
    logs = sorted(p for p in data.iterdir() if p.suffix in (".txt", ".json")) + _variants(tmp_path)
    checked: list[str] = []
    for path in logs:
        for source in imp.read_sources([path], None if path.suffix == ".json" else average, False):
            full = [(json_line(row), csv_line(row)) for row in imp.iter_rows(source, {"NCCL_PROTO": "LL"})]
            encoded = [tuple(row.lines) for row in imp.iter_encoded(source, {"NCCL_PROTO": "LL"})]
            assert encoded == full, path.name
            checked += [json_line for json_line, _ in full]
    assert len(checked) > 400
    assert any('"status": "wrong"' in line for line in checked) and any('"busbw_gbps": null' in line for line in checked)
    assert any('"nccl_tests_cycle": 2' in line for line in checked)


def test_a_template_that_would_not_reproduce_its_row_is_not_used() -> None:
    """A slot whose value the row spells in text of its own (here: formatted into the reason)
    cannot be filled in from a template: every such row is encoded in full, and is right."""
    from commbench.results import csv_line, json_line
    from commbench.results.templates import Templates

    def build(values):
        size, latency = values
        return factories.row(message_bytes=size, world_size=8, latency_us=latency, reason=f"took {latency:.1f}")

    templates = Templates()
    for size, latency in [(4096, 9.11), (8192, 9.25), (16384, 9.3)]:
        row = build((size, latency))
        assert templates.lines("shape", (size, latency), build) == (json_line(row), csv_line(row))
    assert list(templates._made.values()) == [None]


def test_a_template_fills_numbers_and_text_where_the_row_has_them() -> None:
    from commbench.results import csv_line, json_line
    from commbench.results.templates import Templates

    def build(values):
        size, latency, where, cycle = values
        return factories.row(message_bytes=size, world_size=8, latency_us=latency, algbw_gbps=latency,
                             extra={"row": where, "cycle": cycle, "note": 'a "quoted", text'})

    templates = Templates()
    cases = [(4096, 9.11, "line 1", 0), (8192, 1e-05, 'line "2", \\ \u00e9', 3), (1 << 40, 123456.5, "", 0)]
    for values in cases * 2:
        row = build(values)
        assert templates.lines("s", values, build) == (json_line(row), csv_line(row))
    assert sum(made is not None for made in templates._made.values()) == 3   # cycle 0 and "" are shapes


# ---------------------------------------------------------------- analysis: rows and points held compactly

RUNS = Path(__file__).parents[1] / "data" / "runs"


def _parsed(path: Path) -> list:
    from commbench.results.validate import parse_row
    return [row for line in path.read_bytes().splitlines(keepends=True) if (row := parse_row(line)[0]) is not None]


def test_compact_rows_give_back_every_row_as_it_was_read(tmp_path: Path) -> None:
    """Every committed run's rows and an import's (dicts in every field, an int latency that must
    stay an int, None wherever a number may be one) come back equal, field for field and type
    for type; a row changed after it came back changes no other."""
    from commbench.results.compact import CompactRows

    out = tmp_path / "imp"
    assert cli(["import-nccl-tests", str(LOG), "--average", "3", "--out", str(out)]) == 0
    periter = tmp_path / "periter"   # -I 1: every jitter field set
    assert cli(["import-nccl-tests", str(LOG.parent / "h200-8gpu-mpi-eager-periter.json"), "--out", str(periter)]) == 0
    files = [p / ROWS_FILE for p in sorted(RUNS.iterdir())] + [out / ROWS_FILE, periter / ROWS_FILE]
    rows = [row for path in files for row in _parsed(path)]
    held = CompactRows()
    for row in rows:
        held.add(row)
    back = list(held.finish())
    assert len(held) == len(rows) > 150 and back == rows
    assert [[type(v) for v in _values(r)] for r in back] == [[type(v) for v in _values(r)] for r in rows]
    assert any(type(r.jitter_p50_us) is int for r in back)   # the synthetic run's version-1 "latency_p50_us": 42
    assert held[3] == rows[3] and held[-1] == rows[-1] and held[2:4] == rows[2:4]
    first, second = held[0], held[0]
    first.extra["changed"] = 1
    first.env_setting["X"] = "1"
    assert "changed" not in second.extra and held[0] == rows[0]


def _values(row) -> list:
    import dataclasses
    return [getattr(row, f.name) for f in dataclasses.fields(row)]


def test_a_key_as_one_int_tells_rows_apart_as_the_key_does(tmp_path: Path) -> None:
    """Two rows get one int exactly when their key (the cell), world size and identifying extras
    are the same: on every committed run, two imports, and rows that differ in one field each."""
    import dataclasses
    from commbench.results.rundir import IDENTITY_EXTRA, _Identities

    out, log = tmp_path / "imp", tmp_path / "cycles.txt"
    _long_log(log, 3)   # -N cycles: rows of one cell told apart by their cycle
    assert cli(["import-nccl-tests", str(log), "--average", "3", "--out", str(out)]) == 0
    rows = [row for path in [p / ROWS_FILE for p in sorted(RUNS.iterdir())] + [out / ROWS_FILE]
            for row in _parsed(path)]
    base = rows[0]
    rows += [dataclasses.replace(base, **change) for change in (
        {"tokens": 7}, {"hidden": 7}, {"message_bytes": base.message_bytes + 1}, {"world_size": 3},
        {"env_setting": {"NCCL_PROTO": "LL"}}, {"extra": {"nccl_tests_cycle": 1}}, {"op": "x"}, {"mode": "eager"},
        {"status": "hang"}, {"latency_us": 1.0})]   # the last two: the same key

    def full(row) -> tuple:
        return row.key(), row.world_size, *(repr(row.extra.get(name)) for name in IDENTITY_EXTRA)

    identities = _Identities()
    ints = [identities.of(row) for row in rows]
    keys = [full(row) for row in rows]
    assert len(set(keys)) > 100
    assert all((ints[i] == ints[j]) == (keys[i] == keys[j]) for i in range(len(rows)) for j in range(i))


def test_dropped_rows_leave_no_gap_and_profiles_past_the_limit_are_kept_whole(monkeypatch) -> None:
    from commbench.results import compact
    from commbench.results.compact import CompactRows

    rows = _parsed(RUNS / "synthetic-pcie-8gpu" / ROWS_FILE)
    monkeypatch.setattr(compact, "MAX_PROFILES", 2)
    held = CompactRows()
    positions = [held.add(row) for row in rows]
    held.drop(positions[0])
    held.drop(positions[5])
    held.drop(positions[5])   # twice is once
    assert len(held) == len(rows) - 2
    assert list(held) == [r for i, r in enumerate(rows) if i not in (0, 5)]
    held.finish()
    assert held[0] == rows[1] and held[4] == rows[6] and len(list(held)) == len(rows) - 2


def test_read_rows_holds_a_few_hundred_bytes_a_key(tmp_path: Path) -> None:
    """15,000 rows, each its own key, as a long sweep writes them: read, deduplicated and held at
    well under 0.5 KB a row (Measurements held ~1.5 KB a row at peak, 0.9 KB after)."""
    template = next(json.loads(line) for line in (RUNS / "synthetic-pcie-8gpu" / ROWS_FILE).read_text().splitlines()
                    if '"status": "ok"' in line)
    run = tmp_path / "run"
    run.mkdir()
    count = 15_000
    with open(run / ROWS_FILE, "w") as handle:
        for i in range(count + 100):
            j = i % count   # the last 100 lines repeat the first 100 keys
            row = dict(template, backend=f"nccl:variant{j // 2000}", message_bytes=4096 + 1024 * (j % 2000),
                       latency_p50_us=20.0 + j / 7 + i / 1e6)
            handle.write(json.dumps(row) + "\n")
    tracemalloc.start()
    try:
        read = RunDir(run).read_rows()
        held, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert len(read.rows) == count and len(read.duplicates) == 100
    assert read.duplicates[0] == (1, count + 1)
    rows = list(read.rows)
    # the later row of a repeated key is kept, in its own line's place (the last)
    assert rows[-1].jitter_p50_us == 20.0 + 99 / 7 + (count + 99) / 1e6 and rows[0].message_bytes == 4096 + 1024 * 100
    assert held / count < 250 and peak / count < 500, (held / count, peak / count)   # 1,490 at peak before


def test_curve_points_as_columns_answer_as_the_points_did() -> None:
    from commbench.analysis.curves import Curve, CurveKey, Point, Points

    points = [Point(4096 * 2 ** i, 10.0 + i, 9.0 + i, None, 12.5 + i, 0.1 * (i + 1)) for i in range(8)]
    curve = Curve(CurveKey("nccl", "graph", "bf16", "allreduce"), "nccl", {}, points, frozenset({4096 * 2 ** 5 + 1}))
    assert list(curve.points) == points and curve.points == points and curve.sizes() == [p.message_bytes for p in points]
    assert curve.point(4096 * 4) == points[2] and curve.point(4097) is None and curve.point(1) is None
    middle = curve.at(6144)   # between the first two sizes, log-log
    assert middle is not None and 10.0 < middle.latency_us < 11.0 and middle.p90_us is None
    assert curve.at(4096 * 2 ** 5 + 1000) is None   # a failed size lies between: never interpolated across
    assert curve.at(1 << 40) is None and curve.at(4096 * 2 ** 7) == points[7]
    exact = Points([Point(4096, 42, None, None, None, None), Point(8192, 43.5)])   # an int latency is kept as it is
    assert type(exact[0].latency_us) is int and exact.sizes() == [4096, 8192]
    later = Point(points[3].message_bytes, 99.0)
    several = Points([points[3], points[1], later, points[2]])
    assert list(several.settled(frozenset())) == [points[1], points[2], later]   # sorted, the last of a size
    assert list(several.settled(frozenset({points[2].message_bytes}))) == [points[1], later]


# ---------------------------------------------------------------- a -J file read a piece at a time

def _events(path: Path) -> tuple[list, Exception | None]:
    from commbench.json_stream import JsonError, object_events
    events: list = []
    try:
        for event in object_events(path, "results", "a test file"):
            events.append(event)
    except JsonError as exc:
        return events, exc
    return events, None


def _whole_results(text: str) -> int:
    """How many whole objects the results array of a cut -J text holds (as --partial counted them)."""
    at = text.find('"results": [')
    if at < 0:
        return 0
    at, count, decoder = at + len('"results": ['), 0, json.JSONDecoder()
    while True:
        while at < len(text) and text[at] in " \t\r\n,":
            at += 1
        try:
            _, at = decoder.raw_decode(text, at)
        except json.JSONDecodeError:
            return count
        count += 1


@pytest.mark.parametrize("indent", [None, 1])
def test_a_json_file_streamed_in_small_blocks_gives_what_json_loads_does(tmp_path: Path, monkeypatch,
                                                                         indent: int | None) -> None:
    """Cut anywhere (a block of 61 bytes: values cut by every block end), a -J file gives the
    fields and whole results json.loads finds, and json.loads's message, line and column."""
    from commbench import json_stream

    monkeypatch.setattr(json_stream, "_BLOCK_BYTES", 61)
    data = json.loads(LOG.with_suffix(".json").read_text())
    text = json.dumps(data, indent=indent)
    path = tmp_path / "cut.json"
    for cut in [*range(0, len(text), 37), len(text) - 1, len(text)]:
        path.write_text(text[:cut] + ("" if cut < len(text) else "  \n"))
        events, error = _events(path)
        items = [value for kind, _, value in events if kind == "item"]
        fields = {name: value for kind, name, value in events if kind == "field"}
        assert items == data["results"][:len(items)]
        assert all(data[name] == value for name, value in fields.items())
        try:
            json.loads(path.read_text())
        except json.JSONDecodeError as expected:
            assert error is not None and (error.msg, error.lineno, error.colno) == (
                expected.msg, expected.lineno, expected.colno), cut
            assert len(items) == _whole_results(text[:cut]), cut
        else:
            assert error is None and len(items) == len(data["results"]) and len(fields) == len(data) - 1
    path.write_text(text + " x")
    assert _events(path)[1].msg == "Extra data"


def test_a_large_json_file_is_imported_without_holding_it(tmp_path: Path) -> None:
    """A -J file of 2,000 results (1 MB) is read with a buffer of a block or two: its results are
    parsed again on each pass, as a text log's are."""
    from commbench.analysis.nccl_tests_format import StreamedResults

    data = json.loads(LOG.with_suffix(".json").read_text())
    data["results"] = data["results"] * 120
    path = tmp_path / "big.json"
    path.write_text(json.dumps(data))
    tracemalloc.start()
    try:
        out = read_output(path)
        cycles = max(row.cycle for row in out.results)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert isinstance(out.results, StreamedResults) and len(out.results) == 17 * 120 and cycles == 119
    assert out.complete and peak < 4_000_000, peak   # parsed whole: ~10 MB


# ---------------------------------------------------------------- traces (issue 43)

class _CountedList(list):
    """A list that counts the passes over it."""

    passes = 0

    def __iter__(self):
        _CountedList.passes += 1
        return super().__iter__()


def test_a_merged_trace_is_split_by_device_in_one_pass(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A merged trace without rank info: one rank per device, found in one pass over the kernels
    (a pass per device took 146 s at 6,000 devices)."""
    from commbench.analysis import trace_read

    events = [{"ph": "X", "cat": "kernel", "name": "k", "pid": device, "tid": 7, "ts": 10.0 * device, "dur": 1.0,
               "args": {"stream": 7, "correlation": device}} for device in range(300)]
    path = tmp_path / "merged.json"
    path.write_text(json.dumps({"traceEvents": events}))
    real = trace_read._split_by_device

    def counted(trace, devices):
        trace.kernels = _CountedList(trace.kernels)
        _CountedList.passes = 0
        return real(trace, devices)

    monkeypatch.setattr(trace_read, "_split_by_device", counted)
    ranks = trace_read.read_trace(path)
    assert [(t.rank, len(t.kernels), t.kernels[0].device) for t in ranks] == [(d, 1, d) for d in range(300)]
    assert _CountedList.passes == 1


def test_white_space_is_skipped_in_bulk_and_a_long_run_refused(tmp_path: Path) -> None:
    """The scanner skips blanks a buffer at a time (2 GB of them took 135 s one character at a
    time) and refuses a run longer than any trace holds; blanks between events are read."""
    from commbench.analysis import trace_read

    path = tmp_path / "blanks.json"
    event = json.dumps({"ph": "X", "cat": "kernel", "name": "k", "pid": 0, "tid": 7, "ts": 1.0, "dur": 1.0})
    path.write_text('{"traceEvents": [' + " " * 3_000_000 + event + "\n" * 100 + "]}")
    (trace,) = trace_read.read_trace(path)
    assert len(trace.kernels) == 1
    path.write_text('{"traceEvents": [' + " " * (trace_read.MAX_BLANK_CHARS + 2) + "]}")
    with pytest.raises(UsageError, match="white space in a row"):
        trace_read.read_trace(path)
