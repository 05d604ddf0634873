"""`commbench table`: recorded runs side by side as markdown."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from helpers import run_cli

from commbench.analysis import table
from commbench.analysis.fusion import FUSED_OP
from commbench.results import Measurement
from commbench.runs import load_run
from commbench.units import format_bytes

REFERENCE = Path(__file__).parents[1] / "results" / "reference" / "h200-mps-emulated"


def _run_dir(parent: Path) -> Path:
    """The one run under a sweep's --out folder."""
    (run,) = [p for p in parent.iterdir() if (p / "run.json").is_file()]
    return run


WORLDS = [_run_dir(REFERENCE / f"world{n}" / "allreduce") for n in (2, 4, 8)]


def test_recorded_world_sizes_side_by_side(tmp_path):
    out = tmp_path / "README-table.md"
    done = run_cli(["table", *map(str, WORLDS), "--out", str(out)])
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == f"wrote {out}"
    text = out.read_text()
    for n in (2, 4, 8):
        assert f"### allreduce, bf16, graph, {n} ranks: latency_us / jitter p50 us" in text
    assert "> " in text and "emulat" in text.lower()   # the runs' own emulation line, quoted
    # One recorded row, as its cell: the headline and the jitter p50.
    row = next(r for r in load_run(WORLDS[1]).rows if r.backend == "symm_mem:two_shot" and r.message_bytes == 1 << 20)
    section = next(part for part in text.split("### ") if part.startswith("allreduce, bf16, graph, 4 ranks"))
    size_line = next(line for line in section.splitlines() if line.startswith(f"| {format_bytes(1 << 20)} |"))
    assert f"{table.fmt_us(row.latency_us)} / {table.fmt_us(row.jitter_p50_us)}" in size_line
    # Exactly one fastest cell per size row.
    assert size_line.count("**") == 2


def _write_run(run_dir: Path, rows: list[Measurement]) -> None:
    run_dir.mkdir()
    shutil.copy(WORLDS[0] / "run.json", run_dir / "run.json")
    with open(run_dir / "measurements.jsonl", "w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row.to_dict()) + "\n")


def _row(backend: str, us: float | None, tokens: int, *, op: str = FUSED_OP, status: str = "ok",
         reason: str | None = None, extra: dict | None = None) -> Measurement:
    return Measurement(backend=backend, mode="graph", dtype="bf16", message_bytes=tokens * 7168 * 2, world_size=2,
                       status=status, op=op, tokens=tokens, hidden=7168, latency_us=us, jitter_p50_us=us,
                       reason=reason, extra=extra or {})


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
    assert table.column_labels(same_parent, [(0, "p2p:auto"), (1, "p2p:auto")]) == [
        "p2p:auto (nopdl)", "p2p:auto (other)"]
    _write_run(tmp_path / "nopdl" / "run3", [_row("p2p:auto", 2.4, 1, op="allreduce")])
    one_parent = [load_run(tmp_path / "nopdl" / "run1"), load_run(tmp_path / "nopdl" / "run3")]
    assert table.column_labels(one_parent, [(0, "p2p:auto"), (1, "p2p:auto")]) == [
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
    text = table.render_runs([load_run(run)])
    assert "| 2 | graph | bf16 | 7168 | 4 | flashinfer:fused_oneshot | 9.00 | p2p:oneshot | 12.5 | 3.50 | +28.0% |" in text
    assert "- `flashinfer:fused_twoshot` at 2 ranks: skipped: two-shot splits tokens" in text
    assert "- `mscclpp:auto` at 2 ranks: skipped: MSCCL++'s TCP bootstrap died with SIGSEGV" in text
    assert f"| {format_bytes(4 * 7168 * 2)} | skipped |" in text   # the allreduce table shows the status
