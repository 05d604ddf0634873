"""`commbench attribute` with every rank's trace: calls matched across ranks, clocks, wait and
transfer, the late rank and what it did, on traces recorded on the H200 with a rank made late on
purpose (tests/data/traces/README.md), and derived from them (clock offsets, bad input)."""

from __future__ import annotations

import gzip
import json
import re
import statistics
from pathlib import Path
from typing import Any, Callable

import pytest

from commbench.analysis import attribute
from commbench.analysis.attribute_floor import against_floor
from commbench.analysis.attribution import SizeHint, Step
from commbench.analysis.skew import Skew
from commbench.cli import main as cli_main
from factories import graph_trace

SKEW_DIR = Path(__file__).parents[1] / "data" / "traces" / "h200-mps-skew"
MANIFEST = json.loads((SKEW_DIR / "manifest.json").read_text())
ENTRIES = [e for e in MANIFEST["traces"] if "skipped" not in e]
P2P = next(e for e in ENTRIES if e["backend"] == "p2p:oneshot_lamport")
SPIN = re.compile(r"spin_kernel")
RUN4 = Path(__file__).parents[2] / "results/reference/h200-mps-emulated/world4/allreduce/20261201-205449-vm"
NO_HINT = SizeHint(None, "unknown")


def _files(entry: dict[str, Any]) -> list[Path]:
    return [SKEW_DIR / f for f in entry["files"]]


def _split(paths: list[Path], clock: str = "auto") -> tuple[Skew, list]:
    ranks, results = attribute.analyse_traces(paths, NO_HINT)
    skew = attribute.cross_rank(paths, ranks, results, clock)
    assert skew is not None
    return skew, results


def _events(path: Path) -> dict[str, Any]:
    return json.loads(gzip.decompress(path.read_bytes()))


def _spins_us(entry: dict[str, Any]) -> list[float]:
    """The spin kernels the late rank ran, in order, straight from its trace: the injected delays."""
    doc = _events(SKEW_DIR / entry["files"][entry["late_rank"]])
    spins = sorted((e for e in doc["traceEvents"] if e.get("cat") == "kernel" and SPIN.search(e["name"])),
                   key=lambda e: e["ts"])
    return [e["dur"] for e in spins]


def _rewrite(path: Path, out: Path, change: Callable[[dict[str, Any]], dict[str, Any] | None]) -> Path:
    """A copy of a recorded trace with every event passed through `change` (None drops it)."""
    doc = _events(path)
    doc["traceEvents"] = [e for e in (change(dict(ev)) for ev in doc["traceEvents"]) if e is not None]
    out.write_text(json.dumps(doc))
    return out


def _shifted(tmp_path: Path, offsets_us: list[float], entry: dict[str, Any] = P2P) -> list[Path]:
    def shift(offset: float) -> Callable[[dict[str, Any]], dict[str, Any]]:
        def change(ev: dict[str, Any]) -> dict[str, Any]:
            if isinstance(ev.get("ts"), (int, float)):
                ev["ts"] = ev["ts"] + offset
            return ev
        return change
    return [_rewrite(p, tmp_path / f"shifted-{i}.json", shift(off))
            for i, (p, off) in enumerate(zip(_files(entry), offsets_us))]


@pytest.mark.parametrize("entry", ENTRIES, ids=lambda e: e["name"])
def test_the_rank_made_late_is_named_and_its_delay_is_the_wait(entry: dict[str, Any]) -> None:
    skew, results = _split(_files(entry))
    delayed = sorted(int(i) for i in entry["delays_us"])
    late = entry["late_rank"]
    spins = _spins_us(entry)
    assert len(spins) == entry["steps"] * len(delayed)
    # The recording did what it says: each spin lasts about its nominal delay.
    nominal = [entry["delays_us"][str(i)] for _ in range(entry["steps"]) for i in delayed]
    assert all(abs(s - n) <= 0.1 * n for s, n in zip(spins, nominal))
    assert skew.clock.mode == "shared" and len(skew.calls) == entry["steps"] * entry["allreduces_per_step"]

    affected = [m for m in skew.calls if m.index in delayed]
    unaffected = [m for m in skew.calls if m.index not in delayed and m.index != 0]   # 0: the replays' launch
    assert len(affected) == len(spins)
    for m, spin_us in zip(affected, spins):
        assert m.late_rank == late
        assert m.wait_us == pytest.approx(spin_us, rel=0.2)
    waits = [c.wait_us for m in unaffected for c in m.calls]
    assert statistics.median(waits) <= 0.1 * min(nominal)
    clean = [m.transfer_us for m in unaffected]
    assert all(min(clean) <= m.transfer_us <= max(clean) for m in affected)

    rows = {r.rank: r for r in skew.late}
    assert max(rows.values(), key=lambda r: r.notable_calls).rank == late
    assert rows[late].notable_calls >= len(affected)
    assert rows[late].causes.get("GPU work", 0) >= len(affected)
    assert any("spin_kernel" in name for name in rows[late].kernels)


