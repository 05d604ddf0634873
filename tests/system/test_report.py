"""commbench report and the curve rules under it: trusted rows only, winners, crossovers, HTML."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest

from commbench.cli import main as cli
from commbench.analysis.curves import NO_DIFFERENCE, baseline_name, build_curves, crossovers, ranking, select
from commbench.analysis.fusion import COMPARISON_HEADERS, FUSED_OP, comparison_cells
from commbench.analysis.report import range_rows
from commbench.results import Measurement
from commbench.runs import load_run
from factories import row

RUNS = Path(__file__).parents[1] / "data" / "runs"
SYNTHETIC = RUNS / "synthetic-pcie-8gpu"
CPU_A = RUNS / "cpu-gloo-4rank-a"
K = 1024


def _graph_bf16():
    return select(build_curves(load_run(SYNTHETIC).rows), dtype="bf16", mode="graph")


def test_a_wrong_row_never_wins_even_when_fastest():
    # p2p:oneshot returned stale data at 1M in 150 us, faster than symm_mem:two_shot's 220 us.
    ranked = ranking(_graph_bf16(), 1 << 20)
    assert ranked[0].curve.label == "symm_mem:two_shot (graph)"
    assert ranked[0].point.latency_us == 220
    assert all(c.curve.key.variant != "p2p:oneshot" for c in ranked)


def test_crossover_table():
    cuts = [(c.first_bytes, c.last_bytes, c.winner) for c in crossovers(_graph_bf16())]
    # a size where the fastest is inside both spreads of the runner-up has no winner
    assert cuts == [(4 * K, 64 * K, "p2p:oneshot (graph)"),
                    (128 * K, 128 * K, NO_DIFFERENCE),
                    (256 * K, 1 << 20, "symm_mem:two_shot (graph)"),
                    (2 << 20, 2 << 20, "nccl[NCCL_MIN_NCHANNELS=8] (graph)"),
                    (4 << 20, 4 << 20, NO_DIFFERENCE)]
    first = range_rows(_graph_bf16(), "nccl")[0]
    assert first.runner_up == "symm_mem:two_shot (graph)"
    assert first.margin_x == pytest.approx((33 / 27, 20 / 8))      # runner-up / winner p50 at 64K and 4K
    assert first.vs_baseline_x == pytest.approx((120 / 27, 50 / 9.5))  # nccl / p2p:oneshot at 64K and 8K


def test_no_interpolation_across_a_size_that_failed():
    p2p = {"backend": "p2p:oneshot", "world_size": 8}
    curve = build_curves([row(message_bytes=8 * K, latency_us=10.0, **p2p),
                          row(message_bytes=16 * K, status="wrong", latency_us=5.0, wrong_elements=12, **p2p),
                          row(message_bytes=32 * K, latency_us=20.0, **p2p),
                          row(message_bytes=64 * K, latency_us=40.0, **p2p)])[0]
    assert curve.sizes() == [8 * K, 32 * K, 64 * K]
    assert curve.at(12 * K) is None and curve.at(24 * K) is None      # 16K lies between 8K and 32K
    assert curve.at(48 * K).latency_us == pytest.approx(30.0, rel=0.01)   # sqrt(20*40) in log-log: 28.3
    assert curve.at(48 * K).latency_us == pytest.approx(20 * 2 ** 0.585, rel=1e-3)


def test_ok_status_with_wrong_elements_is_not_trusted():
    rows = [row(backend="x", mode="eager", dtype="fp32", message_bytes=1024, latency_us=1.0, wrong_elements=3)]
    assert build_curves(rows) == []


def test_baseline_is_nccl_else_gloo():
    assert baseline_name(_graph_bf16(), None) == "nccl"
    assert baseline_name(build_curves(load_run(CPU_A).rows), None) == "gloo"


def test_report_writes_self_contained_html_with_red_rows(tmp_path, capsys):
    assert cli(["report", str(SYNTHETIC), "--out", str(tmp_path), "--wide"]) == 0
    page = (tmp_path / "report.html").read_text()
    for name in ("latency_bf16", "busbw_bf16", "speedup_bf16"):
        assert (tmp_path / "plots" / f"{name}.png").stat().st_size > 10_000
        assert (tmp_path / "plots" / f"{name}.svg").exists()
    assert page.count("data:image/png;base64,") == 3
    assert not re.search(r'src="(?!data:)', page)                       # nothing loaded from outside
    bad = re.findall(r'<tr class="bad">(.*?)</tr>', page)
    assert sum("p2p:oneshot" in r and "<td>wrong</td>" in r for r in bad) == 1
    assert sum("p2p:oneshot" in r and "<td>hang</td>" in r for r in bad) == 2
    assert "cuMemCreate probe failed on rank 3" in page                   # probe verdicts
    out = capsys.readouterr().out
    assert re.search(r"\n2M +nccl\[NCCL_MIN_NCHANNELS=8\]", out)
    assert re.search(r"\n4M +no measurable difference ", out)
    # What the data is comes first, on the console and on the page.
    line = "data: fixture: hand-made test data, not a measurement"
    assert out.startswith(line)
    assert page.split("<body>")[1].startswith(f"\n<p class='provenance'><b>{line}")


CAUTION = ("caution: p2p:oneshot failed its check at 1M wrong (stale), 2M hang, 4M hang; its other sizes run "
           "the same code")


def test_a_winner_that_failed_at_other_sizes_is_cautioned_under_its_table(tmp_path, capsys):
    # p2p:oneshot wins 4K-64K in graph mode; eager mode's winner (nccl) never failed.
    assert cli(["report", str(SYNTHETIC), "--out", str(tmp_path), "--wide"]) == 0
    out = capsys.readouterr().out
    graph, eager = out.split("bf16, eager mode")
    assert graph.count(CAUTION) == 1 and graph.index("4K-64K   p2p:oneshot") < graph.index(CAUTION)
    assert "caution" not in eager
    page = (tmp_path / "report.html").read_text()
    tables = page.split("<h2>")
    graph_html = next(t for t in tables if t.startswith("bf16, graph mode"))
    assert graph_html.index("p2p:oneshot") < graph_html.index(f"<p class='caution'>{CAUTION}</p>")
    assert not any("caution:" in t for t in tables if t.startswith("bf16, eager mode"))


def test_report_of_a_cpu_sweep_goes_to_a_new_folder_never_into_the_run_dir(tmp_path, monkeypatch):
    run = tmp_path / "run"
    shutil.copytree(CPU_A, run)
    before = sorted(p.name for p in run.iterdir())
    monkeypatch.chdir(tmp_path)
    assert cli(["report", str(run)]) == 0
    assert sorted(p.name for p in run.iterdir()) == before
    page = (tmp_path / "run-report" / "report.html").read_text()
    assert "gloo (eager)" in page and "commbench sweep -b 1K -e 1M" in page
    assert sorted(p.name for p in (tmp_path / "run-report" / "plots").glob("*.png")) == [
        "busbw_bf16.png", "busbw_fp32.png", "latency_bf16.png", "latency_fp32.png"]
    monkeypatch.chdir(run)   # the default would land inside the run: refused, nothing written
    assert cli(["report", str(run)]) == 2
    assert sorted(p.name for p in run.iterdir()) == before


@pytest.mark.slow
def test_a_report_or_compare_that_fails_leaves_nothing_behind(tmp_path, monkeypatch, capsys):
    """A --trace of 2 ranks on an 8-rank run is refused after the plots are drawn: no RUN-report,
    no half-built folder, no parent made for --out. Named again, an --out that holds a report
    keeps the files the new one does not write, and a symlink where a file goes is refused."""
    trace = Path(__file__).parents[1] / "data" / "traces" / "h200-mps" / "p2p-oneshot_lamport-rank0.trace.json.gz"
    monkeypatch.chdir(tmp_path)
    assert cli(["report", str(SYNTHETIC), "--trace", str(trace)]) == 2
    assert cli(["report", str(SYNTHETIC), "--trace", str(trace), "--out", str(tmp_path / "a" / "b")]) == 2
    assert "world size 8, not TP 2" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []
    out = tmp_path / "rep"
    assert cli(["report", str(SYNTHETIC), "--out", str(out)]) == 0
    (out / "mine.txt").write_text("kept")
    assert cli(["report", str(SYNTHETIC), "--out", str(out)]) == 0
    assert (out / "mine.txt").read_text() == "kept" and (out / "plots" / "latency_bf16.png").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rep"]
    (out / "report.html").unlink()
    (out / "report.html").symlink_to(tmp_path / "elsewhere.html")
    assert cli(["report", str(SYNTHETIC), "--out", str(out)]) == 2
    assert "a symlink" in capsys.readouterr().err and not (tmp_path / "elsewhere.html").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rep"]
    assert cli(["compare", str(CPU_A), str(CPU_A.parent / "cpu-gloo-4rank-b"), "--backend-a", "gloo",
                "--out", str(tmp_path / "cmp")]) == 2   # --backend-a without -b: refused, nothing written
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rep"]


def test_report_shows_fused_against_unfused_from_a_recorded_run(tmp_path, capsys):
    (fused_run,) = (Path(__file__).parents[2] / "results" / "reference" / "h200-mps-emulated" / "world2"
                    / "fused-h7168").glob("*/run.json")
    rows = load_run(fused_run.parent).rows
    expected = comparison_cells(rows)
    assert len(expected) == len([r for r in rows if r.op == FUSED_OP and r.status == "ok"
                                 and r.backend != "unfused:best"]) > 0
    assert cli(["report", str(fused_run.parent), "--out", str(tmp_path), "--wide"]) == 0
    lines = capsys.readouterr().out.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("allreduce + residual + RMSNorm: fused vs unfused"))
    assert lines[start + 1].split() == COMPARISON_HEADERS[:5] + ["fused", "fused", "us", "unfused", "allreduce",
                                                                 "unfused", "us", "saving", "us", "saving"]
    assert [line.split() for line in lines[start + 3:start + 3 + len(expected)]] == expected
    page = (tmp_path / "report.html").read_text()
    assert "fused vs unfused</h2>" in page and f"<td>{expected[0][5]}</td>" in page


def test_other_schema_version_and_missing_dir_exit_2(tmp_path, capsys):
    run = tmp_path / "old"
    shutil.copytree(CPU_A, run)
    info = json.loads((run / "run.json").read_text())
    (run / "run.json").write_text(json.dumps({**info, "schema": 99}))
    assert cli(["report", str(run)]) == 2
    assert "schema version 99" in capsys.readouterr().err
    assert cli(["report", str(tmp_path / "nope")]) == 2
    assert "no such results directory" in capsys.readouterr().err
    assert cli(["report", str(SYNTHETIC), "--baseline", "mscclpp", "--out", str(tmp_path / "r")]) == 2
    assert "baseline 'mscclpp' has no trusted rows" in capsys.readouterr().err
    assert not (tmp_path / "r").exists()      # checked before plots/ is made


@pytest.mark.parametrize("command, shown", [
    (["/usr/bin/python3", "/opt/venv/bin/torchrun", "--nproc-per-node", "8", "-m", "commbench", "sweep"],
     "torchrun --nproc-per-node 8 -m commbench sweep"),
    (["/opt/venv/bin/python", "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m",
      "commbench", "sweep", "--env", "NCCL_PROTO=LL,Simple"],
     "python -m torch.distributed.run --standalone --nproc-per-node 2 -m commbench sweep --env NCCL_PROTO=LL,Simple"),
    (["/src/commbench/commbench/__main__.py", "sweep", "--nproc", "8", "--sizes", "4K,8K"],
     "commbench sweep --nproc 8 --sizes 4K,8K"),
    (["/usr/local/bin/commbench", "sweep", "--backends", "nccl:proto=LL,algo=Ring"],
     "commbench sweep --backends nccl:proto=LL,algo=Ring"),
    ("commbench sweep", "commbench sweep"),
])
def test_the_launching_command_is_shown_as_typed(command, shown):
    from commbench.analysis.report import command_text

    assert command_text(command) == shown


@pytest.mark.parametrize("ending, shown", [
    ({"finished": 1767225600}, "2026-01-01 00:00:00 UTC"),
    ({"interrupted": 1767225600}, "interrupted at 2026-01-01 00:00:00 UTC (partial run; --resume continues it)"),
    ({}, "unfinished: it hung, was killed or is still running"),
])
def test_the_page_says_how_the_run_ended(ending, shown, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(CPU_A, run)
    info = {k: v for k, v in json.loads((run / "run.json").read_text()).items() if k != "finished"}
    (run / "run.json").write_text(json.dumps({**info, **ending}))
    assert cli(["report", str(run), "--out", str(tmp_path / "out")]) == 0
    page = (tmp_path / "out" / "report.html").read_text()
    assert f"<td>finished</td><td>{shown}" in page
    assert ("<p><b>Run " in page) == ("finished" not in ending)


def test_a_plot_of_a_hundred_variants_keeps_its_axes_and_names_every_failure(tmp_path):
    """137 variants of 200 sizes (a long resumed sweep): the legend names the failed checks and
    counts the curves it leaves out, so the axes keep their size (matplotlib warned that
    constrained_layout collapsed them), and such dense curves are drawn without markers."""
    import warnings

    from commbench.analysis import plots

    run = load_run(SYNTHETIC)
    failed = [r for r in run.rows if r.status in ("wrong", "hang")]
    ok = [r for r in run.rows if r.status == "ok" and r.latency_us][0]
    rows = [Measurement.from_dict({**ok.to_dict(), "backend": f"nccl:variant{v}", "message_bytes": 4096 * (i + 1)})
            for v in range(137) for i in range(200)]
    fig = plots.latency_figure(build_curves(rows), failed, "t")
    labels = [" ".join(t.get_text().split()) for t in fig.axes[0].get_legend().get_texts()]
    assert len(labels) == plots.LEGEND_ENTRIES_MAX, labels
    assert any(label.startswith("p2p:oneshot failed: wrong at 1M") for label in labels)
    assert f"and {137 - (plots.LEGEND_ENTRIES_MAX - 1 - len(set(r.backend for r in failed)))} more curves, " \
           "not named here" in labels
    assert all(line.get_marker() in ("None", None, "") for line in fig.axes[0].lines)
    with warnings.catch_warnings():
        warnings.simplefilter("error")   # "constrained_layout not applied" is a UserWarning
        plots.save(fig, tmp_path / "latency")


def test_failed_checks_are_named_in_the_legend_not_over_the_curves():
    from commbench.analysis import plots

    run = load_run(SYNTHETIC)
    failed = [r for r in run.rows if r.status in ("wrong", "hang")]
    fig = plots.latency_figure(build_curves(run.rows), failed, "t")
    ax = fig.axes[0]
    assert len(ax.texts) == 0                               # no label drawn on the plot itself
    labels = [" ".join(t.get_text().split()) for t in ax.get_legend().get_texts()]
    assert "p2p:oneshot failed: wrong at 1M; hang at 2M, 4M (no latency: drawn at top)" in labels


def test_all_measurements_fit_a_1400_px_page():
    """One column per fact, backend settings and fused ops under the name: no reason needs a scroll."""
    from commbench.analysis.report import measurement_table

    table = "".join(measurement_table(load_run(SYNTHETIC).rows))
    assert table.count("<th>") == 11
    assert '<span class="sub">NCCL_MIN_NCHANNELS=8</span>' in table


CHROMIUM = shutil.which("chromium")


@pytest.mark.procs
@pytest.mark.skipif(CHROMIUM is None, reason="no chromium here (Debian: apt-get install chromium)")
def test_in_a_real_browser_no_table_overflows_a_1400_px_page(tmp_path):
    import subprocess

    assert cli(["report", str(SYNTHETIC), "--out", str(tmp_path), "--wide"]) == 0
    page = tmp_path / "report.html"
    probe = ("<script>document.body.dataset.overflow = [...document.querySelectorAll('table')]"
             ".filter(t => t.getBoundingClientRect().right > document.documentElement.clientWidth).length"
             " + ':' + document.documentElement.scrollWidth;</script></body>")
    page.write_text(page.read_text().replace("</body>", probe))
    done = subprocess.run([CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
                           "--disable-background-networking", "--disable-component-update", "--disable-sync",
                           f"--user-data-dir={tmp_path / 'profile'}", "--window-size=1400,2000", "--dump-dom",
                           page.as_uri()], capture_output=True, text=True, timeout=120)
    match = re.search(r'data-overflow="(\d+):(\d+)"', done.stdout)
    assert match, done.stderr[-2000:]
    assert match.group(1) == "0" and int(match.group(2)) <= 1400


def test_winners_are_ranked_within_one_world_size(tmp_path):
    """Rows of two world sizes in one dir (nccl-tests imports can hold both): a section each, so an
    8-rank curve never 'wins' against a 4-rank one."""
    from commbench.analysis.report import build_sections

    rows = [row(world_size=4, latency_us=10.0), row(world_size=8, latency_us=20.0),
            row(backend="p2p:auto", world_size=8, latency_us=15.0)]
    sections = build_sections([], build_curves(rows), "nccl")
    assert [(s.title, [r.crossover.winner for r in s.ranges]) for s in sections] == [
        ("bf16, graph mode, 4 ranks", ["nccl {4 ranks} (graph)"]),
        ("bf16, graph mode, 8 ranks", ["p2p:auto (graph)"])]
    assert sections[1].ranges[0].vs_baseline_x == (20.0 / 15.0, 20.0 / 15.0)   # against the 8-rank nccl
