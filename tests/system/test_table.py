"""`commbench table`: recorded runs side by side as markdown."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from helpers import run_cli

from commbench.analysis import table
from commbench.analysis.curves import CurveKey
from commbench.analysis.fusion import FUSED_OP
from commbench.results import Measurement
from commbench.runs import load_run
from commbench.units import format_bytes
from factories import row, write_run

REFERENCE = Path(__file__).parents[2] / "results" / "reference" / "h200-mps-emulated"


def _run_dir(parent: Path) -> Path:
    """The one run under a sweep's --out folder."""
    (run,) = [p for p in parent.iterdir() if (p / "run.json").is_file()]
    return run


WORLDS = [_run_dir(REFERENCE / f"world{n}" / "allreduce") for n in (2, 4, 8)]


@pytest.mark.procs
def test_recorded_world_sizes_side_by_side(tmp_path):
    out = tmp_path / "README-table.md"
    done = run_cli(["table", *map(str, WORLDS), "--out", str(out)])
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == f"wrote {out}"
    text = out.read_text()
    for n in (2, 4, 8):
        assert f"### allreduce, bf16, graph, {n} ranks, MPS, {n} ranks on 1 GPU: latency_us / jitter p50 us" in text
    # First, what each run is: its provenance line, quoted.
    assert [line.split("; run ")[0] for line in text.splitlines()[:3]] == [
        f"> data: emulated: {n} ranks on 1x NVIDIA H200 under MPS, {100 // n}% of the SMs each: the protocol's cost, "
        f"no fabric (not NVLink, not PCIe), host vm" for n in (2, 4, 8)]
    # One recorded row, as its cell: the headline and the jitter p50.
    row = next(r for r in load_run(WORLDS[1]).rows if r.backend == "symm_mem:two_shot" and r.message_bytes == 1 << 20)
    section = next(part for part in text.split("### ") if part.startswith("allreduce, bf16, graph, 4 ranks"))
    size_line = next(line for line in section.splitlines() if line.startswith(f"| {format_bytes(1 << 20)} |"))
    assert f"{table.fmt_us(row.latency_us)} / {table.fmt_us(row.jitter_p50_us)}" in size_line
    # Exactly one fastest cell per size row.
    assert size_line.count("**") == 2


def _write_run(run_dir: Path, rows: list[Measurement]) -> None:
    write_run(run_dir, rows, like=WORLDS[0])


def _row(backend: str, us: float | None, tokens: int, **changes: Any) -> Measurement:
    """`backend` at `tokens` x 7168 taking `us` (headline and jitter p50), fused unless `changes` say otherwise."""
    return row(backend=backend, latency_us=us, jitter_p50_us=us, tokens=tokens, hidden=7168,
               **{"op": FUSED_OP, **changes})


def test_settings_and_libraries_never_share_a_cell_or_the_bold(tmp_path):
    """The NCCL_MIN_NCHANNELS=8 rows, and rows of another loaded NCCL, are columns of their own:
    the default nccl cell keeps its own number and the bold goes to what really was fastest."""
    torch_nccl, other_nccl = {"nccl_version_loaded": "2.28.9"}, {"nccl_version_loaded": "2.30.7"}
    _write_run(tmp_path / "run", [
        _row("nccl", 60.0, 64, op="allreduce", env_setting={"NCCL_MIN_NCHANNELS": "8"}, extra=torch_nccl),
        _row("symm_mem:two_shot", 80.0, 64, op="allreduce"),
        _row("nccl", 100.0, 64, op="allreduce", extra=torch_nccl),
        _row("nccl", 70.0, 32, op="allreduce", extra=torch_nccl),
        _row("nccl", 50.0, 32, op="allreduce", extra=other_nccl),
        _row("symm_mem:two_shot", 55.0, 32, op="allreduce"),
    ])
    (only,) = table.allreduce_tables([load_run(tmp_path / "run")])
    for row in only.rows:   # the one bold cell of a size holds that size's smallest latency
        latencies = {cell: float(cell.strip("*").split(" / ")[0]) for cell in row[1:] if cell}
        (bold,) = [cell for cell in latencies if cell.startswith("**")]
        assert latencies[bold] == min(latencies.values()), row
    by_size = {row[0]: dict(zip(only.headers, row)) for row in only.rows}
    big = by_size[format_bytes(64 * 7168 * 2)]
    assert big["nccl[NCCL_MIN_NCHANNELS=8]"] == "**60.0 / 60.0**"
    assert big["nccl {NCCL 2.28.9}"] == "100 / 100"
    assert big["symm_mem:two_shot"] == "80.0 / 80.0"
    small = by_size[format_bytes(32 * 7168 * 2)]
    assert small["nccl {NCCL 2.30.7}"] == "**50.0 / 50.0**"
    assert small["nccl {NCCL 2.28.9}"] == "70.0 / 70.0"
    assert sum(cell.startswith("**") for cell in small.values()) == 1


