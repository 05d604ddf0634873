"""commbench compare: latency and p99 change per backend and size, judged against both runs' spread."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from commbench.cli import main as cli
from commbench.analysis.compare import changes
from commbench.analysis.curves import build_curves
from commbench.results import ROWS_FILE
from commbench.runs import load_run
from factories import row

RUNS = Path(__file__).parents[1] / "data" / "runs"
SYNTHETIC = RUNS / "synthetic-pcie-8gpu"
CPU_A, CPU_B = RUNS / "cpu-gloo-4rank-a", RUNS / "cpu-gloo-4rank-b"


def _slowed(tmp_path: Path, backend: str, factor: float) -> Path:
    """A copy of the synthetic run where one backend's latencies are multiplied by factor."""
    run = tmp_path / "slowed"
    shutil.copytree(SYNTHETIC, run)
    lines = []
    for line in (run / ROWS_FILE).read_text().splitlines():
        row = json.loads(line)
        if row["backend"] == backend and not row["env_setting"]:
            for key in ("latency_p10_us", "latency_p50_us", "latency_p90_us", "latency_p99_us"):
                if row[key] is not None:
                    row[key] *= factor
        lines.append(json.dumps(row))
    (run / ROWS_FILE).write_text("\n".join(lines) + "\n")
    return run


def test_a_real_slowdown_is_beyond_spread_and_the_rest_is_not(tmp_path):
    a = build_curves(load_run(SYNTHETIC).rows)
    b = build_curves(load_run(_slowed(tmp_path, "nccl", 1.5)).rows)
    rows = changes(a, b)
    nccl = [c for c in rows if c.curve.startswith("nccl (")]
    assert len(nccl) == 22                                         # graph and eager, 11 sizes each
    assert all(c.latency_change_pct == pytest.approx(50.0) and c.verdict == "B slower" for c in nccl)
    assert all(c.p99_change_pct == pytest.approx(50.0) for c in nccl)
    others = [c for c in rows if not c.curve.startswith("nccl (")]
    assert others and all(c.latency_change_pct == 0 and c.verdict == "same (within spread)" for c in others)


def test_a_change_smaller_than_the_spread_is_noise(tmp_path):
    # the fixture's p10-p90 band is 11% of p50 wide: a 5% shift stays inside it
    rows = changes(build_curves(load_run(SYNTHETIC).rows),
                   build_curves(load_run(_slowed(tmp_path, "symm_mem:two_shot", 1.05)).rows))
    shifted = [c for c in rows if c.curve.startswith("symm_mem")]
    assert all(c.latency_change_pct == pytest.approx(5.0) and c.beyond_spread is False for c in shifted)


