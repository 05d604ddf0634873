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

LOG = Path(__file__).parent / "data" / "nccl-tests" / "h200-8gpu-mpi-graph.txt"


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
    from commbench.results import Measurement, csv_line, json_line
    from commbench.results.templates import Templates

    def build(values):
        size, latency = values
        return Measurement("nccl", "graph", "bf16", size, 8, "ok", latency_us=latency, reason=f"took {latency:.1f}")

    templates = Templates()
    for size, latency in [(4096, 9.11), (8192, 9.25), (16384, 9.3)]:
        row = build((size, latency))
        assert templates.lines("shape", (size, latency), build) == (json_line(row), csv_line(row))
    assert list(templates._made.values()) == [None]


def test_a_template_fills_numbers_and_text_where_the_row_has_them() -> None:
    from commbench.results import Measurement, csv_line, json_line
    from commbench.results.templates import Templates

    def build(values):
        size, latency, where, cycle = values
        return Measurement("nccl", "graph", "bf16", size, 8, "ok", latency_us=latency, algbw_gbps=latency,
                           extra={"row": where, "cycle": cycle, "note": 'a "quoted", text'})

    templates = Templates()
    cases = [(4096, 9.11, "line 1", 0), (8192, 1e-05, 'line "2", \\ \u00e9', 3), (1 << 40, 123456.5, "", 0)]
    for values in cases * 2:
        row = build(values)
        assert templates.lines("s", values, build) == (json_line(row), csv_line(row))
    assert sum(made is not None for made in templates._made.values()) == 3   # cycle 0 and "" are shapes