def test_the_text_splits_the_step_and_prices_the_transfer(capsys: pytest.CaptureFixture[str]) -> None:
    code = cli_main(["attribute", *map(str, _files(P2P)), "--run", str(RUN4), "--hidden", "4096", "--batch", "8"])
    out = capsys.readouterr().out
    assert code == 0 and max(len(line) for line in out.splitlines()) <= 100
    assert "clock: shared, no offsets" in out
    text = " ".join(out.split())
    assert re.search(r"rank 2 was late by >= \d+ us on \d+ calls: it ran a median [\d.]+ us more GPU work", text)
    assert "only it ran: at::cuda::(anonymous namespace)::spin_kernel(long)" in text
    assert re.search(r"commbench p2p at 64K: the kernel itself is within \+[\d.]+ us of the floor; [\d.]+ us per "
                     r"step is skew", text)


def test_json_alone_on_stdout_and_the_plot(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    png = tmp_path / "skew.png"
    code = cli_main(["attribute", *map(str, _files(P2P)), "--json", "-", "--plot", str(png)])
    data = json.loads(capsys.readouterr().out)
    assert code == 0 and png.stat().st_size > 0
    assert data["skew"]["clock"]["mode"] == "shared"
    calls = data["skew"]["calls"]
    assert len(calls) == P2P["steps"] * P2P["allreduces_per_step"]
    assert {c["late_rank"] for c in calls if c["index"] in (3, 8, 13)} == {2}
    assert all(c["wait_us"] is not None for c in data["ranks"][0]["steps"][0]["calls"])


def test_clocks_of_different_hosts_are_aligned_by_the_calls_ends(tmp_path: Path) -> None:
    offsets = [0.0, 1_500_000.25, -320_000.5, 777.75]
    shifted, _ = _split(_shifted(tmp_path, offsets))
    same, _ = _split(_files(P2P))
    assert shifted.clock.mode == "aligned"
    for rank, offset in enumerate(offsets):
        assert shifted.clock.offsets_us[rank] == pytest.approx(offset, abs=0.5)
    assert shifted.clock.residual_us < 1.0
    for a, b in zip(shifted.calls, same.calls):
        assert a.late_rank == b.late_rank or a.skew_us < 5
        assert (a.skew_us, a.wait_us) == pytest.approx((b.skew_us, b.wait_us), abs=1.0)


def test_an_alignment_worse_than_the_skew_is_refused(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """Rank 1's clock jumps by 500 us every other step: no one offset lines its calls' ends up."""
    paths = _shifted(tmp_path, [0.0, 10_000.0, 0.0, 0.0])
    doc = json.loads(paths[1].read_text())
    launches = sorted(e["ts"] for e in doc["traceEvents"]
                      if e.get("cat") == "cuda_runtime" and e.get("name") == "cudaGraphLaunch")
    for ev in doc["traceEvents"]:
        if ev.get("cat") == "kernel" and sum(1 for t in launches if t <= ev["ts"]) % 2:
            ev["ts"] += 500.0
    paths[1].write_text(json.dumps(doc))
    code = cli_main(["attribute", *map(str, paths)])
    out = " ".join(capsys.readouterr().out.split())
    assert code == 0
    assert "clock: not aligned: by the calls' end times the offsets would be" in out
    assert "wait and transfer: the ranks' clocks could not be aligned" in out and "likely waiting" in out


def test_one_rank_says_the_wait_cannot_be_separated_and_flags_likely_waiting(
        capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    code = cli_main(["attribute", str(_files(P2P)[0]), "--json", str(tmp_path / "a.json"),
                     "--plot", str(tmp_path / "p.png")])
    out = " ".join(capsys.readouterr().out.split())
    assert code == 0 and "wait and transfer: one rank's trace" in out
    assert "plot: none written" in out and not (tmp_path / "p.png").exists()
    assert "likely waiting = a call over 2x its floor" in out
    [row] = json.loads((tmp_path / "a.json").read_text())["likely_waiting"]
    # Rank 0 waits for rank 2's spin before 3 calls of each step: at least those are flagged.
    assert row["likely_waiting"] >= 3 * P2P["steps"] and row["floor_from"] == "trace p10"


@pytest.mark.parametrize("case, expected", [
    ("unmatched_calls", "step 0 holds 15 allreduce calls against 16"),
    ("other_kernel", "(not the same collective: another group?)"),
    ("fewer_steps", "11 steps against 12"),
    ("no_allreduce", "step 0 holds 0 allreduce calls against 16"),
])
def test_ranks_that_do_not_match_are_one_line_naming_the_file(case: str, expected: str, tmp_path: Path,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    files = _files(P2P)
    rank1 = _events(files[1])["traceEvents"]
    kernels = sorted((e for e in rank1 if e.get("cat") == "kernel" and "p2p_ll_oneshot" in e["name"]),
                     key=lambda e: e["ts"])
    first, last_corr = kernels[0], max(e["args"]["correlation"] for e in kernels)

    def change(ev: dict[str, Any]) -> dict[str, Any] | None:
        is_ar = ev.get("cat") == "kernel" and "p2p_ll_oneshot" in ev["name"]
        if case == "unmatched_calls" and is_ar and ev["ts"] == first["ts"]:
            return None
        if case == "other_kernel" and is_ar and ev["ts"] == first["ts"]:
            ev["name"] = "void p2p_ll_oneshot<2, 8>(Layout, uint4 const*, uint4*, unsigned int)"
        if case == "fewer_steps" and ev.get("args", {}).get("correlation") == last_corr:
            return None
        if case == "no_allreduce" and is_ar:
            ev["name"] = "some_gemm_kernel"
        return ev
    bad = _rewrite(files[1], tmp_path / "rank1.json", change)
    code = cli_main(["attribute", str(files[0]), str(bad), *map(str, files[2:])])
    out, err = capsys.readouterr()
    assert (code, out) == (2, "")
    assert err.count("\n") == 1 and str(bad) in err and expected in err, err


def test_a_plot_that_is_no_png_is_bad_input(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    code = cli_main(["attribute", *map(str, _files(P2P)), "--plot", str(tmp_path / "p.svg")])
    out, err = capsys.readouterr()
    assert (code, out) == (2, "") and err.count("\n") == 1 and "give a .png file name" in err


def test_ranks_without_any_allreduce_say_so(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    paths = [tmp_path / f"r{rank}.json" for rank in (0, 1)]
    for rank, path in enumerate(paths):
        graph_trace(path, "another_gemm_kernel", rank=rank)
    code = cli_main(["attribute", *map(str, paths)])
    out = capsys.readouterr().out
    assert code == 0 and "no allreduce kernel in any step" in out
    assert "wait and transfer: no allreduce call in the ranks' steps to set side by side" in out


def test_user_step_annotations_are_found_without_a_flag(tmp_path: Path) -> None:
    """An eager trace whose steps only a user's record_function("decode_step_N") marks, 30 us
    apart (under the gap rule's 100 us): the annotation rule finds them in auto mode."""
    events, ts, corr = [], 1000.0, 0
    for step in range(3):
        events.append({"ph": "X", "cat": "user_annotation", "name": f"decode_step_{step}", "pid": 1, "tid": 1,
                       "ts": ts, "dur": 200.0})
        for name, dur in (("gemm_kernel", 20.0), ("ncclDevKernel_AllReduce_Sum_bf16_RING_LL(x)", 30.0)):
            corr += 1
            events += [{"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "pid": 1, "tid": 1,
                        "ts": ts + corr % 2, "dur": 1.0, "args": {"correlation": corr}},
                       {"ph": "X", "cat": "kernel", "name": name, "pid": 0, "tid": 7, "ts": ts + 5, "dur": dur,
                        "args": {"stream": 7, "correlation": corr}}]
            ts += dur + 1
        ts += 230.0
    path = tmp_path / "user.json"
    path.write_text(json.dumps({"traceEvents": events}))
    [r] = attribute.analyse_traces([path], NO_HINT)[1]
    assert r.rule == "annotation" and r.rule_detail == "annotation /step/"
    assert [len(s.calls) for s in r.steps] == [1, 1, 1] and {s.phase for s in r.steps} == {"decode"}
    # The recorded sets' own record_function("decode_step") too, when the graph rule is not asked.
    [r] = attribute.analyse_traces(_files(P2P)[:1], NO_HINT, rule="annotation")[1]
    assert r.rule_detail == "annotation /step/" and len(r.steps) == P2P["steps"]


def _step(index: int, wall_us: float) -> Step:
    return Step(0, index, "decode", 0.0, wall_us, wall_us)


def test_a_first_step_far_over_the_median_is_set_apart_and_per_step_figures_are_medians(tmp_path: Path) -> None:
    from commbench.analysis.attribution import set_first_apart
    from commbench.analysis.curves import decode_curves
    from commbench.runs import load_run

    ranks, results = attribute.analyse_traces(_files(P2P)[:2], NO_HINT)
    steps = results[0].steps
    slow = _step(-1, 600_000.0)
    slow.calls = list(steps[0].calls)
    for r in results:
        r.steps.insert(0, slow)
    assert set_first_apart(results)
    assert all(r.first_apart is slow for r in results) and len(results[0].steps) == P2P["steps"]
    assert "rank 0 600,000 us against a median of" in (attribute.first_apart_text(results) or "")
    # "of step" is d/step over the median step wall: a slow step among them moves it not at all.
    curves = decode_curves(load_run(RUN4), 4, "bf16", "auto")
    with_slow = against_floor([slow, *steps], curves, 8)
    median_wall = statistics.median([slow.wall_us, *(s.wall_us for s in steps)])
    for line in with_slow:
        if line.floor is not None:
            assert line.floor.share_of_step == pytest.approx(line.floor.saving_per_step_us / median_wall)


def test_report_trace_draws_each_ranks_wait_and_transfer(tmp_path: Path) -> None:
    assert cli_main(["report", str(RUN4), "--out", str(tmp_path / "rep"),
                     *[a for p in _files(P2P) for a in ("--trace", str(p))]]) == 0
    page = (tmp_path / "rep" / "report.html").read_text()
    assert "waiting or moving" in page and "late rank" in page
    assert (tmp_path / "rep" / "plots" / "trace_skew.png").stat().st_size > 0