@pytest.mark.procs
def test_cli_on_two_cpu_sweeps(tmp_path, capsys):
    out = tmp_path / "cmp.json"
    assert cli(["compare", str(CPU_A), str(CPU_B), "--out", str(tmp_path), "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert len(data["changes"]) == 22                              # bf16 and fp32 x 11 sizes of gloo
    assert {c["curve"] for c in data["changes"]} == {"gloo (eager)"}
    pngs = list(tmp_path.glob("compare_*.png"))
    assert len(pngs) == 1 and pngs[0].stat().st_size > 10_000 and pngs[0].with_suffix(".svg").exists()
    assert "A = 20261129-133158-vm" in capsys.readouterr().out


def test_runs_with_nothing_in_common_exit_2(tmp_path, capsys):
    assert cli(["compare", str(CPU_A), str(SYNTHETIC), "--out", str(tmp_path), "--different-machines"]) == 2
    assert "share no backend" in capsys.readouterr().err
    assert cli(["compare", str(CPU_A), "/no/such/run"]) == 2


EMULATED = next((Path(__file__).parents[2] / "results" / "reference" / "h200-mps-emulated" / "world8"
                 / "allreduce").glob("*/run.json")).parent


def test_runs_of_different_machines_are_refused_without_the_flag(tmp_path, capsys):
    """The synthetic PCIe fixture against an emulated one-GPU H200 run: no verdict, one line why."""
    assert cli(["compare", str(SYNTHETIC), str(EMULATED), "--out", str(tmp_path)]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and len(captured.err.strip().splitlines()) == 1
    assert "not one machine's runs (data: fixture vs emulated; host: synthetic-host vs vm" in captured.err
    assert "--different-machines" in captured.err and not list(tmp_path.iterdir())   # nothing written

    out = tmp_path / "cmp.json"
    assert cli(["compare", str(SYNTHETIC), str(EMULATED), "--out", str(tmp_path), "--json", str(out), "--wide",
                "--different-machines"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("A: data: fixture: hand-made test data")
    assert lines[1].startswith("B: data: emulated: 8 ranks on 1x NVIDIA H200 under MPS")
    assert lines[2].startswith("note: A and B are not one machine's runs (data: fixture vs emulated;")
    data = json.loads(out.read_text())
    assert data["provenance_a"]["kind"] == "fixture" and data["provenance_b"]["kind"] == "emulated"
    assert data["different_machines"][0] == "data: fixture vs emulated" and data["changes"]


def test_same_machine_runs_start_with_their_provenance(tmp_path, capsys):
    assert cli(["compare", str(CPU_A), str(CPU_B), "--out", str(tmp_path)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "A: data: cpu: 4 ranks of gloo on the CPU, no GPU and no fabric, host vm; run 20261129-133158-vm"
    assert lines[1].startswith("B: data: cpu: 4 ranks of gloo on the CPU") and not lines[2].startswith("note:")


@pytest.mark.procs
def test_bf16_and_fp32_rows_are_told_apart(tmp_path, capsys):
    from commbench.analysis import plots

    out = tmp_path / "cmp.json"
    assert cli(["compare", str(CPU_A), str(CPU_B), "--out", str(tmp_path), "--json", str(out), "--wide"]) == 0
    lines = capsys.readouterr().out.splitlines()
    # one table per backend and dtype, under its name: the spec is never folded inside a column
    assert [line for line in lines if line.startswith("gloo (eager)")] == ["gloo (eager), bf16", "gloo (eager), fp32"]
    assert next(line for line in lines if line.startswith("size")).split()[:3] == ["size", "latency", "A"]
    assert sum(line.split()[:1] == ["4K"] for line in lines) == 2
    changes_4k = [c for c in json.loads(out.read_text())["changes"] if c["message_bytes"] == 4096]
    assert sorted(c["dtype"] for c in changes_4k) == ["bf16", "fp32"]
    curves_a, curves_b = build_curves(load_run(CPU_A).rows), build_curves(load_run(CPU_B).rows)
    fig = plots.compare_figure(curves_a, curves_b, "a", "b", "t")
    labels = [t.get_text() for t in fig.axes[0].get_legend().get_texts()]
    assert "gloo (eager) bf16 A" in labels and "gloo (eager) fp32 A" in labels and len(set(labels)) == len(labels)


def test_curves_pair_across_runs_by_the_whole_key_and_name_what_sets_them_apart():
    old = {"extra": {"nccl_version_loaded": "2.28.9"}, "world_size": 8}
    new = {"extra": {"nccl_version_loaded": "2.30.7"}, "world_size": 8}
    one_run = build_curves([row(latency_us=40.0, **old), row(latency_us=30.0, **new)])   # two NCCLs: two curves
    assert sorted(c.label for c in one_run) == ["nccl {NCCL 2.28.9} (graph)", "nccl {NCCL 2.30.7} (graph)"]
    # A before/after of one NCCL upgrade: each run has one nccl curve, so they are compared.
    (upgrade,) = changes(build_curves([row(latency_us=40.0, **old)]), build_curves([row(latency_us=30.0, **new)]))
    assert upgrade.latency_change_pct == pytest.approx(-25.0)
    # Against a run with both, each side pairs with its own library only.
    paired = changes(one_run, build_curves([row(latency_us=44.0, **old), row(latency_us=33.0, **new)]))
    assert sorted(round(c.latency_change_pct) for c in paired) == [10, 10]
    mixed = build_curves([row(latency_us=40.0, **{**old, "world_size": 4}), row(latency_us=50.0, **old)])
    assert sorted(c.label for c in mixed) == ["nccl {4 ranks} (graph)", "nccl {8 ranks} (graph)"]


def test_a_long_comparison_shows_the_changes_that_matter_and_keeps_every_one(tmp_path, capsys, monkeypatch):
    """More changes than the terminal's cap: the slowed backend's changes (beyond spread) are the
    ones shown, the line after says how many more and where all of them are."""
    from commbench.analysis import compare

    monkeypatch.setattr(compare, "CHANGES_SHOWN", 5)
    slowed = _slowed(tmp_path, "p2p:oneshot", 1.5)
    assert cli(["compare", str(SYNTHETIC), str(slowed), "--out", str(tmp_path / "cmp")]) == 0
    out = capsys.readouterr().out
    sizes = [line.split()[0] for line in out.splitlines() if line.endswith("B slower")]
    assert sizes == ["4K", "8K", "16K", "32K", "64K"]                 # the first five of its 8, in size order
    assert "same (within spread)" not in out
    every = tmp_path / "cmp" / "compare_synthetic-pcie-8gpu_vs_slowed_changes.json"
    assert "shown: the 5 changes that matter most" in out and "58 more, all 63 in" in out.replace("\n", " ")
    assert len(json.loads(every.read_text())["changes"]) == 63

    assert cli(["compare", str(SYNTHETIC), str(slowed), "--out", str(tmp_path / "cmp2"), "--json",
                str(tmp_path / "all.json")]) == 0
    assert f"all 63 in {tmp_path / 'all.json'}" in capsys.readouterr().out.replace("\n", " ")
    assert not list((tmp_path / "cmp2").glob("*.json"))
    assert len(json.loads((tmp_path / "all.json").read_text())["changes"]) == 63


@pytest.mark.parametrize("items", [[], [{"curve": "a\n\"b", "p99": None}],
                                   [{"x": 1.5, "l": [1, {"k": "v"}]}, {"y": 2}]])
def test_json_written_a_change_at_a_time_is_the_text_of_the_whole(tmp_path, items):
    from commbench.files import write_json, write_json_list

    payload = {"a": 1, "nested": {"b": [1, 2]}, "changes": [], "last": "z"}
    write_json(str(tmp_path / "whole.json"), {**payload, "changes": items})
    write_json_list(str(tmp_path / "streamed.json"), payload, "changes", iter(items))
    assert (tmp_path / "streamed.json").read_text() == (tmp_path / "whole.json").read_text()
