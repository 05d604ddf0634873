"""Two NCCL versions side by side, offline: one run holding `nccl` (torch's NCCL) and
`nccl:lib=cu13-2.29.7` (a --nccl-lib child), as compare and report show them."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from commbench.analysis.nccl_loaded import nccl_version_lines
from commbench.cli import main as cli
from commbench.results import ROWS_FILE
from commbench.runs import load_run

SYNTHETIC = Path(__file__).parents[1] / "data" / "runs" / "synthetic-pcie-8gpu"
TORCH_LIB, WHEEL_LIB = "/venv/torch/lib/../../nvidia/nccl/lib/libnccl.so.2", "/opt/cu13-2.29.7/nvidia/nccl/lib/libnccl.so.2"
LATENCY_KEYS = ("latency_p10_us", "latency_p50_us", "latency_p90_us", "latency_p99_us")


def two_versions(tmp_path: Path, factor: float) -> Path:
    """The synthetic run's nccl rows, recorded as NCCL 2.28.9, plus its plain ones run
    with a second library (NCCL 2.29.7) whose latencies are `factor` times theirs."""
    run = tmp_path / "two-nccls"
    shutil.copytree(SYNTHETIC, run)
    lines = []
    for line in (run / ROWS_FILE).read_text().splitlines():
        row = json.loads(line)
        lines.append(row)
        if row["backend"] != "nccl":
            continue
        row["extra"] = {"nccl_version_loaded": "2.28.9", "nccl_lib_loaded": TORCH_LIB}
        if row["env_setting"]:
            continue
        other = json.loads(json.dumps(row))
        other["backend"] = "nccl:lib=cu13-2.29.7"
        other["env_setting"] = {"LD_PRELOAD": WHEEL_LIB}
        other["extra"] = {"nccl_version_loaded": "2.29.7", "nccl_lib_loaded": WHEEL_LIB,
                          "nccl_lib_label": "cu13-2.29.7", "nccl_lib_requested": WHEEL_LIB}
        for key in LATENCY_KEYS:
            if other[key] is not None:
                other[key] *= factor
        lines.append(other)
    (run / ROWS_FILE).write_text("".join(json.dumps(r) + "\n" for r in lines))
    return run


def test_each_variant_says_which_nccl_its_processes_ran(tmp_path: Path) -> None:
    run = load_run(two_versions(tmp_path, 1.25))
    assert nccl_version_lines(run.rows) == [
        f"nccl: NCCL 2.28.9 ({TORCH_LIB})",
        f"nccl:lib=cu13-2.29.7[LD_PRELOAD={WHEEL_LIB}]: NCCL 2.29.7 ({WHEEL_LIB})",
        f"nccl[NCCL_MIN_NCHANNELS=8]: NCCL 2.28.9 ({TORCH_LIB})"]


@pytest.mark.procs
def test_compare_puts_two_nccl_versions_of_one_run_side_by_side(tmp_path: Path, capsys) -> None:
    run = two_versions(tmp_path, 1.25)
    out = tmp_path / "cmp.json"
    # nccl also ran under an --env setting in this run: "nccl" is the variant without one.
    assert cli(["compare", str(run), str(run), "--backend-a", "nccl",
                "--backend-b", "nccl:lib=cu13-2.29.7", "--out", str(tmp_path), "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["nccl_a"] == [f"nccl: NCCL 2.28.9 ({TORCH_LIB})"]
    assert data["nccl_b"] == [f"nccl:lib=cu13-2.29.7[LD_PRELOAD={WHEEL_LIB}]: NCCL 2.29.7 ({WHEEL_LIB})"]
    assert len(data["changes"]) == 22                              # graph and eager, 11 sizes each
    assert all(c["latency_change_pct"] == pytest.approx(25.0) and c["verdict"] == "B slower" for c in data["changes"])
    printed = capsys.readouterr().out
    assert f"B ran nccl:lib=cu13-2.29.7[LD_PRELOAD={WHEEL_LIB}]: NCCL 2.29.7" in printed
    assert [p.name for p in tmp_path.glob("compare_*.png")] == [
        "compare_two-nccls_vs_two-nccls_nccl_vs_nccl_lib=cu13-2_29_7.png"]


@pytest.mark.parametrize("args, message", [
    (["--backend-a", "nccl"], "--backend-a and --backend-b go together"),
    (["--backend-a", "nccl", "--backend-b", "nccl:lib=other"], "no trusted rows of backend 'nccl:lib=other'"),
])
def test_side_by_side_bad_input_exits_2(tmp_path: Path, capsys, args: list[str], message: str) -> None:
    run = two_versions(tmp_path, 1.0)
    assert cli(["compare", str(run), str(run), *args, "--out", str(tmp_path)]) == 2
    assert message in capsys.readouterr().err


def test_a_name_that_fits_several_settings_asks_for_one(tmp_path: Path, capsys) -> None:
    run = two_versions(tmp_path, 1.0)
    rows = [json.loads(line) for line in (run / ROWS_FILE).read_text().splitlines()]
    for row in rows:
        if row["backend"] == "nccl" and not row["env_setting"]:
            row["env_setting"] = {"NCCL_MIN_NCHANNELS": "4"}
    (run / ROWS_FILE).write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert cli(["compare", str(run), str(run), "--backend-a", "nccl", "--backend-b", "nccl:lib=cu13-2.29.7",
                "--out", str(tmp_path)]) == 2
    assert ("backend 'nccl' ran under several settings; name one of them: nccl[NCCL_MIN_NCHANNELS=4], "
            "nccl[NCCL_MIN_NCHANNELS=8]") in capsys.readouterr().err


def test_report_lists_the_nccl_of_every_variant(tmp_path: Path, capsys) -> None:
    run = two_versions(tmp_path, 0.8)
    assert cli(["report", str(run), "--out", str(tmp_path / "report")]) == 0
    printed = capsys.readouterr().out
    assert "NCCL each variant ran (ncclGetVersion of the library in its process):" in printed
    assert f"  nccl: NCCL 2.28.9 ({TORCH_LIB})" in printed
    html = (tmp_path / "report" / "report.html").read_text()
    assert "NCCL each variant ran" in html and "2.29.7" in html and "nccl:lib=cu13-2.29.7" in html