def test_the_same_backend_from_two_runs_gets_a_column_each(tmp_path):
    """A run with other options (here PDL off) must not fill the cells of another run."""
    rows_by_run = {"allreduce": 1.5, "nopdl": 2.3}
    runs = []
    for name, us in rows_by_run.items():
        (tmp_path / name).mkdir()
        _write_run(tmp_path / name / "run1", [_row("p2p:auto", us, 1, op="allreduce")])
        runs.append(load_run(tmp_path / name / "run1"))
    (only,) = table.allreduce_tables(runs)
    assert only.headers == ["size", "p2p:auto (allreduce)", "p2p:auto (nopdl)"]
    assert only.rows == [[format_bytes(7168 * 2), "**1.50 / 1.50**", "2.30 / 2.30"]]
    (tmp_path / "other").mkdir()
    _write_run(tmp_path / "other" / "run2", [_row("p2p:auto", 1.7, 1, op="allreduce")])
    same_parent = [load_run(tmp_path / "nopdl" / "run1"), load_run(tmp_path / "other" / "run2")]
    auto = CurveKey("p2p:auto", "graph", "bf16", "allreduce", 2)
    assert table.column_labels(same_parent, [(0, auto), (1, auto)]) == [
        "p2p:auto (nopdl)", "p2p:auto (other)"]
    _write_run(tmp_path / "nopdl" / "run3", [_row("p2p:auto", 2.4, 1, op="allreduce")])
    one_parent = [load_run(tmp_path / "nopdl" / "run1"), load_run(tmp_path / "nopdl" / "run3")]
    assert table.column_labels(one_parent, [(0, auto), (1, auto)]) == [
        "p2p:auto (run1)", "p2p:auto (run3)"]


def test_fused_saving_and_refusals(tmp_path):
    run = tmp_path / "fused"
    _write_run(run, [
        _row("flashinfer:fused_oneshot", 9.0, 4),
        _row("unfused:best", 12.5, 4, extra={"allreduce_backend": "p2p:oneshot"}),
        _row("flashinfer:fused_twoshot", None, 4, status="skipped",
             reason="two-shot splits tokens across ranks: needs tokens > world size (4 <= 2)"),
        _row("mscclpp:auto", None, 4, op="allreduce", status="skipped",
             reason="MSCCL++'s TCP bootstrap died with SIGSEGV"),
    ])
    text = table.render_markdown(table.table_result([load_run(run)]))
    assert "| 2 | graph | bf16 | 7168 | 4 | flashinfer:fused_oneshot | 9.00 | p2p:oneshot | 12.5 | 3.50 | +28.0% |" in text
    assert "- `flashinfer:fused_twoshot` at 2 ranks: skipped: two-shot splits tokens" in text
    assert "- `mscclpp:auto` at 2 ranks: skipped: MSCCL++'s TCP bootstrap died with SIGSEGV" in text
    assert f"| {format_bytes(4 * 7168 * 2)} | skipped |" in text   # the allreduce table shows the status
