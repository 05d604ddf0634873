"""What a run is (provenance) and the one table renderer: in-process, on committed runs."""

from __future__ import annotations

import re

import pytest
from pathlib import Path

from commbench.analysis import provenance, render
from commbench.errors import UsageError
from commbench.results import Run, RunInfo
from commbench.runs import load_run
from factories import write_run

DATA = Path(__file__).parents[1] / "data"
SYNTHETIC = DATA / "runs" / "synthetic-pcie-8gpu"
CPU_RUN = DATA / "runs" / "cpu-gloo-4rank-a"
EMULATED = next((Path(__file__).parents[2] / "results" / "reference" / "h200-mps-emulated" / "world8"
                 / "allreduce").glob("*/run.json")).parent


def test_fixture_emulated_cpu_and_measured_say_so():
    fixture = provenance.of(load_run(SYNTHETIC))
    assert fixture.kind == provenance.FIXTURE
    assert fixture.line().startswith("data: fixture: hand-made test data, not a measurement")
    assert "run synthetic-pcie-8gpu" in fixture.line()

    emulated = provenance.of(load_run(EMULATED))
    assert emulated.kind == provenance.EMULATED
    assert emulated.gpu_count == 1 and emulated.world_size == 8     # 8 ranks share one H200
    assert "8 ranks on 1x NVIDIA H200 under MPS" in emulated.line()
    assert emulated.fabric is None

    cpu = provenance.of(load_run(CPU_RUN))
    assert cpu.kind == provenance.CPU and cpu.gpu_names == ()
    assert cpu.line().startswith("data: cpu: 4 ranks of gloo on the CPU")


def test_measured_run_names_gpus_and_fabric_from_the_snapshot(tmp_path):
    run = load_run(write_run(tmp_path / "real", like=SYNTHETIC, provenance=None))
    measured = provenance.of(run)
    assert measured.kind == provenance.MEASURED
    assert measured.fabric == provenance.PCIE          # no link matrix: its PCIe paths
    assert measured.line().startswith(
        "data: measured: 8 ranks on 8x NVIDIA RTX PRO 6000 Blackwell Server Edition over PCIe")
    nvlink = [["X" if a == b else "NV18" for b in range(8)] for a in range(8)]
    run.info.snapshot = dict(run.info.snapshot or {}, links={"matrix": nvlink})
    assert provenance.of(run).fabric == provenance.NVLINK
    nvlink[0][1] = "SYS"
    assert provenance.of(run).fabric == provenance.MIXED
    as_dict = provenance.of(run).to_dict()
    assert as_dict["kind"] == "measured" and as_dict["gpu_count"] == 8 and as_dict["line"].startswith("data: ")


def test_imported_and_broken_run_json(tmp_path):
    run = load_run(write_run(tmp_path / "imp", like=SYNTHETIC, provenance=None, source="nccl-tests"))
    assert provenance.of(run).kind == provenance.IMPORTED
    assert "imported from nccl-tests" in provenance.describe(run)
    # Wrong types in an untrusted run.json: the reader refuses the file, naming the field ...
    for field, value, said in (("gpus", "x", "gpus is 'x', not a list"), ("world_size", "8", "world_size is '8'"),
                               ("snapshot", [1], "snapshot is [1], not a table"), ("host", 3, "host is 3, not text")):
        with pytest.raises(UsageError, match=re.escape(said)):
            load_run(write_run(tmp_path / field, like=SYNTHETIC, **{field: value}))
    # ... and a run.json that records none of them leaves provenance with "unknown" words.
    rows = load_run(SYNTHETIC).rows
    line = provenance.describe(Run(tmp_path / "broken", RunInfo(), rows))
    assert "no GPU recorded" in line and "run broken" in line and "8 ranks" in line   # world size from the rows


def test_differences_name_what_differs():
    a = provenance.of(load_run(SYNTHETIC))
    b = provenance.of(load_run(EMULATED))
    words = " | ".join(provenance.differences(a, b))
    assert "data: fixture vs emulated" in words and "host: synthetic-host vs vm" in words
    assert provenance.differences(a, a) == []
    time_sliced = provenance.Provenance(**{**b.__dict__, "emulation": {**b.emulation, "mps": False}})
    assert provenance.differences(b, time_sliced) == ["emulation: MPS 12% of the SMs vs time-sliced"]


def test_table_folds_to_the_width_and_wide_keeps_one_line_per_row():
    headers = ["backend", "latency us", "reason"]
    rows = [["nccl[NCCL_MIN_NCHANNELS=8]", "1,234", "word " * 30], ["gloo", "7.50", "short"]]
    between_words = render.table(headers, rows, right=(1,), width=60)
    assert max(len(line) for line in between_words.splitlines()) == 60
    assert "nccl[NCCL_MIN_NCHANNELS=8]       1,234  word word" in between_words   # whole words, number whole
    assert len(between_words.splitlines()) > 4                                      # the reason folded
    # Too narrow to fold between words: one record per row, no identifier split, nothing cut.
    as_records = render.table(headers, rows, right=(1,), width=30)
    assert max(len(line) for line in as_records.splitlines()) <= 30
    assert as_records.splitlines()[:2] == ["nccl[NCCL_MIN_NCHANNELS=8]", "  latency us: 1,234; reason:"]
    assert as_records.splitlines()[-3:] == ["gloo", "  latency us: 7.50; reason:", "    short"]
    wide = render.table(headers, rows, right=(1,), wide=True)
    assert len(wide.splitlines()) == 4                         # header, rule, two rows
    assert "nccl[NCCL_MIN_NCHANNELS=8]" in wide               # a '[' is text, not markup
    assert all(line == line.rstrip() for line in wide.splitlines())
    assert wide.splitlines()[2].endswith(" 1,234  " + ("word " * 30).strip())   # numbers right-aligned
    title = "latency per backend: " + " ".join(["long words"] * 8)
    titled = render.table(headers, rows, right=(1,), title=title, width=30)
    assert titled.splitlines()[0] == "latency per backend: long"   # prose: wrapped between words
    assert titled.splitlines()[-len(as_records.splitlines()):] == as_records.splitlines()


def test_number_formats():
    assert render.fmt_us(None) == "-" and render.fmt_us(1234.4) == "1,234" and render.fmt_us(7.5) == "7.50"
    assert render.fmt_pct(12.34) == "+12.3%" and render.fmt_pct(5, signed=False) == "5.0%"
    assert render.fmt_num(1.234, 1) == "1.2"


def _visible(text: str) -> str:
    return "".join(ch for ch in text if not ch.isspace() and ch != "─")


@pytest.mark.parametrize("width", [100, 90, 80, 70])
def test_a_folded_table_keeps_every_character(width):
    """rich crops a cell whose column ends up narrower than its wrapped text (the last column lost
    'd' of 'would' at 100 columns, and a number header wider than its numbers cut 'interpolated')."""
    cases = [
        (["path", "concurrency", "message", "backend", "us/call", "floor ms/step", "max tok/s", "latency"],
         [["default", "1", "12K", "nccl (graph)", "59.9", "9.34", "107", "interpolated"],
          ["fastest", "1", "12K", "nccl:proto=LL,algo=Ring (graph)", "47.7", "7.44", "134", "interpolated"]],
         (1, 2, 4, 5, 6)),
        (["fastest of them", "concurrency", "message", "us/call", "best engine path", "headroom"],
         [["p2p:oneshot (graph)", "1", "12K", "11.4", "nccl:proto=LL,algo=Ring (graph) 47.7",
           "a kernel like this would save 36.3 us per call / 5.66 ms per step on this box"]], (1, 2, 3)),
    ]
    for headers, rows, right in cases:
        out = render.table(headers, rows, right=right, width=width)
        lines = out.splitlines()
        assert all(len(line) <= width for line in lines)
        # Every character of every cell is there (a record leaves the first column's header out).
        shown = _visible(out)
        given = _visible("".join(headers[1:]) + "".join("".join(r) for r in rows))
        for ch in set(given):
            assert shown.count(ch) >= given.count(ch), ch
